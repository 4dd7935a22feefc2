package e2e

import (
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// Invariant 9, for real: VM X runs with a vGPU but its
// QEMU hangs (SIGSTOP: QMP silent); the platform re-sends X's spawn. The
// re-sent spawn must fail with InstanceExists saying what it found, and
// leave X alone: no stop, no release, no delete workflow. Once X answers
// again, a re-sent spawn succeeds with X itself (same pid). Fails if the
// re-sent spawn retries LaunchVM and then starts DeleteInstance for X.
func TestResentSpawnNeverDestroysExistingInstance(t *testing.T) {
	timeTest(t)
	e := newEnv(t, envOptions{})
	id := "e2e-resend-" + suffix(t)
	first := e.spawn(e.noneSpawn(id, true))
	qemu := identityOf(e.record(id))
	require.True(t, proc.Inspect(qemu).Alive)

	require.NoError(t, syscall.Kill(qemu.PID, syscall.SIGSTOP))
	stopped := true
	defer func() {
		if stopped {
			_ = syscall.Kill(qemu.PID, syscall.SIGCONT)
		}
	}()
	var res vmflowv1.SpawnResult
	err := e.startSpawn(e.noneSpawn(id, true)).Get(e.ctx(2*time.Minute), &res)
	require.Error(t, err, "a re-sent spawn of a hung instance must not report success")
	assert.Contains(t, err.Error(), workflows.ErrTypeInstanceExists)
	assert.Contains(t, err.Error(), "did not answer", "it says what it found")
	t.Logf("re-sent spawn failed as it should: %v", err)

	require.NoError(t, syscall.Kill(qemu.PID, syscall.SIGCONT))
	stopped = false
	assert.True(t, proc.Inspect(qemu).Alive, "X was not stopped")
	rec := e.record(id)
	require.NotNil(t, rec, "X's record was not deleted")
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RUNNING, rec.GetState())
	assert.False(t, store.IsDeleting(rec))
	assert.True(t, store.ClaimHeld(rec), "X's vGPU was not released")
	assert.Len(t, e.simDevices(), 1)
	marked, err := e.st.ManualStop(id)
	require.NoError(t, err)
	assert.False(t, marked, "no delete began")
	_, err = e.c.DescribeWorkflow(e.ctx(10*time.Second), workflows.DeleteWorkflowID(id), "")
	assert.Error(t, err, "no DeleteInstance was started for X")

	// X answers again: a re-sent spawn is X's success, not a second VM.
	again := e.spawn(e.noneSpawn(id, true))
	assert.Equal(t, int32(qemu.PID), again.GetPid())
	assert.Equal(t, first.GetVgpuUuid(), again.GetVgpuUuid())
	assert.Equal(t, first.GetVgpuDeviceId(), again.GetVgpuDeviceId())
	assert.Equal(t, first.GetInstanceUuid(), again.GetInstanceUuid())

	var del vmflowv1.DeleteResult
	require.NoError(t, e.startDelete(id, 1).Get(e.ctx(2*time.Minute), &del))
	e.assertNothingLeft()
}
