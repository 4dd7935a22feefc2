package supervise

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
)

// Existing answers "what is there" for a spawn that did not create the
// instance, and touches nothing (invariant 9's host side).
func TestExisting(t *testing.T) {
	t.Run("running", func(t *testing.T) {
		e := newEnv(t)
		sup := e.newSupervisor(nil)
		e.create("vm1", "", 0)
		res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
		require.NoError(t, err)
		got, err := sup.Existing(ctxT(t, 10*time.Second), "vm1")
		require.NoError(t, err)
		assert.True(t, got.AlreadyRunning)
		assert.Equal(t, res.Identity, got.Identity)
	})
	t.Run("paused", func(t *testing.T) {
		e := newEnv(t)
		sup := e.newSupervisor(nil)
		e.create("vm1", "", 0)
		res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
		require.NoError(t, err)
		mon, err := sup.lookup("vm1").current(res.Identity).Monitor(ctxT(t, 5*time.Second))
		require.NoError(t, err)
		require.NoError(t, mon.Execute(ctxT(t, 5*time.Second), "stop", nil, nil))

		_, err = sup.Existing(ctxT(t, 10*time.Second), "vm1")
		require.ErrorIs(t, err, ErrNotRunningAsAsked)
		assert.Contains(t, err.Error(), "paused")
		st, err := sup.QMPStatus(ctxT(t, 5*time.Second), "vm1")
		require.NoError(t, err)
		assert.Equal(t, "paused", st.Status, "left paused: nothing resumed it")
		assert.Equal(t, stateRunning, e.get("vm1").GetState())
	})
	t.Run("monitor held", func(t *testing.T) {
		e := newEnv(t)
		launcher := e.newSupervisor(nil)
		e.create("vm1", "", 0)
		res, err := launcher.Launch(ctxT(t, 30*time.Second), "vm1")
		require.NoError(t, err)
		require.NoError(t, launcher.Close()) // gives the monitor back
		sup := e.newSupervisor(nil)
		_, err = sup.Start(ctxT(t, 10*time.Second))
		require.NoError(t, err)
		// Another client holds QEMU's one QMP connection.
		p, _ := e.st.Paths("vm1")
		other, err := vmm.DialQMP(ctxT(t, 5*time.Second), p.Socket)
		require.NoError(t, err)
		defer other.Close()

		start := time.Now()
		_, err = sup.Existing(ctxT(t, 10*time.Second), "vm1")
		require.ErrorIs(t, err, ErrNotRunningAsAsked)
		assert.Contains(t, err.Error(), "QMP did not answer (monitor busy or hung)")
		assert.Less(t, time.Since(start), 5*time.Second, "bounded")
		assert.True(t, proc.Inspect(res.Identity).Alive, "nothing signalled")
		st, err := other.Status(ctxT(t, 5*time.Second))
		require.NoError(t, err)
		assert.True(t, st.Running, "the other client's VM runs on")
	})
	t.Run("exited", func(t *testing.T) {
		e := newEnv(t)
		sup := e.newSupervisor(nil)
		e.create("vm1", "never", 0)
		_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
		require.NoError(t, err)
		killFromOutside(t, e, "vm1")
		require.Eventually(t, func() bool { return e.get("vm1").GetState() == stateExited }, 10*time.Second, 5*time.Millisecond)
		_, err = sup.Existing(ctxT(t, 10*time.Second), "vm1")
		require.ErrorIs(t, err, ErrNotRunningAsAsked)
		assert.Contains(t, err.Error(), "exited (last exit: signal: killed")
	})
	t.Run("launch in progress and no process", func(t *testing.T) {
		e := newEnv(t)
		sup := e.newSupervisor(nil)
		e.create("vm1", "", 0)
		_, err := sup.Existing(ctxT(t, 10*time.Second), "vm1")
		require.ErrorIs(t, err, ErrNotRunningAsAsked)
		assert.Contains(t, err.Error(), "no process (state creating)")

		l, err := e.st.Lock(ctxT(t, 5*time.Second), "vm1") // a launch holds the lock
		require.NoError(t, err)
		_, err = sup.Existing(ctxT(t, 10*time.Second), "vm1")
		require.ErrorIs(t, err, ErrNotRunningAsAsked)
		assert.Contains(t, err.Error(), "launch in progress")
		_, err = l.Apply(store.BeginLaunch(time.Now(), nil))
		require.NoError(t, err)
		require.NoError(t, l.Unlock())
		_, err = sup.Existing(ctxT(t, 10*time.Second), "vm1")
		require.ErrorIs(t, err, ErrNotRunningAsAsked)
		assert.Contains(t, err.Error(), "launch in progress (started at")
		assert.NotNil(t, e.get("vm1").GetLaunchStartedAt(), "Existing resolves nothing")

		_, err = sup.Existing(ctxT(t, 10*time.Second), "nosuch")
		assert.ErrorIs(t, err, store.ErrNotFound)
	})
}
