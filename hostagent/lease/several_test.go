package lease_test

import (
	"context"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// deviceIDs are the device ids of leases, in order.
func deviceIDs(ls []*vmflowv1.Lease) []string {
	var out []string
	for _, l := range ls {
		out = append(out, store.ClaimDevice(l.GetVgpu()))
	}
	return out
}

// holdOpen starts a process holding node open, as QEMU holds a VFIO group,
// and returns what ends it.
func holdOpen(t *testing.T, node string) (stop func()) {
	t.Helper()
	child, err := proc.Start(exec.Command("sh", "-c", "exec 3<\"$0\"; exec sleep 60", node))
	require.NoError(t, err)
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			_ = proc.Signal(child.Identity(), syscall.SIGKILL)
			<-child.Done()
		}
	}
	t.Cleanup(stop)
	require.Eventually(t, func() bool {
		hs, err := proc.Holders(context.Background(), node)
		return err == nil && len(proctest.Certain(hs)) > 0
	}, 10*time.Second, 5*time.Millisecond)
	return stop
}

// TestClaimSeveralAllOrNothing: two vGPUs are two devices, each written
// ahead and active; a claim the host cannot fill whole (capacity runs out
// part-way) leaves its record holding nothing and no device of its own,
// and the other instance's devices untouched.
func TestClaimSeveralAllOrNothing(t *testing.T) {
	for _, tc := range []struct {
		name    string
		opts    vgpusim.Options
		profile string
	}{
		{"mdev", vgpusim.Options{MdevParents: 2}, "GRID A100-20C"}, // two per GPU: four slots
		{"vendor", vgpusim.Options{VendorVFs: 4}, vendorProfile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newClaims(t, tc.opts)
			ctx := context.Background()
			e.record(t, "vm1")
			got, err := e.claims.Claim(ctx, "vm1", tc.profile, 2)
			require.NoError(t, err)
			require.Len(t, got, 2)
			ids := deviceIDs(got)
			assert.NotEqual(t, ids[0], ids[1], "two vGPUs are two devices")
			for _, l := range got {
				assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, l.GetPhase())
			}
			assert.Len(t, e.devices(t), 2)

			again, err := e.claims.Claim(ctx, "vm1", tc.profile, 2)
			require.NoError(t, err)
			assert.Equal(t, ids, deviceIDs(again), "a retried claim returns the same devices")
			_, err = e.claims.Claim(ctx, "vm1", tc.profile, 1)
			require.ErrorIs(t, err, lease.ErrClaimConflict, "it holds two")

			e.record(t, "vm2")
			_, err = e.claims.Claim(ctx, "vm2", tc.profile, 3)
			require.ErrorIs(t, err, gpu.ErrNoCapacity)
			assert.Contains(t, err.Error(), "vGPU 3 of 3")
			rec, err := e.st.Get("vm2")
			require.NoError(t, err)
			assert.Empty(t, rec.GetLeases(), "the failed claim is undone: no lease, held or not")
			var left []string
			for _, d := range e.devices(t) {
				left = append(left, d.ID)
			}
			assert.ElementsMatch(t, ids, left, "vm2's two devices are gone, vm1's stay")

			got2, err := e.claims.Claim(ctx, "vm2", tc.profile, 2)
			require.NoError(t, err, "the slots the rollback freed are free")
			assert.Len(t, got2, 2)
		})
	}
}

// TestClaimPartWayFinishedByRetry: a claim that failed part-way for a
// reason a retry may change (a create's EIO) keeps what it wrote, and the
// retry finishes it: the first vGPU stays the same device, the second
// keeps the UUID its intent recorded.
func TestClaimPartWayFinishedByRetry(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 2})
	ctx := context.Background()
	e.record(t, "vm1")
	first, err := e.claims.Claim(ctx, "vm1", profile, 1)
	require.NoError(t, err)
	e.sim.Set(t, vgpusim.CtlFailCreate, "EIO")
	_, err = e.claims.Claim(ctx, "vm1", profile, 2)
	require.ErrorIs(t, err, syscall.EIO)
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	held := store.HeldVGPUs(rec)
	require.Len(t, held, 2, "the second intent was written ahead and kept")
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, held[0].GetPhase())
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, held[1].GetPhase())

	e.sim.Clear(t, vgpusim.CtlFailCreate)
	got, err := e.claims.Claim(ctx, "vm1", profile, 2)
	require.NoError(t, err)
	assert.Equal(t, deviceIDs(first)[0], deviceIDs(got)[0])
	assert.Equal(t, held[1].GetVgpu().GetUuid(), got[1].GetVgpu().GetUuid(), "the intent is finished, not replaced")
	assert.Len(t, e.devices(t), 2)
}

// TestClaimFinishesInterruptedRollback: an agent that died while undoing a
// failed claim left a lease rolling back (its device may or may not be
// gone); the next claim finishes the undo first, then claims afresh.
func TestClaimFinishesInterruptedRollback(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	e.record(t, "vm1")
	got, err := e.claims.Claim(ctx, "vm1", profile, 1)
	require.NoError(t, err)
	_, err = e.st.Apply(ctx, "vm1", store.LeaseRollingBack(store.LeaseName(got[0])))
	require.NoError(t, err)

	again, err := e.claims.Claim(ctx, "vm1", profile, 1)
	require.NoError(t, err)
	assert.NotEqual(t, deviceIDs(got), deviceIDs(again), "the interrupted claim's device was released, a new one made")
	ds := e.devices(t)
	require.Len(t, ds, 1)
	assert.Equal(t, deviceIDs(again)[0], ds[0].ID)
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.Len(t, rec.GetLeases(), 1)
}

// TestReleaseSeveralKeepsTheFailedOne: the delete's release releases every
// vGPU it may; one a process still holds keeps its lease and the record
// (ReleaseFailed), the other is released, and a retry once the holder is
// gone finishes.
func TestReleaseSeveralKeepsTheFailedOne(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 2})
	ctx := context.Background()
	e.record(t, "vm1")
	got, err := e.claims.Claim(ctx, "vm1", profile, 2)
	require.NoError(t, err)
	ids := deviceIDs(got)
	stop := holdOpen(t, e.vfioNode(t, ids[1]))
	e.beginDelete(t, "vm1")

	released, devs, err := e.claims.Release(ctx, "vm1")
	require.ErrorIs(t, err, lease.ErrDeviceHeld)
	assert.Contains(t, err.Error(), ids[1])
	assert.False(t, released)
	assert.Equal(t, ids[:1], devs, "the free one is released all the same")
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED, rec.GetState())
	held := store.HeldVGPUs(rec)
	require.Len(t, held, 1)
	assert.Equal(t, ids[1], store.ClaimDevice(held[0].GetVgpu()))
	assert.EqualValues(t, 1, held[0].GetReleaseAttempts())
	require.ErrorIs(t, e.st.Delete(ctx, "vm1"), store.ErrClaimHeld)

	stop()
	released, devs, err = e.claims.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
	assert.Equal(t, ids[1:], devs)
	assert.Empty(t, e.devices(t))
	require.NoError(t, e.st.Delete(ctx, "vm1"))
}

// TestRollbackNeverAfterLaunch: a record that launched keeps its leases
// when a claim fails: only a delete releases what a VM may have had.
func TestRollbackNeverAfterLaunch(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 1})
	ctx := context.Background()
	e.record(t, "vm1")
	_, err := e.claims.Claim(ctx, "vm1", "GRID A100-20C", 1)
	require.NoError(t, err)
	_, err = e.st.Apply(ctx, "vm1", store.BeginLaunch(time.Now(), nil))
	require.NoError(t, err)
	_, err = e.claims.Claim(ctx, "vm1", "GRID A100-20C", 3) // one parent: two slots
	require.ErrorIs(t, err, gpu.ErrNoCapacity)
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.NotEmpty(t, store.HeldVGPUs(rec), "kept for the delete")
	assert.NotEmpty(t, e.devices(t))
}
