package lease_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// granted creates id holding a capacity reservation that expires in ttl,
// as CreateRecord's grant does.
func granted(t *testing.T, st *store.Store, now time.Time, id string, spec *vmflowv1.VMSpec) {
	t.Helper()
	_, err := st.Create(context.Background(), &vmflowv1.InstanceRecord{Id: id, Spec: spec},
		store.Reserving(func(context.Context) (*vmflowv1.Lease, error) {
			return store.CapacityLeaseOf(&vmflowv1.CapacityLease{Vcpus: spec.GetVcpus(), MemoryMib: 512, ExpiresAt: timestamppb.New(now.Add(10 * time.Minute))}), nil
		}))
	require.NoError(t, err)
}

func offered(t *testing.T, o *lease.Offers, kind, name string) int {
	t.Helper()
	offers, err := o.GPUs(context.Background())
	require.NoError(t, err)
	for _, g := range offers {
		if g.GetKind() == kind && g.GetName() == name {
			return int(g.GetFree())
		}
	}
	t.Fatalf("no %s %q in %v", kind, name, offers)
	return 0
}

// TestOfferCountsGrantedSpawnsYetToClaim: the vGPUs a granted record has
// not claimed yet are not offered to the next spawn, and the grant's
// check refuses a spawn they would leave short (NoCapacity, nothing
// written); once claimed they count as devices, and a reservation that
// expired stops counting.
func TestOfferCountsGrantedSpawnsYetToClaim(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 2})
	o := &lease.Offers{Store: e.st, VGPU: e.claims, Now: e.now.Now}
	ctx := context.Background()
	base := offered(t, o, lease.OfferVGPU, profile)
	require.GreaterOrEqual(t, base, 4, "the simulator offers a few")

	spec := func(n uint32) *vmflowv1.VMSpec {
		return &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", VgpuProfile: profile, VgpuCount: n}
	}
	granted(t, e.st, e.now.Now(), "a", spec(2))
	assert.Equal(t, base-2, offered(t, o, lease.OfferVGPU, profile), "a's two are spoken for")
	err := o.Check(ctx, "b", spec(uint32(base-1)))
	assert.ErrorIs(t, err, errdefs.NoCapacity)
	assert.Contains(t, err.Error(), "free for new spawns: ")
	assert.NoError(t, o.Check(ctx, "b", spec(uint32(base-2))))
	assert.NoError(t, o.Check(ctx, "a", spec(uint32(base))), "a record's own demand is not counted against it")

	_, err = e.claims.Claim(ctx, "a", profile, 2)
	require.NoError(t, err)
	assert.Equal(t, base-2, offered(t, o, lease.OfferVGPU, profile), "claimed: the devices count, not the demand")

	granted(t, e.st, e.now.Now(), "c", spec(1))
	assert.Equal(t, base-3, offered(t, o, lease.OfferVGPU, profile))
	e.now.Advance(11 * time.Minute)
	assert.Equal(t, base-2, offered(t, o, lease.OfferVGPU, profile), "an expired reservation gives its demand back")

	assert.NoError(t, o.Check(ctx, "d", &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none"}), "a spawn without GPUs")
}

// TestOfferWholeGPUsByModel: whole GPUs are offered by model, free only
// while no held lease names them, and a request for any model counts
// against every model.
func TestOfferWholeGPUsByModel(t *testing.T) {
	e := newWhole(t, 3)
	o := &lease.Offers{Store: e.st, Whole: e.whole, Now: e.now.Now}
	ctx := context.Background()
	free := func() map[string]int {
		offers, err := o.GPUs(ctx)
		require.NoError(t, err)
		m := map[string]int{}
		for _, g := range offers {
			assert.Equal(t, lease.OfferPassthrough, g.GetKind())
			m[g.GetName()] = int(g.GetFree())
		}
		return m
	}
	models := free()
	require.Len(t, models, 2, "the simulator's two models")
	var big string // the model with two GPUs
	for m, n := range models {
		if n == 2 {
			big = m
		}
	}
	require.NotEmpty(t, big, "%v", models)
	of := func(model string, n uint32) *vmflowv1.VMSpec {
		return &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", GpuPassthroughCount: n, GpuPassthroughModel: model}
	}

	assert.NoError(t, o.Check(ctx, "b", of(big, 2)))
	granted(t, e.st, e.now.Now(), "a", of("", 2))
	for m, n := range free() {
		assert.Equal(t, max(models[m]-2, 0), n, "%s: a's two of any model may come from it", m)
	}
	err := o.Check(ctx, "b", of(big, 1))
	assert.ErrorIs(t, err, lease.ErrNoWholeGPU, "3 GPUs, 2 spoken for by any model: one left, counted against both")
	assert.NoError(t, o.Check(ctx, "b", of("", 1)))
	_, err = e.whole.Claim(ctx, "a", "", 2)
	require.NoError(t, err)
	left := 0
	for _, n := range free() {
		left += n
	}
	assert.Equal(t, 1, left, "claimed: two GPUs are held, the demand is gone")
	assert.NoError(t, o.Check(ctx, "b", of("", 1)))
	assert.ErrorIs(t, o.Check(ctx, "b", of("", 2)), lease.ErrNoWholeGPU)
}

// TestViewOfCapacityAndDrain: the view's free figures are the ledger's
// (a reservation in flight taken, and counted as in flight until its
// launch or expiry), pinned memory has no overcommit, and a drain shows
// with its reason.
func TestViewOfCapacityAndDrain(t *testing.T) {
	h := newCapacityHost(t, 4, 2) // 8 vCPUs; 9216 MiB, × 2 = 18432 MiB
	o := &lease.Offers{Store: h.st, Capacity: h.cap, Now: h.clock}
	ctx := context.Background()
	v, err := o.View(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 8, v.GetVcpusTotal())
	assert.EqualValues(t, 8, v.GetVcpusFree())
	assert.EqualValues(t, 18432, v.GetMemoryFreeMib())
	assert.EqualValues(t, 9216, v.GetPinnedMemoryFreeMib())
	assert.Zero(t, v.GetInFlight())
	assert.False(t, v.GetDraining())

	_, err = h.create("a", vm(3, 1024)) // holds 3 vCPUs, 1280 MiB
	require.NoError(t, err)
	v, err = o.View(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 5, v.GetVcpusFree())
	assert.EqualValues(t, 18432-1280, v.GetMemoryFreeMib())
	assert.EqualValues(t, 9216-1280, v.GetPinnedMemoryFreeMib())
	assert.EqualValues(t, 1, v.GetInFlight(), "granted, not launched")

	_, err = h.st.Drain(ctx, "maintenance", h.clock())
	require.NoError(t, err)
	h.advance(11 * time.Minute)
	v, err = o.View(ctx)
	require.NoError(t, err)
	assert.True(t, v.GetDraining())
	assert.Equal(t, "maintenance", v.GetDrainReason())
	assert.Zero(t, v.GetInFlight(), "an expired reservation is no longer in flight")
	assert.EqualValues(t, 8, v.GetVcpusFree())
}
