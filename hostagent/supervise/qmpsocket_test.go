package supervise

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
)

// A 63-byte id under a 90-byte --state-dir: its QMP socket path (174 bytes)
// is far past the 107 a Unix socket address holds. A real agent launches it
// and QEMU answers QMP; after the agent is killed -9 a new supervisor
// re-attaches, talks QMP to the same QEMU and stops it. Before, Create
// refused the id ("QMP socket path too long").
func TestLongStateDirLaunchesAndReattaches(t *testing.T) {
	e := newEnv(t)
	dir := filepath.Join(e.dir, strings.Repeat("s", 90-len(e.dir)-1))
	require.Len(t, dir, 90)
	st, err := store.New(dir)
	require.NoError(t, err)
	e.dir, e.st = dir, st
	envRanges.Store(e.dir, e.uids)
	id := strings.Repeat("v", 63)
	p, err := e.st.Paths(id)
	require.NoError(t, err)
	require.Greater(t, len(p.Socket), vmm.MaxSocketPath)

	e.create(id, "on-failure", 0)
	a, pid := startAgent(t, e.dir, id, "", "running")
	rec := e.get(id)
	require.Equal(t, stateRunning, rec.GetState(), "launched: QMP answered running")
	qemu := store.IdentityOf(rec.GetProcess())
	require.Equal(t, pid, qemu.PID)
	adoptOnCleanup(t, qemu)
	assert.FileExists(t, p.Socket, "bound at its own path, through the directory")

	a.kill9(t)
	require.True(t, proc.Inspect(qemu).Alive, "QEMU outlives its agent")
	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Equal(t, ReattachReport{Records: 1, Attached: 1, Duration: rep.Duration}, rep)
	qs, err := sup.QMPStatus(ctxT(t, 10*time.Second), id)
	require.NoError(t, err, "QMP dialled on re-attach")
	assert.True(t, qs.Running)

	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), id))
	sres, err := sup.Stop(ctxT(t, 30*time.Second), id, 100*time.Millisecond)
	require.NoError(t, err)
	assert.Equal(t, vmm.StepGone, sres.Reached)
	assert.Equal(t, stateExited, e.get(id).GetState())
	assert.NoFileExists(t, p.Socket, "the stale socket removed through its directory")
	reapAdopted(t, qemu)
	assertNoZombieChildren(t)
}
