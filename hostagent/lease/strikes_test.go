package lease_test

import (
	"context"
	"os"
	"path/filepath"
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
	"vmflow/internal/errdefs"
)

// untilSimBlocked is a context that ends once a write to the simulator
// blocks: the caller has then waited on a write in flight, not failed.
func untilSimBlocked(t *testing.T, sim *simtest.Sim) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	go func() {
		defer cancel()
		for ctx.Err() == nil && sim.Server.Blocked() == 0 {
			time.Sleep(time.Millisecond) // polling a counter: there is no event for it
		}
	}()
	return ctx
}

// vmMayLive makes instance id's release a refusal (ErrVMAlive): its QMP
// socket is on disk with no stop recorded, so a QEMU of it may run.
func vmMayLive(t *testing.T, paths func(string) (string, error), id string) (gone func()) {
	t.Helper()
	sock, err := paths(id)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(sock, nil, 0o600))
	return func() { require.NoError(t, os.Remove(sock)) }
}

// TestRefusalNeverStrikes: a release refused because the VM may live is
// not the device's failure. With K=2, one refusal and one failed release
// of the device leave it in placement; the second failure of the device
// itself quarantines it. (Before: the lease's release_attempts, which
// counts refusals too, was the count, and a healthy GPU was quarantined.)
func TestRefusalNeverStrikes(t *testing.T) {
	ctx := context.Background()
	t.Run("vgpu", func(t *testing.T) {
		e := newClaims(t, vgpusim.Options{MdevParents: 1})
		q := lease.NewQuarantine(e.st.StateDir(), 2, nil)
		c, err := lease.New(lease.Config{Driver: gpu.Config{SysfsRoot: e.sim.Root, StateDir: e.st.StateDir()}, Store: e.st, DevRoot: e.devDir,
			OrphanGrace: time.Minute, IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now, Quarantine: q})
		require.NoError(t, err)
		e.record(t, "vm1")
		got, err := claimOne(ctx, c, "vm1", profile)
		require.NoError(t, err)
		e.beginDelete(t, "vm1")
		parent := got.GetVgpu().GetParent()

		gone := vmMayLive(t, socketOf(e.st), "vm1")
		_, _, err = c.Release(ctx, "vm1")
		require.ErrorIs(t, err, lease.ErrVMAlive)
		gone()
		e.sim.Set(t, vgpusim.CtlFailRelease, "EIO")
		_, _, err = c.Release(ctx, "vm1")
		require.Error(t, err)
		requireQuarantined(t, q, parent, false, "one refusal and one failure of the device")
		_, _, err = c.Release(ctx, "vm1")
		require.Error(t, err)
		requireQuarantined(t, q, parent, true, "the device's second failure in a row")
	})
	t.Run("whole", func(t *testing.T) {
		e := newWhole(t, 1)
		q := lease.NewQuarantine(e.st.StateDir(), 2, nil)
		w, err := lease.NewWhole(lease.WholeConfig{Driver: e.whole.Driver(), Store: e.st, Quarantine: q,
			IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now})
		require.NoError(t, err)
		addr := vgpusim.PCIGPUAt(0).GPU
		e.record(t, "vm1", 1)
		_, err = w.Claim(ctx, "vm1", "", 1)
		require.NoError(t, err)
		e.beginDelete(t, "vm1")

		gone := vmMayLive(t, socketOf(e.st), "vm1")
		_, _, err = w.Release(ctx, "vm1")
		require.ErrorIs(t, err, lease.ErrVMAlive)
		gone()
		e.sim.Set(t, vgpusim.CtlFailUnbind, "EIO")
		_, _, err = w.Release(ctx, "vm1")
		require.ErrorIs(t, err, gpu.ErrUnbindFailed)
		requireQuarantined(t, q, addr, false, "one refusal and one failed unbind")
		_, _, err = w.Release(ctx, "vm1")
		require.ErrorIs(t, err, gpu.ErrUnbindFailed)
		requireQuarantined(t, q, addr, true, "the second failed unbind in a row")
	})
}

// TestWaitNeverStrikes: a release that only waited on an unbind still in
// flight (ErrReleaseInProgress, Busy) has not failed: however often it
// waits, the GPU is not quarantined, and once the write completes the
// release goes through.
func TestWaitNeverStrikes(t *testing.T) {
	ctx := context.Background()
	e := newWhole(t, 1)
	q := lease.NewQuarantine(e.st.StateDir(), 2, nil)
	w, err := lease.NewWhole(lease.WholeConfig{Driver: e.whole.Driver(), Store: e.st, Quarantine: q,
		IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now})
	require.NoError(t, err)
	addr := vgpusim.PCIGPUAt(0).GPU
	e.record(t, "vm1", 1)
	_, err = w.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	e.beginDelete(t, "vm1")

	e.sim.Set(t, vgpusim.CtlBlockUnbind, "")
	_, _, err = w.Release(untilSimBlocked(t, e.sim), "vm1")
	require.ErrorIs(t, err, gpu.ErrReleaseInProgress)
	for range 2 {
		short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		_, _, err = w.Release(short, "vm1")
		cancel()
		require.Error(t, err)
		assert.Equal(t, errdefs.Busy, errdefs.ClassOf(err), "a wait: %v", err)
	}
	requireQuarantined(t, q, addr, false, "three waits on one unbind in flight")
	assert.Empty(t, q.Strikes(), "a wait counts nothing")
	e.sim.Clear(t, vgpusim.CtlBlockUnbind)
	require.Eventually(t, func() bool {
		released, _, err := w.Release(ctx, "vm1")
		return err == nil && released
	}, 30*time.Second, 10*time.Millisecond)
}

// TestStrikesCountFailuresInARow: a success ends a device's run of
// failures, so K failures spread over a long life with successes between
// them do not quarantine it.
func TestStrikesCountFailuresInARow(t *testing.T) {
	ctx := context.Background()
	q := lease.NewQuarantine(t.TempDir(), 2, nil)
	added, err := q.Strike(ctx, "vm1", "reset: EIO", "0000:01:00.0")
	require.NoError(t, err)
	assert.Empty(t, added)
	require.NoError(t, q.Succeeded(ctx, "0000:01:00.0"))
	added, err = q.Strike(ctx, "vm2", "reset: EIO", "0000:01:00.0")
	require.NoError(t, err)
	assert.Empty(t, added, "the success between the two failures started the count over")
	added, err = q.Strike(ctx, "vm2", "reset: EIO", "0000:01:00.0")
	require.NoError(t, err)
	assert.Equal(t, []string{"0000:01:00.0"}, added)
}

// TestNullQuarantineFailsClosed: a quarantine file holding null (or any
// content vmflow did not write) names no device, but may have lost some:
// it reads as unreadable, placement hands out no GPU, a new failure is
// not written over it (before: it read as empty and the next write
// panicked on a nil map), and `devices clear --reset` (Reset) sets it
// aside for an empty one.
func TestNullQuarantineFailsClosed(t *testing.T) {
	for _, content := range []string{"null", "", "{\"0000:01:00.0\":", "[]"} {
		t.Run(content, func(t *testing.T) {
			ctx := context.Background()
			e := newWhole(t, 1)
			q := lease.NewQuarantine(e.st.StateDir(), 1, nil)
			path := filepath.Join(e.st.StateDir(), lease.QuarantineFile)
			require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
			w, err := lease.NewWhole(lease.WholeConfig{Driver: e.whole.Driver(), Store: e.st, Quarantine: q,
				IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now})
			require.NoError(t, err)

			_, err = q.List()
			require.ErrorIs(t, err, lease.ErrQuarantineUnreadable)
			has, err := q.Has(vgpusim.PCIGPUAt(0).GPU)
			require.Error(t, err)
			assert.True(t, has, "an unreadable quarantine may name any device")
			e.record(t, "vm1", 1)
			_, err = w.Claim(ctx, "vm1", "", 1)
			require.ErrorIs(t, err, lease.ErrQuarantineUnreadable, "no GPU is handed out")

			assert.NotPanics(t, func() {
				_, err = q.Strike(ctx, "vm0", "reset: EIO", vgpusim.PCIGPUAt(0).GPU)
			})
			require.ErrorIs(t, err, lease.ErrQuarantineUnreadable, "a failure is not written over it")
			b, err := os.ReadFile(path)
			require.NoError(t, err)
			assert.Equal(t, content, string(b), "left as it was")

			aside, err := q.Reset(ctx)
			require.NoError(t, err)
			b, err = os.ReadFile(aside)
			require.NoError(t, err)
			assert.Equal(t, content, string(b), "kept for the operator")
			_, err = q.Reset(ctx)
			require.ErrorIs(t, err, lease.ErrQuarantineReadable, "a readable quarantine is cleared by id")
			_, err = w.Claim(ctx, "vm1", "", 1)
			require.NoError(t, err, "mended, the GPU is placed")
		})
	}
}

func requireQuarantined(t *testing.T, q *lease.Quarantine, dev string, want bool, when string) {
	t.Helper()
	has, err := q.Has(dev)
	require.NoError(t, err)
	require.Equal(t, want, has, "%s: quarantined %v, strikes %v", when, has, q.Strikes())
}

func socketOf(st *store.Store) func(string) (string, error) {
	return func(id string) (string, error) {
		p, err := st.Paths(id)
		return p.Socket, err
	}
}
