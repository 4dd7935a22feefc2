package lease_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
)

// GPU hygiene between tenants (issue 32, finding 7), on the simulator.

// TestClaimResetsAndAFailedResetQuarantinesAtOnce: a claim resets the GPU
// on vfio-pci before its tenant gets it. A GPU whose reset fails there is
// quarantined at its first failure (K is 3 here), its bind is undone, and
// the claim takes the next GPU. Before: the claim never reset, and a
// failed reset counted like any failure, K times before the GPU left
// placement.
func TestClaimResetsAndAFailedResetQuarantinesAtOnce(t *testing.T) {
	e, q := newWholeOpts(t, vgpusim.Options{PCIGPUs: 2}, 3)
	ctx := context.Background()
	g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
	e.sim.Set(t, vgpusim.At(vgpusim.CtlFailReset, g0.GPU), "EIO")
	e.record(t, "vm1", 1)
	got, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	assert.Equal(t, []string{g1.GPU, g1.Audio}, store.PassthroughDevices(got[0]), "the next GPU")
	requireQuarantined(t, q, g0.GPU, true, "a reset that failed at the claim, once")
	assert.Equal(t, "nvidia", e.driver(t, g0.GPU), "the bad GPU's bind undone, though its reset keeps failing")
	quarantined, err := q.List()
	require.NoError(t, err)
	assert.Contains(t, quarantined[g0.GPU].Reason, "quarantined at its first such failure")
	assert.Contains(t, quarantined[g0.GPU].Reason, "reset failed")
}

// TestReleaseWhoseResetFailsQuarantinesAndFinishes: a release whose reset
// fails quarantines the GPU at once and still gives the card back and
// ends the lease (the delete is not stuck on a card that is out of
// placement). Without a quarantine to record it in, the release fails
// and keeps the lease, as any failed release does.
func TestReleaseWhoseResetFailsQuarantinesAndFinishes(t *testing.T) {
	ctx := context.Background()
	t.Run("quarantine", func(t *testing.T) {
		e, q := newWholeOpts(t, vgpusim.Options{PCIGPUs: 1}, 3)
		g0 := vgpusim.PCIGPUAt(0)
		e.record(t, "vm1", 1)
		_, err := e.whole.Claim(ctx, "vm1", "", 1)
		require.NoError(t, err)
		e.beginDelete(t, "vm1")
		e.sim.Set(t, vgpusim.At(vgpusim.CtlFailReset, g0.GPU), "EIO")
		released, _, err := e.whole.Release(ctx, "vm1")
		require.NoError(t, err)
		assert.True(t, released)
		requireQuarantined(t, q, g0.GPU, true, "a reset that failed at the release, once")
		assert.Equal(t, "nvidia", e.driver(t, g0.GPU))
		assert.Empty(t, store.HeldLeases(e.held(t, "vm1")))
	})
	t.Run("no quarantine", func(t *testing.T) {
		e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: 1}, 0)
		g0 := vgpusim.PCIGPUAt(0)
		e.record(t, "vm1", 1)
		_, err := e.whole.Claim(ctx, "vm1", "", 1)
		require.NoError(t, err)
		e.beginDelete(t, "vm1")
		e.sim.Set(t, vgpusim.At(vgpusim.CtlFailReset, g0.GPU), "EIO")
		_, _, err = e.whole.Release(ctx, "vm1")
		require.ErrorIs(t, err, gpu.ErrResetFailed)
		assert.Equal(t, gpu.DriverVFIO, e.driver(t, g0.GPU), "kept from the host until its reset succeeds")
		assert.NotEmpty(t, store.HeldLeases(e.held(t, "vm1")))
	})
}

// TestGPUWithoutResetNotOffered: a GPU whose function has no reset method
// (the kernel shows no reset attribute) is not offered: nothing would
// clear one tenant's state before the next. The inventory says why.
func TestGPUWithoutResetNotOffered(t *testing.T) {
	e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: 2, PCINoReset: []int{0}}, 0)
	ctx := context.Background()
	g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
	gpus, err := e.whole.Driver().GPUs(ctx)
	require.NoError(t, err)
	require.Len(t, gpus, 2)
	assert.False(t, gpus[0].Offered)
	assert.Contains(t, gpus[0].NotViable, g0.GPU+" has no reset method")
	assert.True(t, gpus[1].Offered)

	e.record(t, "vm2", 2)
	_, err = e.whole.Claim(ctx, "vm2", "", 2)
	require.ErrorIs(t, err, lease.ErrNoWholeGPU, "one GPU of two can be had")
	e.record(t, "vm1", 1)
	got, err := e.whole.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	assert.Equal(t, []string{g1.GPU, g1.Audio}, store.PassthroughDevices(got[0]))
	assert.Equal(t, "nvidia", e.driver(t, g0.GPU))
	_, err = e.whole.Driver().Bind(ctx, gpu.BindRequest{Group: g0.Group})
	require.ErrorIs(t, err, gpu.ErrGroupNotViable, "Bind refuses it too")
}

// TestUnsafeIOMMUOffersNoGPU: with vfio_iommu_type1's
// allow_unsafe_interrupts on, or an IOMMU that cannot remap interrupts,
// no GPU is offered or bound, and each says why; set right again, the
// next claim is served without a restart.
func TestUnsafeIOMMUOffersNoGPU(t *testing.T) {
	for _, c := range []struct{ ctl, why string }{
		{vgpusim.CtlUnsafeInterrupts, "allow_unsafe_interrupts is Y"},
		{vgpusim.CtlNoIntRemap, "dmar0 cannot remap interrupts"},
	} {
		t.Run(c.ctl, func(t *testing.T) {
			e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: 1}, 0)
			ctx := context.Background()
			g0 := vgpusim.PCIGPUAt(0)
			e.sim.Set(t, c.ctl, "")
			gpus, err := e.whole.Driver().GPUs(ctx)
			require.NoError(t, err)
			assert.False(t, gpus[0].Offered)
			assert.Contains(t, gpus[0].NotViable, c.why)
			e.record(t, "vm1", 1)
			_, err = e.whole.Claim(ctx, "vm1", "", 1)
			require.ErrorIs(t, err, lease.ErrNoWholeGPU)
			_, err = e.whole.Driver().Bind(ctx, gpu.BindRequest{Group: g0.Group})
			require.ErrorIs(t, err, gpu.ErrUnsafeIOMMU)
			assert.Equal(t, "nvidia", e.driver(t, g0.GPU))

			e.sim.Clear(t, c.ctl)
			_, err = e.whole.Claim(ctx, "vm1", "", 1)
			require.NoError(t, err)
		})
	}
}

// TestScrubRunsBetweenTenants: --gpu-scrub runs once the released card is
// back on its host driver, with its addresses; a scrub that fails
// quarantines the GPU at once and the release still finishes.
func TestScrubRunsBetweenTenants(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	log := filepath.Join(dir, "scrubbed")
	script := filepath.Join(dir, "scrub")
	// It records its arguments, then fails when told to.
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\necho \"$*\" >> "+log+
		"\n[ -e "+filepath.Join(dir, "fail")+" ] && { echo 'VRAM check failed' >&2; exit 3; }\nexit 0\n"), 0o755))
	for _, fail := range []bool{false, true} {
		t.Run(map[bool]string{false: "ok", true: "fails"}[fail], func(t *testing.T) {
			e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: 1}, 3)
			q := lease.NewQuarantine(e.st.StateDir(), 3, nil)
			w, err := lease.NewWhole(lease.WholeConfig{Driver: e.whole.Driver(), Store: e.st, Quarantine: q,
				IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now, Scrub: script})
			require.NoError(t, err)
			g0 := vgpusim.PCIGPUAt(0)
			_ = os.Remove(log)
			if fail {
				require.NoError(t, os.WriteFile(filepath.Join(dir, "fail"), nil, 0o600))
			}
			e.record(t, "vm1", 1)
			got, err := w.Claim(ctx, "vm1", "", 1)
			require.NoError(t, err)
			_, err = os.Stat(log)
			require.ErrorIs(t, err, os.ErrNotExist, "no scrub at a claim")
			e.beginDelete(t, "vm1")
			released, _, err := w.Release(ctx, "vm1")
			require.NoError(t, err)
			assert.True(t, released)
			ran, err := os.ReadFile(log)
			require.NoError(t, err)
			assert.Equal(t, strings.Join(store.PassthroughDevices(got[0]), " "), strings.TrimSpace(string(ran)), "once, with the group's addresses")
			assert.Equal(t, "nvidia", e.driver(t, g0.GPU))
			requireQuarantined(t, q, g0.GPU, fail, "after the scrub")
			if fail {
				m, err := q.List()
				require.NoError(t, err)
				assert.Contains(t, m[g0.GPU].Reason, "VRAM check failed", "the scrub's own words")
			}
		})
	}
}

// TestScrubRunsAgainAfterAKill: a kill between the scrub and the
// release's record leaves the lease releasing; the retried release finds
// the card already back on its host driver and runs the scrub again (the
// command must be idempotent), so no card reaches a tenant unscrubbed.
func TestScrubRunsAgainAfterAKill(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	log := filepath.Join(dir, "scrubbed")
	script := filepath.Join(dir, "scrub")
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\necho \"$*\" >> "+log+"\n"), 0o755))
	e, q := newWholeOpts(t, vgpusim.Options{PCIGPUs: 1}, 3)
	w, err := lease.NewWhole(lease.WholeConfig{Driver: e.whole.Driver(), Store: e.st, Quarantine: q,
		IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now, Scrub: script})
	require.NoError(t, err)
	e.record(t, "vm1", 1)
	got, err := w.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	e.beginDelete(t, "vm1")

	// The driver's release done, its record never written: the kill.
	require.NoError(t, w.LeaseDriver().Release(ctx, "vm1", got[0]))
	assert.Equal(t, "nvidia", e.driver(t, vgpusim.PCIGPUAt(0).GPU))
	assert.NotEmpty(t, store.HeldLeases(e.held(t, "vm1")), "nothing recorded yet")

	released, _, err := w.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released)
	ran, err := os.ReadFile(log)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(ran)), "\n")
	assert.Len(t, lines, 2, "scrubbed by the killed release and again by its retry: %q", ran)
	requireQuarantined(t, q, vgpusim.PCIGPUAt(0).GPU, false, "a clean scrub")
}
