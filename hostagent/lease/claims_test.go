package lease_test

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

func TestMain(m *testing.M) {
	proctest.RunHelperIfRequested()
	os.Exit(m.Run())
}

const profile = "GRID A100-4C"

// clock is the test's time for Claims: read by goroutines Claims starts
// (a late release records its time), so it is guarded.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Now()} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

type claimsEnv struct {
	sim    *simtest.Sim
	st     *store.Store
	claims *lease.Claims
	devDir string
	now    *clock
}

// newClaims mounts a simulator and sets up a store and claims over it. pid 1
// of a sandbox can be more privileged than root here; it is ignored only
// when it really cannot be inspected.
func newClaims(t *testing.T, opts vgpusim.Options) *claimsEnv {
	t.Helper()
	e := &claimsEnv{sim: simtest.Start(t, opts), now: newClock()}
	state, err := os.MkdirTemp("/tmp", "cl")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(state) })
	e.st, err = store.New(state)
	require.NoError(t, err)
	e.devDir = t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(e.devDir, "vfio"), 0o755))
	e.claims, err = lease.New(lease.Config{
		Driver: gpu.Config{SysfsRoot: e.sim.Root, StateDir: state}, Store: e.st, DevRoot: e.devDir,
		OrphanGrace: time.Minute, IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now,
	})
	require.NoError(t, err)
	require.NotNil(t, e.claims)
	return e
}

func (e *claimsEnv) record(t *testing.T, id string) {
	t.Helper()
	_, err := e.st.Create(context.Background(), &vmflowv1.InstanceRecord{Id: id, Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", VgpuProfile: profile}})
	require.NoError(t, err)
}

// beginDelete does what the delete path does before a release.
func (e *claimsEnv) beginDelete(t *testing.T, id string) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, e.st.MarkManualStop(ctx, id))
	_, err := e.st.Transition(ctx, id, vmflowv1.InstanceState_INSTANCE_STATE_DELETING)
	require.NoError(t, err)
}

func (e *claimsEnv) setProcess(t *testing.T, id string, pid proc.Identity) {
	t.Helper()
	_, err := e.st.Update(context.Background(), id, func(r *vmflowv1.InstanceRecord) error {
		r.Process = &vmflowv1.ProcessIdentity{Pid: int32(pid.PID), StartTime: pid.StartTime, BootId: pid.BootID}
		return nil
	})
	require.NoError(t, err)
}

func (e *claimsEnv) devices(t *testing.T) []gpu.Device {
	t.Helper()
	ds, err := e.claims.Driver().Devices(context.Background())
	require.NoError(t, err)
	return ds
}

// vfioNode is the simulated VFIO node of a device (its IOMMU group).
func (e *claimsEnv) vfioNode(t *testing.T, devID string) string {
	t.Helper()
	target, err := os.Readlink(filepath.Join(e.sim.Root, "bus", "mdev", "devices", devID, "iommu_group"))
	require.NoError(t, err)
	node := filepath.Join(e.devDir, "vfio", filepath.Base(target))
	require.NoError(t, os.WriteFile(node, nil, 0o600))
	return node
}

func TestClaimWritesIntentThenActive(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 2})
	e.record(t, "vm1")
	ctx := context.Background()
	c, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, c.GetPhase())
	assert.Equal(t, profile, c.GetVgpu().GetProfile())
	require.Len(t, e.devices(t), 1)
	assert.Equal(t, c.GetVgpu().GetDeviceId(), e.devices(t)[0].ID)
	assert.Equal(t, filepath.Join(e.sim.Root, "bus/mdev/devices", c.GetVgpu().GetDeviceId()), e.claims.DevicePath(c))

	again, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)
	assert.Equal(t, c.GetVgpu().GetDeviceId(), again.GetVgpu().GetDeviceId(), "a retried claim returns the same device")
	assert.Len(t, e.devices(t), 1)

	_, err = claimOne(ctx, e.claims, "vm1", "GRID A100-8C")
	assert.ErrorIs(t, err, lease.ErrClaimConflict)
}

// TestReleaseRefusedWhileVMAlive: invariant 2, with a real zombie leader
// whose live thread stands in for QEMU's VFIO-holding workers.
func TestReleaseRefusedWhileVMAlive(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	e.record(t, "vm1")
	ctx := context.Background()
	_, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)

	z := proctest.StartZombie(t)
	id, err := proc.ReadIdentity(z.PID)
	require.NoError(t, err)
	e.setProcess(t, "vm1", id)
	e.beginDelete(t, "vm1")

	released, _, err := e.claims.Release(ctx, "vm1")
	require.ErrorIs(t, err, lease.ErrVMAlive)
	assert.Contains(t, err.Error(), "zombie-leader")
	assert.False(t, released)
	assert.Len(t, e.devices(t), 1, "the device must stay while the VM may live")
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.True(t, store.ClaimHeld(rec))
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED, rec.GetState())
	assert.EqualValues(t, 1, store.VGPU(rec).GetReleaseAttempts())

	z.Release(t)
	require.Eventually(t, func() bool { return !proc.Inspect(id).Alive }, 10*time.Second, 5*time.Millisecond)
	released, _, err = e.claims.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
	assert.Empty(t, e.devices(t))
	rec, err = e.st.Get("vm1")
	require.NoError(t, err)
	assert.False(t, store.ClaimHeld(rec))
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_DELETING, rec.GetState(), "ReleaseFailed goes back to Deleting")
}

// TestReleaseRefusedWhileDeviceHeld: a process with the VFIO node open
// blocks the release, and the error names it.
func TestReleaseRefusedWhileDeviceHeld(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	e.record(t, "vm1")
	ctx := context.Background()
	c, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)
	node := e.vfioNode(t, c.GetVgpu().GetDeviceId())
	e.beginDelete(t, "vm1")

	stop := holdOpen(t, node)

	_, _, err = e.claims.Release(ctx, "vm1")
	require.ErrorIs(t, err, lease.ErrDeviceHeld)
	assert.Contains(t, err.Error(), "pid ")
	assert.Len(t, e.devices(t), 1)

	stop()
	released, _, err := e.claims.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
}

// TestFailedReleaseKeepsRecordAndClaim: invariant 1 end to end.
func TestFailedReleaseKeepsRecordAndClaim(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	e.record(t, "vm1")
	ctx := context.Background()
	_, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)
	e.beginDelete(t, "vm1")
	e.sim.Set(t, vgpusim.CtlFailRelease, "EIO")

	for i := 1; i <= 3; i++ {
		_, _, err = e.claims.Release(ctx, "vm1")
		require.ErrorIs(t, err, syscall.EIO)
		rec, err := e.st.Get("vm1")
		require.NoError(t, err)
		assert.True(t, store.ClaimHeld(rec))
		assert.EqualValues(t, i, store.VGPU(rec).GetReleaseAttempts())
		assert.Contains(t, store.VGPU(rec).GetLastReleaseError(), "input/output error")
		assert.ErrorIs(t, e.st.Delete(ctx, "vm1"), store.ErrClaimHeld, "the store refuses to forget a claimed GPU")
	}
	e.sim.Clear(t, vgpusim.CtlFailRelease)
	released, _, err := e.claims.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
	require.NoError(t, e.st.Delete(ctx, "vm1"))
}

// TestCrashBetweenIntentAndCreate: the intent is on disk, no device exists
// (the agent died, or the create failed). The delete path's release sees
// "already gone" and the record can go; a retried claim finishes the intent.
func TestCrashBetweenIntentAndCreate(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	e.record(t, "vm1")
	e.sim.Set(t, vgpusim.CtlFailCreate, "EIO")
	_, err := claimOne(ctx, e.claims, "vm1", profile)
	require.ErrorIs(t, err, syscall.EIO)
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	require.True(t, store.ClaimHeld(rec), "the intent was written ahead")
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, store.VGPU(rec).GetPhase())
	assert.Empty(t, e.devices(t))

	// A spawn owns it: reconcile leaves it alone.
	res, err := e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetClaimsReleased())

	// Retried claim finishes the intent at its recorded UUID.
	e.sim.Clear(t, vgpusim.CtlFailCreate)
	c, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)
	assert.Equal(t, store.VGPU(rec).GetVgpu().GetUuid(), c.GetVgpu().GetUuid())
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, c.GetPhase())

	// The other way out: the instance is deleted with an intent only.
	e.record(t, "vm2")
	e.sim.Set(t, vgpusim.CtlFailCreate, "EIO")
	_, err = claimOne(ctx, e.claims, "vm2", profile)
	require.Error(t, err)
	e.beginDelete(t, "vm2")
	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetClaimsReleased())
	assert.Equal(t, []string{"vm2"}, res.GetRetriedDeletes())

	// The round that released it died before its wake-up reached the
	// delete: the next round wakes the delete again, releasing nothing.
	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetClaimsReleased())
	assert.Equal(t, []string{"vm2"}, res.GetRetriedDeletes(), "a lost wake-up is sent again")
	require.NoError(t, e.st.Delete(ctx, "vm2"), "nothing left to hold the record")
	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.Empty(t, res.GetRetriedDeletes(), "nothing to wake once the record is gone")
}

// TestCrashBetweenRemovalAndRecordUpdate: the device is gone but the record
// still says RELEASING: the next release (or reconcile) records it.
func TestCrashBetweenRemovalAndRecordUpdate(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	e.record(t, "vm1")
	c, err := claimOne(ctx, e.claims, "vm1", profile)
	require.NoError(t, err)
	e.beginDelete(t, "vm1")
	// The device goes (as if the write succeeded) and the agent dies before
	// writing released_at.
	_, err = e.st.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		store.VGPU(r).Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING
		return nil
	})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(e.sim.Root, "bus/mdev/devices", c.GetVgpu().GetDeviceId(), "remove"), []byte("1"), 0o200))
	assert.Empty(t, e.devices(t))

	res, err := e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetClaimsReleased())
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.False(t, store.ClaimHeld(rec))
	require.NoError(t, e.st.Delete(ctx, "vm1"))
}

// TestReconcileOrphans: a device no record claims is removed only after
// the grace period, and never while held.
func TestReconcileOrphans(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	orphan, err := e.claims.Driver().Create(ctx, gpu.CreateRequest{Profile: profile, UUID: "2b6c4e3a-0d4f-4a8e-9a43-6f5d2e1c0b7a"})
	require.NoError(t, err)
	e.record(t, "vm1")
	_, err = claimOne(ctx, e.claims, "vm1", profile) // owned by a running spawn: never touched
	require.NoError(t, err)

	res, err := e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetOrphansRemoved(), "first seen now: inside the grace period")
	assert.Len(t, e.devices(t), 2)

	node := e.vfioNode(t, orphan.ID)
	f, err := os.Open(node)
	require.NoError(t, err)
	e.now.Advance(2 * time.Minute)
	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetOrphansRemoved(), "held open: left alone")
	f.Close()

	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetOrphansRemoved())
	ds := e.devices(t)
	require.Len(t, ds, 1)
	assert.NotEqual(t, orphan.ID, ds[0].ID, "the claimed device stays")
}

// claimOne claims one vGPU, as a spawn with vgpu_profile alone does.
func claimOne(ctx context.Context, c *lease.Claims, id, profile string) (*vmflowv1.Lease, error) {
	ls, err := c.Claim(ctx, id, profile, 1)
	if err != nil {
		return nil, err
	}
	return ls[0], nil
}
