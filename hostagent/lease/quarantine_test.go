package lease_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc/proctest"
)

// TestQuarantineWholeGPU: a GPU whose unbind failed twice is quarantined
// (on disk: a fresh Quarantine reads it), placement skips it even once its
// lease is released, and clearing it puts it back.
func TestQuarantineWholeGPU(t *testing.T) {
	e := newWhole(t, 1)
	q := lease.NewQuarantine(e.st.StateDir(), 2, nil)
	w, err := lease.NewWhole(lease.WholeConfig{Driver: e.whole.Driver(), Store: e.st, Quarantine: q,
		IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now})
	require.NoError(t, err)
	ctx := context.Background()
	addr := vgpusim.PCIGPUAt(0).GPU
	e.record(t, "vm1", 1)
	_, err = w.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	e.beginDelete(t, "vm1")
	e.sim.Set(t, vgpusim.CtlFailUnbind, "EIO")
	for i := 1; i <= 2; i++ {
		_, _, err = w.Release(ctx, "vm1")
		require.ErrorIs(t, err, gpu.ErrUnbindFailed)
		has, err := lease.NewQuarantine(e.st.StateDir(), 2, nil).Has(addr)
		require.NoError(t, err)
		assert.Equal(t, i == 2, has, "quarantined at the second failure, not the first")
	}
	e.sim.Clear(t, vgpusim.CtlFailUnbind)
	released, _, err := w.Release(ctx, "vm1")
	require.NoError(t, err)
	assert.True(t, released, "a quarantined GPU is still released")
	require.NoError(t, e.st.Delete(ctx, "vm1"))

	e.record(t, "vm2", 1)
	_, err = w.Claim(ctx, "vm2", "", 1)
	require.ErrorIs(t, err, lease.ErrNoWholeGPU, "placement skips the quarantined GPU")
	was, err := q.Clear(ctx, addr)
	require.NoError(t, err)
	assert.Contains(t, was.Reason, "failed 2 times")
	assert.Equal(t, "vm1", was.Instance)
	_, err = q.Clear(ctx, addr)
	require.ErrorIs(t, err, lease.ErrNotQuarantined)
	_, err = w.Claim(ctx, "vm2", "", 1)
	require.NoError(t, err, "cleared, it is placed again")
}

// TestQuarantineVGPU: a vendor VF, or an mdev's parent GPU, whose vGPU
// release failed twice gets no new vGPU until cleared.
func TestQuarantineVGPU(t *testing.T) {
	for _, tc := range []struct {
		name    string
		opts    vgpusim.Options
		profile string
	}{
		{"mdev", vgpusim.Options{MdevParents: 1}, profile},
		{"vendor", vgpusim.Options{VendorVFs: 1}, vendorProfile},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newClaims(t, tc.opts)
			q := lease.NewQuarantine(e.st.StateDir(), 2, nil)
			c, err := lease.New(lease.Config{Driver: gpu.Config{SysfsRoot: e.sim.Root, StateDir: e.st.StateDir()}, Store: e.st, DevRoot: e.devDir,
				OrphanGrace: time.Minute, IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now, Quarantine: q})
			require.NoError(t, err)
			ctx := context.Background()
			e.record(t, "vm1")
			got, err := c.Claim(ctx, "vm1", tc.profile, 1)
			require.NoError(t, err)
			e.beginDelete(t, "vm1")
			e.sim.Set(t, vgpusim.CtlFailRelease, "EIO")
			for range 2 {
				_, _, err = c.Release(ctx, "vm1")
				require.Error(t, err)
			}
			e.sim.Clear(t, vgpusim.CtlFailRelease)
			released, _, err := c.Release(ctx, "vm1")
			require.NoError(t, err)
			assert.True(t, released)
			m, err := q.List()
			require.NoError(t, err)
			require.Len(t, m, 1)
			key := lease.IDs(m)[0]
			if tc.name == "vendor" {
				assert.Equal(t, got[0].GetVgpu().GetDeviceId(), key, "the VF")
			} else {
				assert.Equal(t, got[0].GetVgpu().GetParent(), key, "the parent GPU")
			}

			e.record(t, "vm2")
			_, err = c.Claim(ctx, "vm2", tc.profile, 1)
			require.Error(t, err, "no vGPU on a quarantined device")
			assert.Empty(t, e.devices(t))
			_, err = q.Clear(ctx, key)
			require.NoError(t, err)
			_, err = c.Claim(ctx, "vm2", tc.profile, 1)
			require.NoError(t, err)
		})
	}
}
