package lease_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// capacityHost is a ledger over a fresh store: 2 CPUs × cpuRatio vCPUs,
// 10 GiB less a 1 GiB reserve, × memRatio; now is the ledger's clock.
type capacityHost struct {
	st  *store.Store
	cap *lease.Capacity
	cfg lease.CapacityConfig
	now time.Time
	mu  sync.Mutex
}

func newCapacityHost(t *testing.T, cpuRatio, memRatio float64) *capacityHost {
	t.Helper()
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	// The agent's store: the ledger sums its index.
	require.NoError(t, st.OpenIndex(context.Background(), func(context.Context) (map[uint32]bool, error) { return nil, nil }))
	t.Cleanup(func() { _ = st.Close() })
	h := &capacityHost{st: st, now: time.Date(2026, 12, 6, 8, 0, 0, 0, time.UTC)}
	h.cap, err = lease.NewCapacity(lease.CapacityConfig{Store: st, CPUs: 2, MemoryMiB: 10240, MemoryReserveMiB: 1024,
		CPUOvercommit: cpuRatio, MemoryOvercommit: memRatio, TTL: 10 * time.Minute, Now: h.clock})
	require.NoError(t, err)
	return h
}

func (h *capacityHost) clock() time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.now
}

func (h *capacityHost) advance(d time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.now = h.now.Add(d)
}

// vm is a KVM spec of vcpus and mib of guest RAM (what it holds: mib +
// QEMU's 256 MiB).
func vm(vcpus, mib uint32) *vmflowv1.VMSpec {
	return &vmflowv1.VMSpec{Vcpus: vcpus, MemoryMib: mib, Machine: "q35", Accel: "kvm"}
}

func (h *capacityHost) create(id string, spec *vmflowv1.VMSpec) (*vmflowv1.InstanceRecord, error) {
	return h.st.Create(context.Background(), &vmflowv1.InstanceRecord{Id: id, Spec: spec},
		store.Reserving(h.cap.Reserve(id, spec)))
}

func (h *capacityHost) place(t *testing.T, id string) (*vmflowv1.InstanceRecord, error) {
	t.Helper()
	l, err := h.st.Lock(context.Background(), id)
	require.NoError(t, err)
	defer l.Unlock()
	return h.cap.Place(context.Background(), l)
}

func TestCapacityRefusesBeyondTheLedgerAndWritesNothing(t *testing.T) {
	h := newCapacityHost(t, 4, 1) // 8 vCPUs, 9216 MiB
	assert.Equal(t, lease.Limits{VCPUs: 8, MemoryMiB: 9216, PhysicalMiB: 9216}, h.cap.Limits())

	rec, err := h.create("a", vm(4, 4096-256))
	require.NoError(t, err)
	l := store.Capacity(rec)
	require.NotNil(t, l, "the record is born holding its share")
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, l.GetPhase())
	assert.EqualValues(t, 4096, l.GetCapacity().GetMemoryMib(), "guest RAM plus QEMU's own, as its cgroup allows")
	assert.Equal(t, h.clock().Add(10*time.Minute), l.GetCapacity().GetExpiresAt().AsTime())

	_, err = h.create("b", vm(4, 4096-256))
	require.NoError(t, err)
	// 1024 MiB left: a VM whose share is 1025 MiB does not fit.
	_, err = h.create("c", vm(1, 1025-256))
	require.ErrorIs(t, err, lease.ErrNoHostCapacity)
	assert.Same(t, errdefs.NoHostCapacity, errdefs.ClassOf(err))
	assert.True(t, errdefs.ClassOf(err).Retryable(), "a refusal for room is retried: room frees")
	assert.Contains(t, err.Error(), "asks 1 vCPUs and 1025 MiB")
	assert.Contains(t, err.Error(), "free: 0 of 8 vCPUs")
	_, gerr := h.st.Get("c")
	assert.ErrorIs(t, gerr, store.ErrNotFound, "a refused create leaves no record to clean up")

	// The same create again is the same record, not a second share.
	again, err := h.create("a", vm(4, 4096-256))
	require.NoError(t, err)
	assert.Len(t, again.GetLeases(), 1)
	u, err := h.cap.Usage("")
	require.NoError(t, err)
	assert.Equal(t, lease.Usage{VCPUs: 8, MemoryMiB: 8192}, u)
}

// TestCapacityBurstNeverOverbooks: 50 concurrent creates into room for 20
// make exactly 20 records; the other 30 are refused for room.
func TestCapacityBurstNeverOverbooks(t *testing.T) {
	h := newCapacityHost(t, 10, 1) // 20 vCPUs
	var wg sync.WaitGroup
	errs := make([]error, 50)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = h.create(fmt.Sprintf("vm%02d", i), vm(1, 64))
		}()
	}
	wg.Wait()
	made, refused := 0, 0
	for _, err := range errs {
		switch {
		case err == nil:
			made++
		case errors.Is(err, lease.ErrNoHostCapacity):
			refused++
		default:
			t.Errorf("unexpected error: %v", err)
		}
	}
	assert.Equal(t, 20, made)
	assert.Equal(t, 30, refused)
	recs, err := h.st.List()
	require.NoError(t, err)
	assert.Len(t, recs, 20)
	u, err := h.cap.Usage("")
	require.NoError(t, err)
	assert.EqualValues(t, 20, u.VCPUs, "the ledger is the records' sum")
}

func TestCapacityReservationExpiresAndIsReservedAgainAtLaunch(t *testing.T) {
	h := newCapacityHost(t, 1, 1) // 2 vCPUs
	_, err := h.create("slow", vm(2, 64))
	require.NoError(t, err)
	_, err = h.create("other", vm(2, 64))
	require.ErrorIs(t, err, lease.ErrNoHostCapacity, "an unexpired reservation counts")

	h.advance(10 * time.Minute)
	_, err = h.create("other", vm(2, 64))
	require.NoError(t, err, "a reservation no launch made active stops counting after its TTL")

	_, err = h.place(t, "slow")
	require.ErrorIs(t, err, lease.ErrNoHostCapacity, "the late launch reserves again, against the room now taken")

	rec, err := h.place(t, "other")
	require.NoError(t, err)
	l := store.Capacity(rec)
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, l.GetPhase())
	assert.Nil(t, l.GetCapacity().GetExpiresAt(), "an active share never expires")
	h.advance(time.Hour)
	_, err = h.create("third", vm(1, 64))
	require.ErrorIs(t, err, lease.ErrNoHostCapacity, "an active share counts however old")

	// A restart places again: the active share is kept, nothing reserved.
	again, err := h.place(t, "other")
	require.NoError(t, err)
	assert.Equal(t, rec.GetUpdatedAt().AsTime(), again.GetUpdatedAt().AsTime(), "nothing written")
}

func TestCapacityGPUMemoryIsNeverOvercommitted(t *testing.T) {
	h := newCapacityHost(t, 4, 2) // 9216 MiB, 18432 with the ratio
	_, err := h.create("cpu", vm(1, 8192-256))
	require.NoError(t, err)
	gpuVM := vm(1, 2048-256)
	gpuVM.VgpuProfile = "nvidia-1"
	_, err = h.create("gpu", gpuVM)
	require.ErrorIs(t, err, lease.ErrNoHostCapacity, "pinned memory must fit the memory itself")
	assert.Contains(t, err.Error(), "pinned")
	_, err = h.create("cpu2", vm(1, 2048-256))
	require.NoError(t, err, "a CPU-only VM may use the overcommit")
}

// TestCapacityCountsRecordsFromBeforeTheLedger: a record an older agent
// wrote (no capacity lease) holds its spec's share while a QEMU of it may
// run, and its next launch gives it a lease.
func TestCapacityCountsRecordsFromBeforeTheLedger(t *testing.T) {
	h := newCapacityHost(t, 1, 1) // 2 vCPUs
	ctx := context.Background()
	_, err := h.st.Create(ctx, &vmflowv1.InstanceRecord{Id: "old", Spec: vm(2, 64)})
	require.NoError(t, err)
	u, err := h.cap.Usage("")
	require.NoError(t, err)
	assert.Zero(t, u.VCPUs, "a record that never launched and holds no share counts nothing")

	rec, err := h.place(t, "old")
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, store.Capacity(rec).GetPhase())
	_, err = h.create("new", vm(1, 64))
	require.ErrorIs(t, err, lease.ErrNoHostCapacity)
}

// TestCapacityLeaseReleasedByTheEngine: the delete's release stage
// releases the share (the thread group is gone), and then the record may
// be removed and its room is free.
func TestCapacityLeaseReleasedByTheEngine(t *testing.T) {
	h := newCapacityHost(t, 1, 1)
	ctx := context.Background()
	_, err := h.create("vm", vm(2, 64))
	require.NoError(t, err)
	require.ErrorIs(t, h.st.Delete(ctx, "vm"), store.ErrClaimHeld, "a held share keeps the record")

	l, err := h.st.Lock(ctx, "vm")
	require.NoError(t, err)
	_, err = l.BeginDelete(store.Spawn{})
	require.NoError(t, errors.Join(err, l.Unlock()))
	e := lease.NewHostEngine(lease.EngineConfig{Store: h.st}, nil, nil)
	out, err := e.Release(ctx, "vm")
	require.NoError(t, err)
	require.True(t, out.All)
	require.NoError(t, h.st.Delete(ctx, "vm"))
	_, err = h.create("next", vm(2, 64))
	require.NoError(t, err, "the released share is free again")
}

// TestCapacityUnreadableRecordPromisesNothing: while a record cannot be
// read, what it holds is not known, so no create is promised room; once
// it is repaired, the ledger counts it again. Counting it as nothing let
// its repair put the host over its capacity.
func TestCapacityUnreadableRecordPromisesNothing(t *testing.T) {
	// The record is cut behind the agent's index: seen at the agent's next
	// read of it, or at its next start (the seed).
	for _, seen := range []string{"read", "restart"} {
		t.Run(seen, func(t *testing.T) {
			h := newCapacityHost(t, 1, 1) // 2 vCPUs
			_, err := h.create("big", vm(2, 64))
			require.NoError(t, err)
			p, err := h.st.Paths("big")
			require.NoError(t, err)
			good, err := os.ReadFile(p.Record)
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(p.Record, good[:len(good)/2], 0o600))
			if seen == "read" {
				_, err = h.st.Get("big")
				require.ErrorIs(t, err, store.ErrInvalidRecord)
			} else {
				require.NoError(t, h.st.Close())
				require.NoError(t, h.st.OpenIndex(context.Background(), func(context.Context) (map[uint32]bool, error) { return nil, nil }))
			}

			_, err = h.create("small", vm(1, 64))
			require.ErrorIs(t, err, lease.ErrLedgerUnreadable)
			assert.True(t, errdefs.ClassOf(err).Retryable())
			_, gerr := h.st.Get("small")
			assert.ErrorIs(t, gerr, store.ErrNotFound, "nothing written")

			require.NoError(t, os.WriteFile(p.Record, good, 0o600))
			_, err = h.create("small", vm(1, 64))
			require.ErrorIs(t, err, lease.ErrNoHostCapacity, "repaired, it holds the host's 2 vCPUs")
		})
	}
}

// The ledger kept from the index's changes (the tally) is the ledger
// summed over the records on disk, through reservations, placements,
// expiries, deletes, a record cut by hand, more changes than the index
// remembers, and a restart (another index).
func TestCapacityTallyAgreesWithTheRecords(t *testing.T) {
	h := newCapacityHost(t, 4, 1) // 8 vCPUs
	ctx := context.Background()
	agree := func(when string) {
		t.Helper()
		got, err := h.cap.Usage("")
		if err != nil {
			require.ErrorIs(t, err, lease.ErrLedgerUnreadable)
		}
		recs, lerr := h.st.List()
		bad, _ := store.Unreadable(lerr)
		assert.Equal(t, h.cap.UsageOf(recs, len(bad)), got, when)
		// And without each instance (its own launch's look).
		for i, r := range recs {
			got, _ := h.cap.Usage(r.GetId())
			others := append(slices.Clone(recs[:i]), recs[i+1:]...)
			assert.Equal(t, h.cap.UsageOf(others, len(bad)), got, "%s, but %s", when, r.GetId())
		}
	}
	for i := range 4 {
		_, err := h.create(fmt.Sprintf("vm%d", i), vm(1, 256))
		require.NoError(t, err)
	}
	agree("reserved")
	_, err := h.place(t, "vm0")
	require.NoError(t, err)
	_, err = h.place(t, "vm1")
	require.NoError(t, err)
	agree("two placed")
	h.advance(11 * time.Minute)
	agree("two reservations expired")
	require.NoError(t, h.st.MarkManualStop(ctx, "vm1"))
	_, err = h.st.Transition(ctx, "vm1", vmflowv1.InstanceState_INSTANCE_STATE_DELETING)
	require.NoError(t, err)
	engine := lease.NewHostEngine(lease.EngineConfig{Store: h.st}, nil, nil)
	_, err = engine.Release(ctx, "vm1")
	require.NoError(t, err)
	agree("one released")
	require.NoError(t, h.st.MarkManualStop(ctx, "vm3"))
	_, err = h.st.Transition(ctx, "vm3", vmflowv1.InstanceState_INSTANCE_STATE_DELETING)
	require.NoError(t, err)
	_, err = engine.Release(ctx, "vm3")
	require.NoError(t, err)
	require.NoError(t, h.st.Delete(ctx, "vm3"))
	agree("one deleted")

	p, err := h.st.Paths("vm0")
	require.NoError(t, err)
	good, err := os.ReadFile(p.Record)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, good[:len(good)/2], 0o600))
	_, err = h.st.Get("vm0")
	require.Error(t, err)
	agree("one cut")
	require.NoError(t, os.WriteFile(p.Record, good, 0o600))
	agree("repaired")

	for i := range 4200 { // more than the index remembers
		_, err := h.st.Update(ctx, "vm2", func(r *vmflowv1.InstanceRecord) error { r.LastError = fmt.Sprint(i); return nil })
		require.NoError(t, err)
	}
	_, err = h.place(t, "vm2")
	require.NoError(t, err)
	agree("after many changes")

	require.NoError(t, h.st.Close())
	require.NoError(t, h.st.OpenIndex(ctx, func(context.Context) (map[uint32]bool, error) { return nil, nil }))
	_, err = h.create("vm4", vm(2, 512))
	require.NoError(t, err)
	agree("after a restart")
}
