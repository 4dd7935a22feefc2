package lease_test

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// newWholeOpts is newWhole over a simulator of opts, with a quarantine
// that takes a GPU out after quarantineAfter failures in a row (0: none).
func newWholeOpts(t *testing.T, opts vgpusim.Options, quarantineAfter int) (*wholeEnv, *lease.Quarantine) {
	t.Helper()
	e := &wholeEnv{sim: simtest.Start(t, opts), now: newClock()}
	state, err := os.MkdirTemp("/tmp", "wh")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(state) })
	e.st, err = store.New(state)
	require.NoError(t, err)
	f, err := gpu.ParseGPUFilter("all")
	require.NoError(t, err)
	var q *lease.Quarantine
	if quarantineAfter > 0 {
		q = lease.NewQuarantine(state, quarantineAfter, e.now.Now)
	}
	drv := gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot: e.sim.Root, StateDir: state, DevRoot: e.sim.DevRoot, Filter: f})
	e.whole, err = lease.NewWhole(lease.WholeConfig{Driver: drv, Store: e.st, OrphanGrace: time.Minute,
		IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now, Quarantine: q})
	require.NoError(t, err)
	return e, q
}

func (e *wholeEnv) driver(t *testing.T, addr string) string {
	t.Helper()
	d, ok := e.sim.Server.PCIDriver(addr)
	require.True(t, ok, addr)
	return d
}

func (e *wholeEnv) ensure(t *testing.T, id string) ([]*vmflowv1.Lease, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := e.st.Lock(ctx, id)
	require.NoError(t, err)
	defer l.Unlock()
	return e.whole.EnsureDevicesLocked(ctx, l)
}

func (e *wholeEnv) held(t *testing.T, id string) *vmflowv1.InstanceRecord {
	t.Helper()
	rec, err := e.st.Get(id)
	require.NoError(t, err)
	return rec
}

// Case 1: a whole-GPU unbind blocked in the driver (a host process holds
// the GPU) holds no host-wide lock: another instance's whole-GPU claim on
// the same host completes meanwhile, instead of waiting behind it until
// its deadline.
func TestWholeBlockedUnbindHoldsNoLock(t *testing.T) {
	e := newWhole(t, 2)
	ctx := context.Background()
	g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
	e.record(t, "vm1", 1)
	_, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	e.beginDelete(t, "vm1")
	e.sim.Set(t, vgpusim.At(vgpusim.CtlBlockUnbind, g0.GPU), "")

	relCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	var relErr error
	go func() {
		defer wg.Done()
		_, _, relErr = e.whole.Release(relCtx, "vm1")
	}()
	require.Eventually(t, func() bool { return e.sim.Server.Blocked() > 0 }, 10*time.Second, 10*time.Millisecond, "the release's unbind blocks")

	e.record(t, "vm2", 1)
	claimCtx, cancelClaim := context.WithTimeout(ctx, 5*time.Second)
	defer cancelClaim()
	start := time.Now()
	got, err := e.whole.Claim(claimCtx, "vm2", "", 1)
	took := time.Since(start)
	require.NoError(t, err, "a claim beside a blocked unbind")
	assert.Equal(t, []string{g1.GPU, g1.Audio}, store.PassthroughDevices(got[0]))
	assert.Less(t, took, 3*time.Second)
	t.Logf("whole-GPU claim beside a blocked unbind took %v", took)

	e.sim.Clear(t, vgpusim.At(vgpusim.CtlBlockUnbind, g0.GPU))
	wg.Wait()
	require.NoError(t, relErr)
	assert.Equal(t, "nvidia", e.driver(t, g0.GPU))
}

// Case 3: an endpoint of the GPU's group that is not a function of the
// GPU's card makes the group not offered, with a driver or without (a NIC
// whose driver has not loaded yet): it is never bound to vfio-pci and
// handed to a guest.
func TestWholeDriverlessForeignEndpointNotOffered(t *testing.T) {
	e := newWhole(t, 4)
	ctx := context.Background()
	g3 := vgpusim.PCIGPUAt(3)
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "drivers", "mlx5_core", "unbind"), g3.NIC))
	require.Equal(t, "", e.driver(t, g3.NIC), "the NIC's driver has not loaded")

	gpus, err := e.whole.Driver().GPUs(ctx)
	require.NoError(t, err)
	for _, g := range gpus {
		if g.Addr == g3.GPU {
			assert.False(t, g.Offered)
			assert.Equal(t, "group "+g3.Group+" also holds "+g3.NIC+" (network controller)", g.NotViable)
		}
	}
	e.record(t, "vm1", 3)
	_, err = e.whole.Claim(ctx, "vm1", g3.ID, 3) // H200s: groups 0 and 2, and 3 with the NIC
	require.ErrorIs(t, err, lease.ErrNoWholeGPU)
	assert.Equal(t, "", e.driver(t, g3.NIC), "the NIC is never bound to vfio-pci")
	assert.Equal(t, "nvidia", e.driver(t, g3.GPU))
	_, err = e.whole.Driver().Bind(ctx, gpu.BindRequest{Group: g3.Group})
	require.ErrorIs(t, err, gpu.ErrGroupNotViable)
	assert.Equal(t, "", e.driver(t, g3.NIC))
}

// Case 5: a GPU whose bind fails is struck (here quarantined at the first
// failure) and the claim moves on to the next free GPU, which is healthy;
// the bad GPU is back on its driver and placement skips it from then on.
func TestWholeFailedBindStrikesAndMovesOn(t *testing.T) {
	e, q := newWholeOpts(t, vgpusim.Options{PCIGPUs: 3}, 1)
	ctx := context.Background()
	g0, g1, g2 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1), vgpusim.PCIGPUAt(2)
	e.sim.Set(t, vgpusim.At(vgpusim.CtlFailUnbind, g0.GPU), "EIO") // one bad card

	e.record(t, "vm1", 1)
	got, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err, "one bad card does not stop the claim")
	require.Len(t, got, 1)
	assert.Equal(t, []string{g1.GPU, g1.Audio}, store.PassthroughDevices(got[0]), "the next free GPU")
	assert.Equal(t, "vfio-pci", e.driver(t, g1.GPU), "the other GPU was healthy")
	assert.Equal(t, "nvidia", e.driver(t, g0.GPU), "the bad GPU's bind was undone")
	ov, err := os.ReadFile(e.sim.Path("bus", "pci", "devices", g0.GPU, "driver_override"))
	require.NoError(t, err)
	assert.Equal(t, "(null)\n", string(ov), "vmflow's mark is gone from the bad GPU")
	rec := e.held(t, "vm1")
	require.Len(t, rec.GetLeases(), 1, "the failed bind's lease was rolled back")

	qm, err := q.List()
	require.NoError(t, err)
	require.Contains(t, qm, g0.GPU, "the failed bind counts against the GPU")
	assert.Equal(t, "vm1", qm[g0.GPU].Instance)

	e.record(t, "vm2", 1)
	got, err = e.whole.Claim(ctx, "vm2", "", 1)
	require.NoError(t, err)
	assert.Equal(t, []string{g2.GPU}, store.PassthroughDevices(got[0]), "the quarantined GPU is skipped")
}

// Case 5, without a quarantine threshold reached: the strike is counted
// and the successful bind of another GPU does not wipe it.
func TestWholeFailedProbeCounted(t *testing.T) {
	e, q := newWholeOpts(t, vgpusim.Options{PCIGPUs: 3}, 2)
	ctx := context.Background()
	g0 := vgpusim.PCIGPUAt(0)
	e.sim.Set(t, vgpusim.At(vgpusim.CtlFailUnbind, g0.GPU), "EIO")
	for _, id := range []string{"vm1", "vm2"} {
		e.record(t, id, 1)
		_, err := e.whole.Claim(ctx, id, "", 1)
		require.NoError(t, err, id)
	}
	qm, err := q.List()
	require.NoError(t, err)
	assert.Contains(t, qm, g0.GPU, "two failed binds in a row quarantine it")
}

// Case 9: two GPUs in one IOMMU group are two GPUs. A request for 2 takes
// that one group, never it and another group (3 GPUs); a host whose only
// free capacity is one 2-GPU group serves 2 and refuses 1.
func TestWholeCountsGPUsNotGroups(t *testing.T) {
	t.Run("takes one 2-GPU group for 2", func(t *testing.T) {
		// GPU 4 shares GPU 0's group; GPU 2 is alone (behind a bridge).
		e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: 5, PCIGroupWith: map[int]int{4: 0}}, 0)
		ctx := context.Background()
		g0, g4 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(4)
		e.record(t, "vm1", 2)
		got, err := e.whole.Claim(ctx, "vm1", g0.ID, 2)
		require.NoError(t, err)
		require.Len(t, got, 1, "one group")
		assert.Equal(t, []string{g0.GPU, g4.GPU}, store.PassthroughDevices(got[0]))
		assert.Equal(t, 2, store.HeldPassthroughGPUs(e.held(t, "vm1")), "2 GPUs, as asked")
		assert.Equal(t, "nvidia", e.driver(t, vgpusim.PCIGPUAt(2).GPU), "no third GPU taken")
	})
	t.Run("only a 2-GPU group free", func(t *testing.T) {
		e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: 2, PCIGroupWith: map[int]int{1: 0}}, 0)
		ctx := context.Background()
		g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
		e.record(t, "vm1", 1)
		_, err := e.whole.Claim(ctx, "vm1", "", 1)
		require.ErrorIs(t, err, lease.ErrNoWholeGPU, "1 asked: a 2-GPU group would give 2")
		assert.Equal(t, "nvidia", e.driver(t, g0.GPU))

		e.record(t, "vm2", 2)
		got, err := e.whole.Claim(ctx, "vm2", "", 2)
		require.NoError(t, err, "the one 2-GPU group serves 2")
		require.Len(t, got, 1)
		assert.Equal(t, []string{g0.GPU, g1.GPU, g1.Audio}, store.PassthroughDevices(got[0]))
		assert.Equal(t, 2, store.HeldPassthroughGPUs(e.held(t, "vm2")))
		again, err := e.whole.Claim(ctx, "vm2", "", 2)
		require.NoError(t, err, "a retried claim")
		assert.Equal(t, store.LeaseName(got[0]), store.LeaseName(again[0]))
		_, err = e.ensure(t, "vm2")
		require.NoError(t, err)

		e.beginDelete(t, "vm2")
		released, devs, err := e.whole.Release(ctx, "vm2")
		require.NoError(t, err)
		assert.True(t, released)
		assert.ElementsMatch(t, []string{g0.GPU, g1.GPU, g1.Audio}, devs)
		assert.Equal(t, "nvidia", e.driver(t, g1.GPU))
		assert.Equal(t, "snd_hda_intel", e.driver(t, g1.Audio))
	})
}

// Case 2: a reboot that renumbers the IOMMU groups: the lease names its
// card by address and identity, so the launch after the reboot binds the
// card in its new group, and the release waits on the new group's node.
func TestWholeRebootRenumbersGroups(t *testing.T) {
	e := newWhole(t, 2)
	ctx := context.Background()
	g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
	e.record(t, "vm1", 1)
	_, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	require.NoError(t, e.sim.Server.Reboot(vgpusim.Reboot{GroupOffset: 10}))
	require.Equal(t, "nvidia", e.driver(t, g0.GPU), "a reboot returns every function to its driver")
	newGroup := e.sim.Server.PCIGroup(g0.GPU)
	require.NotEqual(t, g0.Group, newGroup)

	_, err = e.ensure(t, "vm1")
	require.NoError(t, err, "the launch after the reboot binds the card in its new group")
	assert.Equal(t, "vfio-pci", e.driver(t, g0.GPU))
	assert.Equal(t, "nvidia", e.driver(t, g1.GPU))

	e.beginDelete(t, "vm1")
	stop := holdOpen(t, filepath.Join(e.sim.DevRoot, "vfio", newGroup))
	_, _, err = e.whole.Release(ctx, "vm1")
	require.ErrorIs(t, err, lease.ErrDeviceHeld, "the node of the group the card is in now")
	stop()
	released, _, err := e.whole.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
	assert.Equal(t, "nvidia", e.driver(t, g0.GPU))
}

// Case 2: a reboot after which the leased card is gone and another card
// has its group number, or another card of the same model sits at its
// address: the launch refuses (ErrClaimDeviceMissing) without binding the
// card there now, the release finishes (the card counts as released), and
// the new card is then a free device like any other.
func TestWholeRebootCardGoneOrReplaced(t *testing.T) {
	for _, tc := range []struct {
		name   string
		reboot func(g0 vgpusim.PCIGPU) vgpusim.Reboot
	}{
		{"removed, groups renumbered", func(g0 vgpusim.PCIGPU) vgpusim.Reboot {
			return vgpusim.Reboot{Remove: []string{g0.GPU}, GroupOffset: -1}
		}},
		{"another card of the same model", func(g0 vgpusim.PCIGPU) vgpusim.Reboot {
			return vgpusim.Reboot{Replace: map[string]string{g0.GPU: g0.ID}}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newWhole(t, 2)
			ctx := context.Background()
			g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
			e.record(t, "vm1", 1)
			_, err := e.whole.Claim(ctx, "vm1", g0.ID, 1)
			require.NoError(t, err)
			require.NoError(t, e.sim.Server.Reboot(tc.reboot(g0)))

			_, err = e.ensure(t, "vm1")
			require.ErrorIs(t, err, lease.ErrClaimDeviceMissing)
			require.ErrorIs(t, err, gpu.ErrCardGone)
			if d, ok := e.sim.Server.PCIDriver(g0.GPU); ok {
				assert.Equal(t, "nvidia", d, "the card there now is not bound for the old lease")
			}
			assert.Equal(t, "nvidia", e.driver(t, g1.GPU), "nor the card that has the old group number")

			e.beginDelete(t, "vm1")
			relCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			released, _, err := e.whole.Release(relCtx, "vm1")
			require.NoError(t, err, "a card no longer there counts as released")
			assert.True(t, released)
			require.NoError(t, e.st.Delete(ctx, "vm1"))
			if d, ok := e.sim.Server.PCIDriver(g0.GPU); ok {
				assert.Equal(t, "nvidia", d)
			}

			e.record(t, "vm2", 1)
			got, err := e.whole.Claim(ctx, "vm2", "", 1)
			require.NoError(t, err, "the card there now is a new device")
			if _, ok := e.sim.Server.PCIDriver(g0.GPU); ok {
				assert.Equal(t, g0.GPU, store.PassthroughDevices(got[0])[0])
			}
		})
	}
}

// A lease recorded before identities (functions without an id) reads as
// it did: its card is the one in its recorded group. It binds and returns
// as before; after a reboot that renumbered the groups its card counts as
// gone: the launch refuses and the release finishes.
func TestWholeLegacyLease(t *testing.T) {
	e := newWhole(t, 2)
	ctx := context.Background()
	g0 := vgpusim.PCIGPUAt(0)
	legacy := store.PassthroughLeaseOf(&vmflowv1.PassthroughLease{IommuGroup: g0.Group, Model: g0.ID,
		Functions: []*vmflowv1.PassthroughFunction{{Addr: g0.GPU, PreviousDriver: "nvidia", Display: true}}})
	assert.Equal(t, "passthrough:"+g0.Group, store.LeaseName(legacy), "an old lease keeps its name")
	for _, id := range []string{"vm1", "vm2"} {
		e.record(t, id, 1)
	}
	l, err := e.st.Lock(ctx, "vm1")
	require.NoError(t, err)
	_, err = l.Apply(store.LeaseIntent(legacy, time.Now()))
	require.NoError(t, err)
	_, err = l.Apply(store.PassthroughActive(store.LeaseName(legacy)))
	require.NoError(t, err)
	l.Unlock()

	_, err = e.ensure(t, "vm1")
	require.NoError(t, err, "an old lease binds by its recorded group")
	assert.Equal(t, "vfio-pci", e.driver(t, g0.GPU))
	_, err = e.whole.Claim(ctx, "vm2", g0.ID, 1)
	require.ErrorIs(t, err, lease.ErrNoWholeGPU, "its card is held")

	require.NoError(t, e.sim.Server.Reboot(vgpusim.Reboot{GroupOffset: 5}))
	_, err = e.ensure(t, "vm1")
	require.ErrorIs(t, err, lease.ErrClaimDeviceMissing, "renumbered: the recorded group no longer says which card it is")
	assert.Equal(t, "nvidia", e.driver(t, g0.GPU))
	e.beginDelete(t, "vm1")
	released, _, err := e.whole.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
}

// A claim retried after its card was removed (the intent written, the
// bind not finished): the lease is rolled back without a strike (the card
// did not fail; a new card at the address must not inherit one) and the
// claim places on the next GPU.
func TestWholeRetriedClaimCardGone(t *testing.T) {
	e, q := newWholeOpts(t, vgpusim.Options{PCIGPUs: 2}, 1)
	ctx := context.Background()
	g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
	e.record(t, "vm1", 1)
	intent := store.PassthroughLeaseOf(&vmflowv1.PassthroughLease{IommuGroup: g0.Group, Model: g0.ID,
		Functions: []*vmflowv1.PassthroughFunction{{Addr: g0.GPU, PreviousDriver: "nvidia", Display: true, Id: g0.ID, Serial: "48-30-00-00-00-00-00-81"}}})
	l, err := e.st.Lock(ctx, "vm1")
	require.NoError(t, err)
	_, err = l.Apply(store.LeaseIntent(intent, time.Now()))
	require.NoError(t, err)
	l.Unlock()
	require.NoError(t, e.sim.Server.Reboot(vgpusim.Reboot{Remove: []string{g0.GPU}}))

	got, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	assert.Equal(t, []string{g1.GPU, g1.Audio}, store.PassthroughDevices(got[0]))
	require.Len(t, e.held(t, "vm1").GetLeases(), 1, "the gone card's intent rolled back")
	qm, err := q.List()
	require.NoError(t, err)
	assert.Empty(t, qm, "no strike for a card that is gone")
}

// TestWholeReconcileWakesAReleasedDelete: a reconcile round reads a
// record's whole-GPU leases as it reads vGPU ones (roundFor, one rule): a
// deleting record whose lease a round released is woken by the next round
// too, in case the first died before its wake-up reached the delete, and
// the scan says so. Before, the whole-GPU round skipped a record with no
// held lease, and its delete waited out its backoff.
func TestWholeReconcileWakesAReleasedDelete(t *testing.T) {
	e := newWhole(t, 1)
	ctx := context.Background()
	e.record(t, "vm1", 1)
	_, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	res, err := e.whole.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetSkipped(), "a lease a live instance holds is left alone")
	assert.Empty(t, res.GetRetriedDeletes())

	e.beginDelete(t, "vm1")
	res, err = e.whole.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetClaimsReleased())
	assert.Equal(t, []string{"vm1"}, res.GetRetriedDeletes())

	res, err = e.whole.Reconcile(ctx)
	require.NoError(t, err)
	assert.Zero(t, res.GetClaimsReleased())
	assert.Equal(t, []string{"vm1"}, res.GetRetriedDeletes(), "a lost wake-up is sent again")
	w, err := e.whole.Scan(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{"wake:vm1"}, w.Items)
}

// A card swapped in at a GPU's address by a reboot starts its own count
// of failures: the strikes of the card that was there are not its own.
// The host model found a new card quarantined after its first failure
// (--gpu-quarantine-after 2), since the card it replaced had failed once
// and the count was kept by address.
func TestWholeSwappedCardStartsItsOwnCount(t *testing.T) {
	e, q := newWholeOpts(t, vgpusim.Options{PCIGPUs: 5}, 2) // GPUs 0, 1, 2 and 4 are offered
	ctx := context.Background()
	g0 := vgpusim.PCIGPUAt(0)
	e.sim.Set(t, vgpusim.At(vgpusim.CtlFailUnbind, g0.GPU), "EIO") // a bad slot: whatever card is in it fails
	claim := func(id string) {
		t.Helper()
		e.record(t, id, 1)
		got, err := e.whole.Claim(ctx, id, "", 1)
		require.NoError(t, err, "the claim moves past the failing GPU")
		require.NotEqual(t, g0.GPU, store.PassthroughDevices(got[0])[0])
	}
	quarantined := func() bool {
		t.Helper()
		qm, err := q.List()
		require.NoError(t, err)
		_, ok := qm[g0.GPU]
		return ok
	}
	claim("vm1")
	require.Equal(t, 1, q.Strikes()[g0.GPU].Count, "the old card failed once")
	require.NoError(t, e.sim.Server.Reboot(vgpusim.Reboot{Replace: map[string]string{g0.GPU: g0.ID}}))

	claim("vm2")
	assert.False(t, quarantined(), "one failure of the card there now")
	assert.Equal(t, 1, q.Strikes()[g0.GPU].Count)
	claim("vm3")
	assert.True(t, quarantined(), "two failures in a row of the card there now")
}
