package e2e

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// Invariant 12, for real: one instance's record
// is torn while the agent is down. The restarted agent serves every other
// instance (one is deleted, vGPU and all), leaves the torn one's VM alone,
// and that instance's delete parks needing attention with RecordUnreadable
// instead of retrying out of sight; once the record is repaired, `retry`
// finishes it. Fails if the agent exits at start on the torn record,
// taking the whole host down.
func TestTornRecordParksOnlyItsOwnDelete(t *testing.T) {
	timeTest(t)
	e := newEnv(t, envOptions{})
	torn, fine := "e2e-torn-"+suffix(t), "e2e-fine-"+suffix(t)
	e.spawn(e.noneSpawn(torn, false))
	e.spawn(e.noneSpawn(fine, true))
	tornQEMU := identityOf(e.record(torn))

	e.agent.Kill(t)
	p, err := e.st.Paths(torn)
	require.NoError(t, err)
	good, err := os.ReadFile(p.Record)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, good[:len(good)/2], 0o600))
	e.agent.Start(t)

	var del vmflowv1.DeleteResult
	require.NoError(t, e.startDelete(fine, 1).Get(e.ctx(2*time.Minute), &del), "the rest of the host is served")
	assert.Nil(t, e.record(fine))

	delID := workflows.DeleteWorkflowID(torn)
	run := e.startDelete(torn, 1)
	// A platform delete marks, stops and waits in one activity (StopInstance):
	// its BeginDelete parks it at stage stopping.
	st := e.waitStage(delID, workflows.StageStopping, time.Minute, func(s *vmflowv1.WorkflowStatus) bool { return s.GetNeedsAttention() })
	assert.Contains(t, st.GetLastError(), workflows.ErrTypeRecordUnreadable)
	out := e.cli("workflow", "list", "--query", "VmNeedsAttention=true AND VmInstanceId='"+torn+"'")
	assert.Contains(t, out, delID, "found by VmNeedsAttention")
	assert.True(t, proc.Inspect(tornQEMU).Alive, "the torn instance's VM was left alone: %+v (identity %v)", proc.Inspect(tornQEMU), tornQEMU)
	assert.Contains(t, e.agent.Tail(1<<20), p.Record, "the agent's log names the torn file")

	require.NoError(t, os.WriteFile(p.Record, good, 0o600))
	e.cli("workflow", "signal", "--workflow-id", delID, "--name", workflows.RetrySignal, "--input", `{"reason":"e2e: record restored"}`)
	require.NoError(t, run.Get(e.ctx(2*time.Minute), &del))
	assertNoProcess(t, tornQEMU)
	e.assertNothingLeft()
}

// Invariant 12 without breaking invariant 1: an agent
// restarted with --vgpu-driver=none on a host whose record holds a claim
// starts and supervises, names the instance in its start log, and the
// instance's delete waits needing attention with VGPUUnavailable, keeping
// the record and claim, instead of reporting the release done while the
// store refuses the record's delete forever. With the driver back, `retry`
// finishes it. Fails if the release "succeeds" silently.
func TestAgentWithoutDriverNeverReleasesSilently(t *testing.T) {
	timeTest(t)
	e := newEnv(t, envOptions{})
	id := "e2e-nodrv-" + suffix(t)
	e.spawn(e.noneSpawn(id, true))

	withDriver := e.agent.Args
	e.agent.Kill(t)
	e.agent.Args = append(append([]string{}, withDriver...), "--vgpu-driver", "none")
	e.agent.Start(t)
	waitFor(t, 30*time.Second, "start log names the unserved claim", func() (bool, string) {
		for _, l := range strings.Split(e.agent.Tail(1<<20), "\n") {
			if strings.Contains(l, "no driver for") && strings.Contains(l, id) {
				return true, ""
			}
		}
		return false, "not logged yet"
	})

	delID := workflows.DeleteWorkflowID(id)
	run := e.startDelete(id, 1)
	st := e.waitStage(delID, workflows.StageReleaseFailed, time.Minute, nil)
	assert.True(t, st.GetNeedsAttention())
	assert.Contains(t, st.GetLastError(), workflows.ErrTypeVGPUUnavailable)
	rec := e.record(id)
	require.NotNil(t, rec, "record kept")
	assert.True(t, store.ClaimHeld(rec), "claim kept")
	assert.Len(t, e.simDevices(), 1, "the device was not touched")

	e.agent.Kill(t)
	e.agent.Args = withDriver
	e.agent.Start(t)
	e.cli("workflow", "signal", "--workflow-id", delID, "--name", workflows.RetrySignal)
	var del vmflowv1.DeleteResult
	require.NoError(t, run.Get(e.ctx(2*time.Minute), &del))
	e.assertNothingLeft()
}
