package deploy_test

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
	"vmflow/workflows"
)

// runbookCommands returns every line of RUNBOOK.md's fenced code blocks that
// starts with "temporal ": all of them, marked or not, so a command added to
// the runbook is run here without anyone remembering to tag it.
func runbookCommands(t *testing.T) []string {
	t.Helper()
	f, err := os.Open("RUNBOOK.md")
	require.NoError(t, err)
	defer f.Close()
	var cmds []string
	inBlock := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "```") {
			inBlock = !inBlock
			continue
		}
		if inBlock && strings.HasPrefix(line, "temporal ") {
			cmds = append(cmds, line)
		}
	}
	require.NoError(t, sc.Err())
	require.False(t, inBlock, "RUNBOOK.md: unterminated code block")
	return cmds
}

// stuckHost answers the host activities like a healthy host whose vGPU
// release fails with EBUSY: it stands in for the agent at the host-queue
// boundary (like workflows' scriptedHost), since the runbook is about what
// the operator sees and does in Temporal.
type stuckHost struct{ releases atomic.Int32 }

var _ workflows.HostActivities = (*stuckHost)(nil)

func (*stuckHost) ValidateSpawn(context.Context, *vmflowv1.SpawnRequest) error { return nil }
func (*stuckHost) CreateRecord(context.Context, *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	return &vmflowv1.CreateRecordResult{CreatedByThisSpawn: true}, nil
}
func (*stuckHost) ClaimDevices(context.Context, *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	return &vmflowv1.ClaimVGPUResult{}, nil
}
func (*stuckHost) LaunchVM(context.Context, *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	return &vmflowv1.LaunchVMResult{}, nil
}
func (*stuckHost) BeginDelete(context.Context, *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	return &vmflowv1.BeginDeleteResult{HasClaim: true}, nil
}
func (*stuckHost) StopVM(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	return &vmflowv1.StopVMResult{StepReached: "quit"}, nil
}
func (*stuckHost) WaitVMExit(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (h *stuckHost) ReleaseLeases(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	h.releases.Add(1)
	// NonRetryable: each round is one attempt, so the workflow (not the
	// activity retry policy) shows release-failed at once.
	return nil, temporal.NewNonRetryableApplicationError(
		"write /sys/bus/mdev/devices/0b6f1a9e/remove: device or resource busy", workflows.ErrTypeReleaseFailed, nil)
}
func (*stuckHost) TearDown(context.Context, *vmflowv1.InstanceRef) error     { return nil }
func (*stuckHost) DeleteRecord(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (*stuckHost) ReconcileHost(context.Context, *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	return &vmflowv1.ReconcileVGPUResult{}, nil
}

// Every temporal command of the runbook runs, as written (placeholders
// filled in), against a dev server where a real worker runs a delete that
// is stuck in release-failed. The abandon line runs last, after the host's
// worker is gone and the delete shows host-unreachable, which is the only
// state abandon is for.
func TestRunbookCommands(t *testing.T) {
	const (
		queue      = "vmflow-runbook"
		hostID     = "rb-host"
		instanceID = "rb-vm"
	)
	cmds := runbookCommands(t)
	require.GreaterOrEqual(t, len(cmds), 8, "RUNBOOK.md lost its commands? %q", cmds)

	srv := devserver.Start(t, devserver.Options{})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	w := worker.New(c, queue, worker.Options{})
	// An hour of backoff: only the runbook's retry signals start a round.
	workflows.New(workflows.Config{
		ReleaseBackoff: time.Hour, ReleaseBackoffMax: time.Hour,
		ScheduleToStartTimeout: 3 * time.Second,
		UnreachableBackoff:     time.Hour, UnreachableBackoffMax: time.Hour,
	}).Register(w)
	require.NoError(t, w.Start())
	defer w.Stop()
	host := &stuckHost{}
	hw := worker.New(c, workflows.HostTaskQueue(hostID), worker.Options{})
	workflows.RegisterHostActivities(hw, host)
	require.NoError(t, hw.Start())
	var stopHost sync.Once
	defer stopHost.Do(hw.Stop)

	vc := workflows.NewClient(c, queue)
	run, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: instanceID, HostId: hostID})
	require.NoError(t, err)
	wid := workflows.DeleteWorkflowID(instanceID)
	waitStage := func(stage string, minReleases int32) *vmflowv1.WorkflowStatus {
		t.Helper()
		var st *vmflowv1.WorkflowStatus
		require.Eventually(t, func() bool {
			st, err = vc.Status(ctx, wid)
			return err == nil && st.GetStage() == stage && host.releases.Load() >= minReleases
		}, time.Minute, 100*time.Millisecond, "delete never reached %s (releases %d, last status %v, err %v)",
			stage, host.releases.Load(), st, err)
		return st
	}
	st := waitStage(workflows.StageReleaseFailed, 1)
	require.True(t, st.GetNeedsAttention())
	require.True(t, st.GetMetadataRetained())
	// Visibility is eventually consistent: the list commands below must
	// find the delete, so wait until the server's index does.
	require.Eventually(t, func() bool {
		out, err := srv.CLI(ctx, "workflow", "count", "--query", "VmNeedsAttention = true")
		return err == nil && strings.Contains(string(out), "Total: 1")
	}, 30*time.Second, 200*time.Millisecond)

	env := cliEnv(t, srv, srv.Namespace())
	fill := strings.NewReplacer("<instance_id>", instanceID, "<host_id>", hostID)
	var abandonUpdate, abandonSignal []string
	for _, raw := range cmds {
		line := fill.Replace(raw)
		if strings.Contains(line, "--name abandon") {
			// Abandon needs an unreachable host: last. The update is
			// also run now, where it must be refused with the reason.
			if strings.HasPrefix(line, "temporal workflow update") {
				abandonUpdate = append(abandonUpdate, line)
				out, err := tryLine(ctx, env, line)
				require.Error(t, err, "abandon while the host answers must fail: %s\n%s", line, out)
				assert.Contains(t, out, "abandon refused: host "+hostID+" is reachable (stage "+workflows.StageReleaseFailed+")", "%s", line)
			} else {
				abandonSignal = append(abandonSignal, line)
			}
			continue
		}
		before := host.releases.Load()
		out := runLine(ctx, t, env, line)
		switch {
		case strings.HasPrefix(line, "temporal workflow list"):
			assert.Contains(t, out, wid, "%s", line)
		case strings.HasPrefix(line, "temporal workflow count"):
			assert.Contains(t, out, "Total: 1", "%s", line)
		case strings.Contains(line, "--name status"):
			assert.Contains(t, out, workflows.StageReleaseFailed, "%s", line)
			assert.Contains(t, out, "device or resource busy", "%s", line)
			assert.Regexp(t, `"metadata_?[rR]etained":\s*true`, out, "%s", line)
		case strings.HasPrefix(line, "temporal workflow metadata"), strings.HasPrefix(line, "temporal workflow show"):
			assert.Contains(t, out, "device or resource busy", "%s: the failure must be readable here", line)
		case strings.HasPrefix(line, "temporal workflow describe"):
			assert.Contains(t, out, workflows.StageReleaseFailed, "%s: VmStage", line)
		case strings.HasPrefix(line, "temporal workflow update") && strings.Contains(line, "--name retry"):
			// The update answers once the round it asked for started.
			assert.Contains(t, out, workflows.StageReleasingLeases, "%s: the new status", line)
			waitStage(workflows.StageReleaseFailed, before+1)
		case strings.Contains(line, "--name retry"):
			// The signal starts a round at once (the timer is an hour);
			// the fault is still there, so the delete is stuck again.
			waitStage(workflows.StageReleaseFailed, before+1)
		}
	}
	require.Len(t, abandonUpdate, 1, "the runbook shows the abandon update once")
	require.Len(t, abandonSignal, 1, "the runbook shows the abandon signal (the fallback) once")
	// The signal, sent while the host answers, is accepted by the server
	// and refused by the workflow: it must not abandon the delete later.
	runLine(ctx, t, env, abandonSignal[0])

	// The host goes away for good: the next round is not picked up.
	stopHost.Do(hw.Stop)
	_, err = vc.Retry(ctx, wid, "test: start a round the host will not pick up")
	require.NoError(t, err)
	st = waitStage(workflows.StageHostUnreachable, 0)
	assert.True(t, st.GetMetadataRetained())
	out := runLine(ctx, t, env, abandonUpdate[0])
	assert.Contains(t, out, workflows.StageAbandoned, "the update answers with the final status")
	var res vmflowv1.DeleteResult
	require.NoError(t, run.Get(ctx, &res))
	assert.True(t, res.GetAbandoned())
	assert.Contains(t, res.GetAbandonReason(), hostID+" decommissioned")
}

// TestRunbookAbandonSignalFallback: the runbook's abandon signal, sent
// while the host is unreachable, ends the delete as abandoned.
func TestRunbookAbandonSignalFallback(t *testing.T) {
	const (
		queue      = "vmflow-runbook-signal"
		hostID     = "rb-gone"
		instanceID = "rb-vm2"
	)
	var line string
	for _, l := range runbookCommands(t) {
		if strings.HasPrefix(l, "temporal workflow signal") && strings.Contains(l, "--name abandon") {
			line = strings.NewReplacer("<instance_id>", instanceID, "<host_id>", hostID).Replace(l)
		}
	}
	require.NotEmpty(t, line, "RUNBOOK.md shows no abandon signal")
	srv := devserver.Start(t, devserver.Options{})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	w := worker.New(c, queue, worker.Options{})
	workflows.New(workflows.Config{
		ScheduleToStartTimeout: time.Second,
		UnreachableBackoff:     time.Hour, UnreachableBackoffMax: time.Hour,
	}).Register(w)
	require.NoError(t, w.Start())
	defer w.Stop()
	vc := workflows.NewClient(c, queue)
	run, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: instanceID, HostId: hostID})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st, err := vc.Status(ctx, workflows.DeleteWorkflowID(instanceID))
		return err == nil && st.GetStage() == workflows.StageHostUnreachable
	}, time.Minute, 100*time.Millisecond)
	runLine(ctx, t, cliEnv(t, srv, srv.Namespace()), line)
	var res vmflowv1.DeleteResult
	require.NoError(t, run.Get(ctx, &res))
	assert.True(t, res.GetAbandoned())
	assert.Contains(t, res.GetAbandonReason(), hostID+" decommissioned")
}

// runLine runs one runbook line with bash, as an operator would paste it.
func runLine(ctx context.Context, t *testing.T, env []string, line string) string {
	t.Helper()
	out, err := tryLine(ctx, env, line)
	require.NoError(t, err, "runbook line failed: %s\n%s", line, out)
	return out
}

// tryLine runs one runbook line and returns its output and exit error.
func tryLine(ctx context.Context, env []string, line string) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(cctx, "bash", "-euo", "pipefail", "-c", line)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	return string(out), err
}
