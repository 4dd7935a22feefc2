package store

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/proc"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// oldShapeRecord is a record.json as agents before leases wrote it: the
// instance's one vGPU claim in gpu_claim.
const oldShapeRecord = `{
  "id": "vm-old",
  "spec": {"vcpus": 1, "memory_mib": 256, "machine": "q35", "accel": "tcg", "vgpu_profile": "GRID A100-4C"},
  "state": "INSTANCE_STATE_RELEASE_FAILED",
  "gpu_claim": {
    "profile": "GRID A100-4C",
    "parent": "0000:3b:00.0",
    "type_id": "nvidia-471",
    "uuid": "6f9b6c1e-0000-4000-8000-000000000001",
    "phase": "CLAIM_PHASE_ACTIVE",
    "release_attempts": 2,
    "last_release_error": "device busy",
    "claimed_at": "2025-01-02T03:04:05Z",
    "driver": "mdev"
  }
}
`

// TestOldShapeRecordLoadsAndMigrates: a record file written before leases
// still loads, as a vgpu lease with its phase and release bookkeeping (so
// the removal guard holds it), and Migrate writes it back in the new shape
// once.
func TestOldShapeRecordLoadsAndMigrates(t *testing.T) {
	s := newStore(t)
	p, err := s.Paths("vm-old")
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(p.Dir, 0o700))
	require.NoError(t, os.WriteFile(p.Record, []byte(oldShapeRecord), 0o600))
	require.NoError(t, s.MarkManualStop(context.Background(), "vm-old"))

	rec, err := s.Get("vm-old")
	require.NoError(t, err)
	assert.Nil(t, rec.GetGpuClaim(), "readers never see the old shape")
	l := VGPU(rec)
	require.NotNil(t, l)
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, l.GetPhase())
	assert.EqualValues(t, 2, l.GetReleaseAttempts())
	assert.Equal(t, "device busy", l.GetLastReleaseError())
	assert.Equal(t, "6f9b6c1e-0000-4000-8000-000000000001", l.GetVgpu().GetUuid())
	assert.Equal(t, "mdev", l.GetVgpu().GetDriver())
	assert.Equal(t, int64(1735787045), l.GetClaimedAt().GetSeconds())
	require.ErrorIs(t, s.Delete(context.Background(), "vm-old"), ErrClaimHeld, "the migrated lease is held")

	done, err := s.Migrate(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{"vm-old"}, done)
	b, err := os.ReadFile(p.Record)
	require.NoError(t, err)
	assert.NotContains(t, string(b), "gpu_claim")
	assert.Contains(t, string(b), `"leases"`)
	done, err = s.Migrate(context.Background())
	require.NoError(t, err)
	assert.Empty(t, done, "migrated once")
	again, err := s.Get("vm-old")
	require.NoError(t, err)
	assert.Equal(t, LeaseName(l), LeaseName(VGPU(again)))
}

// TestBothShapesRefused: a record with gpu_claim beside a vgpu lease is no
// record an agent wrote; it is refused, not guessed at.
func TestBothShapesRefused(t *testing.T) {
	b := strings.Replace(oldShapeRecord, `"gpu_claim"`, `"leases": [{"vgpu": {"uuid": "x"}}], "gpu_claim"`, 1)
	_, err := DecodeRecord([]byte(b))
	require.ErrorIs(t, err, ErrInvalidRecord)
}

// TestDeleteFromReleaseFailedWithoutLease: a record left in ReleaseFailed
// by a release whose success was recorded elsewhere is removable once no
// lease is held: the store's own recovery, not the activity's. Fails if
// Delete refuses ReleaseFailed outright.
func TestDeleteFromReleaseFailedWithoutLease(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	mustCreate(t, s, "vm1")
	moveTo(t, s, "vm1", releaseFailed)
	require.NoError(t, s.Delete(ctx, "vm1"))
	_, err := s.Get("vm1")
	assert.ErrorIs(t, err, ErrNotFound)
}

// TestStepsRefuseTyped: each step checks its own precondition and refuses
// with a *StepError wrapping the sentinel callers branch on; nothing is
// written.
func TestStepsRefuseTyped(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	mustCreate(t, s, "vm1")
	pid := proc.Identity{PID: 1, StartTime: 1, BootID: "b"}

	_, err := s.Apply(ctx, "vm1", Forked(pid, time.Now()))
	var se *StepError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, "forked", se.Step)
	require.ErrorIs(t, err, ErrIllegalTransition, "no launch marker")

	_, err = s.Apply(ctx, "vm1", Running())
	require.ErrorIs(t, err, ErrIllegalTransition, "no process")

	lease := vgpuLease(&vmflowv1.VgpuLease{Uuid: "u1"}, 0)
	_, err = s.Apply(ctx, "vm1", LeaseIntent(lease, time.Now()))
	require.NoError(t, err)
	_, err = s.Apply(ctx, "vm1", LeaseIntent(vgpuLease(&vmflowv1.VgpuLease{Uuid: "u1"}, 0), time.Now()))
	require.ErrorIs(t, err, ErrConflict, "one device, one lease")
	_, err = s.Apply(ctx, "vm1", LeaseIntent(vgpuLease(&vmflowv1.VgpuLease{Uuid: "u2"}, 0), time.Now()))
	require.NoError(t, err, "several vGPUs per instance")
	_, err = s.Apply(ctx, "vm1", LeaseRolledBack("vgpu:u2"))
	require.ErrorIs(t, err, ErrIllegalTransition, "only a lease rolling back is dropped")
	_, err = s.Apply(ctx, "vm1", LeaseRollingBack("vgpu:u2"))
	require.NoError(t, err)
	rec, err := s.Apply(ctx, "vm1", LeaseRolledBack("vgpu:u2"))
	require.NoError(t, err)
	assert.Len(t, rec.GetLeases(), 1, "the rolled-back lease is dropped, the other kept")

	moveTo(t, s, "vm1", deleting)
	_, err = s.Apply(ctx, "vm1", BeginLaunch(time.Now(), nil))
	require.ErrorIs(t, err, ErrDeleting)
	_, err = s.Apply(ctx, "vm1", LeaseRollingBack("vgpu:u1"))
	require.ErrorIs(t, err, ErrIllegalTransition, "a delete releases, a rollback does not")
	rec, err = s.Get("vm1")
	require.NoError(t, err)
	assert.Nil(t, rec.GetLaunchStartedAt(), "a refused step writes nothing")
}

func TestGoneResetsCounterAfterStable(t *testing.T) {
	id := proc.Identity{PID: 42, StartTime: 7, BootID: "b"}
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	rec := func() *vmflowv1.InstanceRecord {
		return &vmflowv1.InstanceRecord{Id: "vm1", State: running,
			Process: ProcessRecord(id), RestartCount: 4, RestartStableAfterSeconds: 60, LastStart: timestamppb.New(start)}
	}
	keep := func(n []string) []string { return n }
	short := rec()
	applyTo(t, short, Gone(id, Exit{At: start.Add(59 * time.Second), Status: "signal: killed", Code: -1}, keep))
	assert.Equal(t, uint32(4), short.GetRestartCount(), "crashed before stable_after: the streak goes on")
	assert.Equal(t, exited, short.GetState())
	assert.Nil(t, short.GetProcess())

	stable := rec()
	applyTo(t, stable, Gone(id, Exit{At: start.Add(60 * time.Second), Code: -1}, keep))
	assert.Equal(t, uint32(0), stable.GetRestartCount(), "up for stable_after: a new streak")

	other := rec()
	applyTo(t, other, Gone(proc.Identity{PID: 43, StartTime: 7, BootID: "b"}, Exit{}, keep))
	assert.NotNil(t, other.GetProcess(), "another process's exit changes nothing")

	c := rec()
	c.State = creating
	applyTo(t, c, Gone(id, Exit{Code: -1}, keep))
	assert.Equal(t, creating, c.GetState(), "no Creating -> Exited")
}

// TestRestartAttemptOnlyForExited: the restart policy's attempt is
// recorded only for an exited VM with no QEMU recorded.
func TestRestartAttemptOnlyForExited(t *testing.T) {
	r := &vmflowv1.InstanceRecord{Id: "vm1", State: running}
	require.ErrorIs(t, applySteps([]Step{RestartAttempt(1)})(r), ErrIllegalTransition)
	r.State = exited
	r.Process = ProcessRecord(proc.Identity{PID: 1, StartTime: 1, BootID: "b"})
	require.ErrorIs(t, applySteps([]Step{RestartAttempt(1)})(r), ErrIllegalTransition)
	r.Process = nil
	applyTo(t, r, RestartAttempt(3))
	assert.EqualValues(t, 3, r.GetRestartCount())
}

// TestLeaseReleasingOnlyInADelete: only a delete releases what an instance
// holds; a lease of a live instance is refused its release step.
func TestLeaseReleasingOnlyInADelete(t *testing.T) {
	r := &vmflowv1.InstanceRecord{Id: "vm1", State: running,
		Leases: []*vmflowv1.Lease{vgpuLease(&vmflowv1.VgpuLease{Uuid: "u1"}, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE)}}
	require.ErrorIs(t, applySteps([]Step{LeaseReleasing("vgpu:u1")})(r), ErrIllegalTransition)
	r.State = deleting
	require.ErrorIs(t, applySteps([]Step{LeaseReleasing("vgpu:other")})(r), ErrIllegalTransition, "no such lease")
	applyTo(t, r, LeaseReleasing("vgpu:u1"))
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING, VGPU(r).GetPhase())
}

// TestNetworkLeaseKind: a network lease is named by its address, is held
// from its intent, keeps the record, and an instance has one at most;
// NetworkActive refuses a lease under release.
func TestNetworkLeaseKind(t *testing.T) {
	n := NetworkLease(&vmflowv1.NetworkLease{Tap: "vmtap0a580002", Mac: "02:00:00:00:00:01", Address: "10.88.0.2/24", Gateway: "10.88.0.1"})
	assert.Equal(t, KindNetwork, LeaseKind(n))
	assert.Equal(t, "network:10.88.0.2", LeaseName(n))
	r := &vmflowv1.InstanceRecord{Id: "vm1", State: running}
	applyTo(t, r, LeaseIntent(n, time.Now()))
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, Network(r).GetPhase())
	assert.True(t, AnyLeaseHeld(r))
	other := NetworkLease(&vmflowv1.NetworkLease{Tap: "vmtap0a580003", Address: "10.88.0.3/24"})
	require.ErrorIs(t, applySteps([]Step{LeaseIntent(other, time.Now())})(r), ErrConflict, "one network lease per instance")
	applyTo(t, r, NetworkActive())
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, Network(r).GetPhase())
	require.NoError(t, validateLeases(r))
	r.Leases = append(r.Leases, proto.CloneOf(other))
	require.ErrorIs(t, validateLeases(r), ErrInvalidRecord, "two network leases")
	r.Leases = r.Leases[:1]

	r.State = deleting
	require.ErrorIs(t, MayRemove(r), ErrClaimHeld, "the record stays while the address is held")
	applyTo(t, r, LeaseReleasing("network:10.88.0.2"))
	require.ErrorIs(t, applySteps([]Step{NetworkActive()})(r), ErrIllegalTransition)
	applyTo(t, r, LeaseReleased("network:10.88.0.2", time.Now()))
	require.NoError(t, MayRemove(r))
}
