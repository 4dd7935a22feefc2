package lease_test

import (
	"context"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

type wholeEnv struct {
	sim   *simtest.Sim
	st    *store.Store
	whole *lease.Whole
	now   *clock
}

// newWhole mounts a simulator with n PCI GPUs (PCIGPUAt: alone, with an
// audio function, behind a bridge, beside a NIC) and whole-GPU claims over
// it offering every GPU.
func newWhole(t *testing.T, n int) *wholeEnv {
	t.Helper()
	e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: n}, 0)
	return e
}

func (e *wholeEnv) record(t *testing.T, id string, count uint32) {
	t.Helper()
	_, err := e.st.Create(context.Background(), &vmflowv1.InstanceRecord{Id: id, Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none",
		GpuPassthroughCount: count}})
	require.NoError(t, err)
}

func (e *wholeEnv) beginDelete(t *testing.T, id string) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, e.st.MarkManualStop(ctx, id))
	_, err := e.st.Transition(ctx, id, vmflowv1.InstanceState_INSTANCE_STATE_DELETING)
	require.NoError(t, err)
}

// drivers is every function's driver of GPUs 0..n-1's groups.
func (e *wholeEnv) drivers(t *testing.T, n int) map[string]string {
	t.Helper()
	out := map[string]string{}
	for i := range n {
		g := vgpusim.PCIGPUAt(i)
		for _, a := range []string{g.GPU, g.Audio, g.Bridge, g.NIC} {
			if a != "" {
				d, ok := e.sim.Server.PCIDriver(a)
				require.True(t, ok, a)
				out[a] = d
			}
		}
	}
	return out
}

// TestWholeClaimAndRelease: two whole GPUs are two IOMMU groups, every
// endpoint of each on vfio-pci (the audio function travels with its GPU,
// the bridge stays), the lease naming each function's previous driver;
// the release gives every function back to it.
func TestWholeClaimAndRelease(t *testing.T) {
	e := newWhole(t, 3)
	ctx := context.Background()
	before := e.drivers(t, 3)
	e.record(t, "vm1", 2)
	got, err := e.whole.Claim(ctx, "vm1", "", 2)
	require.NoError(t, err)
	require.Len(t, got, 2)
	g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
	assert.Equal(t, g0.Group, got[0].GetGpuPassthrough().GetIommuGroup())
	assert.Equal(t, g1.Group, got[1].GetGpuPassthrough().GetIommuGroup())
	assert.ElementsMatch(t, []string{g1.GPU, g1.Audio}, store.PassthroughDevices(got[1]), "the audio function travels with its GPU")
	for _, f := range got[1].GetGpuPassthrough().GetFunctions() {
		assert.Equal(t, before[f.GetAddr()], f.GetPreviousDriver())
	}
	now := e.drivers(t, 3)
	for _, a := range []string{g0.GPU, g1.GPU, g1.Audio} {
		assert.Equal(t, "vfio-pci", now[a], a)
	}
	assert.Equal(t, before[vgpusim.PCIGPUAt(2).GPU], now[vgpusim.PCIGPUAt(2).GPU], "the third GPU is untouched")
	assert.Len(t, e.whole.DevicePaths(got[1]), 2, "QEMU gets one vfio-pci device per function")

	again, err := e.whole.Claim(ctx, "vm1", "", 2)
	require.NoError(t, err)
	assert.Equal(t, store.LeaseName(got[0]), store.LeaseName(again[0]), "a retried claim returns the same groups")

	e.record(t, "vm2", 1)
	g, err := e.whole.Claim(ctx, "vm2", vgpusim.PCIGPUAt(2).ID, 1)
	require.NoError(t, err)
	assert.Equal(t, vgpusim.PCIGPUAt(2).Group, g[0].GetGpuPassthrough().GetIommuGroup(), "never a group another claim holds")

	e.beginDelete(t, "vm1")
	released, devs, err := e.whole.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
	assert.ElementsMatch(t, []string{g0.GPU, g1.GPU, g1.Audio}, devs)
	after := e.drivers(t, 3)
	for _, a := range []string{g0.GPU, g1.GPU, g1.Audio} {
		assert.Equal(t, before[a], after[a], "%s back on its driver", a)
	}
	require.NoError(t, e.st.Delete(ctx, "vm1"))
}

// TestWholeClaimTooManyBindsNothing: three GPUs asked of a host with two
// viable groups (the fourth GPU's group holds a NIC): refused for capacity,
// with every function back on its driver and no lease in the record.
func TestWholeClaimTooManyBindsNothing(t *testing.T) {
	e := newWhole(t, 4)
	ctx := context.Background()
	before := e.drivers(t, 4)
	e.record(t, "vm1", 4)
	_, err := e.whole.Claim(ctx, "vm1", vgpusim.PCIGPUAt(0).ID, 3) // H200s: groups 0 and 2 viable, 3 not
	require.ErrorIs(t, err, lease.ErrNoWholeGPU)
	assert.Equal(t, before, e.drivers(t, 4), "nothing bound")
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.Empty(t, rec.GetLeases())
}

// TestWholeFailedUnbindKeepsLease: a return whose unbind fails keeps the
// lease and the record (ReleaseFailed, the error kept); once the fault
// clears the retry returns the group.
func TestWholeFailedUnbindKeepsLease(t *testing.T) {
	e := newWhole(t, 1)
	ctx := context.Background()
	before := e.drivers(t, 1)
	e.record(t, "vm1", 1)
	_, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	e.beginDelete(t, "vm1")
	e.sim.Set(t, vgpusim.CtlFailUnbind, "EIO")
	_, _, err = e.whole.Release(ctx, "vm1")
	require.ErrorIs(t, err, gpu.ErrUnbindFailed)
	require.ErrorIs(t, err, syscall.EIO)
	rec, err := e.st.Get("vm1")
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED, rec.GetState())
	held := store.HeldPassthrough(rec)
	require.Len(t, held, 1)
	assert.EqualValues(t, 1, held[0].GetReleaseAttempts())
	require.ErrorIs(t, e.st.Delete(ctx, "vm1"), store.ErrClaimHeld)

	e.sim.Clear(t, vgpusim.CtlFailUnbind)
	released, _, err := e.whole.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
	assert.Equal(t, before, e.drivers(t, 1))
}

// TestWholeReleaseRefusedWhileNodeHeld: invariant 2 for a whole GPU: a
// process holding the group's VFIO node blocks the release.
func TestWholeReleaseRefusedWhileNodeHeld(t *testing.T) {
	e := newWhole(t, 1)
	ctx := context.Background()
	e.record(t, "vm1", 1)
	_, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	e.beginDelete(t, "vm1")
	stop := holdOpen(t, filepath.Join(e.sim.DevRoot, "vfio", vgpusim.PCIGPUAt(0).Group))
	_, _, err = e.whole.Release(ctx, "vm1")
	require.ErrorIs(t, err, lease.ErrDeviceHeld)
	assert.Equal(t, "vfio-pci", e.drivers(t, 1)[vgpusim.PCIGPUAt(0).GPU])
	stop()
	released, _, err := e.whole.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
}

// TestWholeReconcileReturnsOnlyItsOwn: a group vmflow marked that no lease
// names is returned after the grace; a GPU someone else bound to vfio-pci
// (no mark) is never touched.
func TestWholeReconcileReturnsOnlyItsOwn(t *testing.T) {
	e := newWhole(t, 3)
	ctx := context.Background()
	g0, g2 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(2)
	_, err := e.whole.Driver().Bind(ctx, gpu.BindRequest{Group: g0.Group}) // a lease lost with its record
	require.NoError(t, err)
	// An operator's own vfio-pci binding, its override cleared after the
	// bind: no mark of vmflow's.
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "devices", g2.GPU, "driver_override"), "vfio-pci"))
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "drivers", "nvidia", "unbind"), g2.GPU))
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "drivers_probe"), g2.GPU))
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "devices", g2.GPU, "driver_override"), "\n"))

	res, err := e.whole.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetOrphansRemoved(), "within the grace")
	e.now.Advance(2 * time.Minute)
	res, err = e.whole.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetOrphansRemoved())
	d := e.drivers(t, 3)
	assert.Equal(t, "nvidia", d[g0.GPU], "vmflow's unclaimed group is returned")
	assert.Equal(t, "vfio-pci", d[g2.GPU], "a GPU vmflow never bound is left alone")
}

// TestWholeScanFindsReconcileWork: the read-only scan reports a deleting
// instance's whole GPUs once its VM is gone and nothing holds the group's
// node, and a group vmflow marked that no lease names once past the grace;
// never a GPU vmflow did not bind. It changes nothing.
func TestWholeScanFindsReconcileWork(t *testing.T) {
	e := newWhole(t, 3)
	ctx := context.Background()
	scan := func() []string {
		t.Helper()
		w, err := e.whole.Scan(ctx)
		require.NoError(t, err)
		return w.Items
	}
	g0, g1, g2 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1), vgpusim.PCIGPUAt(2)
	assert.Empty(t, scan(), "an empty host")

	e.record(t, "vm1", 1)
	_, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	assert.Empty(t, scan(), "a lease a spawn owns is no reconcile work")
	e.beginDelete(t, "vm1")
	stop := holdOpen(t, filepath.Join(e.sim.DevRoot, "vfio", g0.Group))
	assert.Empty(t, scan(), "the group's node is held")
	stop()
	assert.Equal(t, []string{"release:vm1"}, scan())
	assert.Equal(t, "vfio-pci", e.drivers(t, 1)[g0.GPU], "the scan returned nothing")
	res, err := e.whole.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetClaimsReleased())
	require.NoError(t, e.st.Delete(ctx, "vm1"))
	assert.Empty(t, scan())

	_, err = e.whole.Driver().Bind(ctx, gpu.BindRequest{Group: g1.Group}) // a lease lost with its record
	require.NoError(t, err)
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "devices", g2.GPU, "driver_override"), "vfio-pci"))
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "drivers", "nvidia", "unbind"), g2.GPU))
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "drivers_probe"), g2.GPU))
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "devices", g2.GPU, "driver_override"), "\n"))
	assert.Empty(t, scan(), "inside the grace")
	e.now.Advance(2 * time.Minute)
	assert.Equal(t, []string{"orphan-group:" + g1.Group}, scan(), "only vmflow's mark, past the grace")
	assert.Equal(t, "vfio-pci", e.drivers(t, 3)[g1.GPU], "the scan returned nothing")

	res, err = e.whole.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetOrphansRemoved(), "the round counts the scan's sighting")
	d := e.drivers(t, 3)
	assert.Equal(t, "nvidia", d[g1.GPU])
	assert.Equal(t, "vfio-pci", d[g2.GPU], "a GPU vmflow never bound is left alone")

	// The group bound again with no lease yet, before any scan, as a claim
	// in flight looks to a round that listed the records before its
	// intent: the grace starts again, whatever the scan saw before the
	// return.
	_, err = e.whole.Driver().Bind(ctx, gpu.BindRequest{Group: g1.Group})
	require.NoError(t, err)
	res, err = e.whole.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetOrphansRemoved())
	assert.Equal(t, "vfio-pci", e.drivers(t, 3)[g1.GPU])
}
