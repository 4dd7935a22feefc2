package worker

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
	"vmflow/testsupport/stacktest"
	"vmflow/workflows"
)

// rolloutHost answers the host activities like a healthy host, except that
// ReleaseLeases fails while failRelease is set and LaunchVM waits until
// launch is closed. It stands in for the agent at the host-queue boundary
// and polls unversioned, as vmflow-hostagent does.
type rolloutHost struct {
	failRelease atomic.Bool
	launch      chan struct{}
}

var _ workflows.HostActivities = (*rolloutHost)(nil)

// failLaunch is the instance whose launch fails: its spawn starts its
// clean-up delete as a child.
const failLaunch = "ro-fail"

func (*rolloutHost) ValidateSpawn(context.Context, *vmflowv1.SpawnRequest) error { return nil }
func (*rolloutHost) CreateRecord(context.Context, *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	return &vmflowv1.CreateRecordResult{InstanceUuid: "u", CreatedByThisSpawn: true}, nil
}
func (*rolloutHost) ClaimDevices(context.Context, *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	return &vmflowv1.ClaimVGPUResult{}, nil
}
func (h *rolloutHost) LaunchVM(ctx context.Context, req *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	if req.GetInstanceId() == failLaunch {
		return nil, temporal.NewNonRetryableApplicationError("qemu exited with status 1", workflows.ErrTypeLaunchFailed, nil)
	}
	select {
	case <-h.launch:
		return &vmflowv1.LaunchVMResult{Pid: 42}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
func (*rolloutHost) BeginDelete(context.Context, *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	return &vmflowv1.BeginDeleteResult{HasClaim: true}, nil
}
func (*rolloutHost) StopVM(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	return &vmflowv1.StopVMResult{StepReached: "quit"}, nil
}
func (*rolloutHost) WaitVMExit(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (h *rolloutHost) ReleaseLeases(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	if h.failRelease.Load() {
		// NonRetryable: each round is one attempt, so the delete parks
		// in release-failed at once.
		return nil, temporal.NewNonRetryableApplicationError("write remove: device or resource busy", workflows.ErrTypeReleaseFailed, nil)
	}
	return &vmflowv1.ReleaseVGPUResult{Released: true}, nil
}
func (*rolloutHost) TearDown(context.Context, *vmflowv1.InstanceRef) error     { return nil }
func (*rolloutHost) DeleteRecord(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (*rolloutHost) ReconcileHost(context.Context, *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	return &vmflowv1.ReconcileVGPUResult{}, nil
}

// buildStamped builds vmflow-worker with `make build`'s ldflags for version
// and returns its path: the build id a --versioning worker joins with.
func buildStamped(ctx context.Context, t *testing.T, dir, version string) string {
	t.Helper()
	p := filepath.Join(dir, "vmflow-worker-"+version)
	require.NoError(t, stacktest.Build(ctx, p, "./worker", &stacktest.Stamp{Version: version, Revision: "0000000000000000000000000000000000000000"}))
	return p
}

// taskBuilds are the build ids of a workflow's completed workflow tasks, in
// history order, and the versioning behaviour each reported.
func taskBuilds(ctx context.Context, c client.Client, workflowID string) (builds []string, behaviors []enumspb.VersioningBehavior, err error) {
	it := c.GetWorkflowHistory(ctx, workflowID, "", false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	for it.HasNext() {
		ev, err := it.Next()
		if err != nil {
			return nil, nil, fmt.Errorf("history of %s: %w", workflowID, err)
		}
		if a := ev.GetWorkflowTaskCompletedEventAttributes(); a != nil {
			builds = append(builds, completedBuild(a))
			behaviors = append(behaviors, a.GetVersioningBehavior())
		}
	}
	return builds, behaviors, nil
}

func completedBuild(a *historypb.WorkflowTaskCompletedEventAttributes) string {
	if v := a.GetDeploymentVersion(); v != nil {
		return v.GetDeploymentName() + "/" + v.GetBuildId()
	}
	return "unversioned"
}

// A delete parked in release-failed on build 1 moves to build 2 once build 2
// is the deployment's current version, and finishes there after build 1 is
// stopped; a spawn that started on build 1 is pinned and finishes on build
// 1 although build 2 is current; a failed spawn's clean-up delete, a child
// of a pinned spawn, moves like any delete. Both builds are vmflow-worker binaries
// stamped like `make build`, joined with --versioning and made current with
// the CLI command UPGRADES.md gives; the host polls unversioned.
func TestRolloutMovesParkedDeleteToNewBuild(t *testing.T) {
	began := time.Now()
	srv := devserver.Start(t, devserver.Options{})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	// Build ids with dots and dashes, as `git describe` makes them.
	const v1, v2 = "v0.1.0-rollout", "v0.2.0-1-gabcdef0"
	bin1, bin2 := buildStamped(ctx, t, dir, v1), buildStamped(ctx, t, dir, v2)
	t.Logf("built both workers after %s", time.Since(began).Round(time.Millisecond))

	const queue, hostID = "vmflow-rollout", "ro-host"
	host := &rolloutHost{launch: make(chan struct{})}
	host.failRelease.Store(true)
	hw := worker.New(c, workflows.HostTaskQueue(hostID), worker.Options{})
	workflows.RegisterHostActivities(hw, host)
	require.NoError(t, hw.Start())
	defer hw.Stop()

	start := func(bin, name string) *stacktest.Daemon {
		d := &stacktest.Daemon{Name: name, Bin: bin, Log: filepath.Join(dir, name+".log"),
			// The default deployment name and the stamped build id.
			Args: []string{"--versioning", "--task-queue", queue, "--address", srv.Address(), "--namespace", srv.Namespace(),
				"--release-backoff", "1s", "--release-backoff-max", "2s", "--log-level", "debug"},
			Env: []string{"TEMPORAL_CONFIG_FILE=" + filepath.Join(dir, "none.toml")}}
		d.Start(t)
		t.Cleanup(func() { _ = d.Stop() })
		return d
	}
	logs := func(ds ...*stacktest.Daemon) string {
		var b strings.Builder
		for _, d := range ds {
			fmt.Fprintf(&b, "--- %s:\n%s\n", d.Name, d.Tail(4000))
		}
		return b.String()
	}
	// setCurrent is the operator's command. It fails until the version's
	// pollers have reached the server (the server creates the version on
	// their first poll).
	setCurrent := func(build string) {
		var last string
		require.Eventually(t, func() bool {
			out, err := srv.CLI(ctx, "worker", "deployment", "set-current-version",
				"--deployment-name", DefaultDeploymentName, "--build-id", build, "--yes")
			last = string(out)
			return err == nil
		}, time.Minute, 500*time.Millisecond, "set-current-version %s never succeeded; last output:\n%s", build, last)
	}

	w1 := start(bin1, "worker-"+v1)
	setCurrent(v1)

	vc := workflows.NewClient(c, queue)
	spawn, err := vc.StartSpawn(ctx, &vmflowv1.SpawnRequest{InstanceId: "ro-spawn", HostId: hostID, Vcpus: 1, MemoryMib: 64, Machine: "none"})
	require.NoError(t, err)
	del, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: "ro-vm", HostId: hostID})
	require.NoError(t, err)
	failed, err := vc.StartSpawn(ctx, &vmflowv1.SpawnRequest{InstanceId: failLaunch, HostId: hostID, Vcpus: 1, MemoryMib: 64, Machine: "none"})
	require.NoError(t, err)
	stageIs := func(workflowID, stage string) func() bool {
		return func() bool {
			st, err := vc.Status(ctx, workflowID)
			return err == nil && st.GetStage() == stage
		}
	}
	require.Eventually(t, stageIs(workflows.SpawnWorkflowID("ro-spawn"), workflows.StageLaunching), time.Minute, 100*time.Millisecond,
		"spawn never reached launching\n%s", logs(w1))
	require.Eventually(t, stageIs(workflows.DeleteWorkflowID("ro-vm"), workflows.StageReleaseFailed), time.Minute, 100*time.Millisecond,
		"delete never parked in release-failed\n%s", logs(w1))

	require.Error(t, failed.Get(ctx, nil), "the spawn whose launch fails fails")
	require.Eventually(t, stageIs(workflows.DeleteWorkflowID(failLaunch), workflows.StageReleaseFailed), time.Minute, 100*time.Millisecond,
		"the failed spawn's clean-up delete never parked in release-failed\n%s", logs(w1))

	// Build 2 joins; until it is current it gets no workflow tasks, and it
	// says so with the command that makes it current.
	w2 := start(bin2, "worker-"+v2)
	require.Eventually(t, func() bool {
		return strings.Contains(w2.Tail(1<<16), "set-current-version --deployment-name vmflow --build-id "+v2)
	}, time.Minute, 200*time.Millisecond, "build 2 never logged that it is not current\n%s", logs(w2))
	setCurrent(v2)
	t.Logf("build 2 current after %s", time.Since(began).Round(time.Millisecond))

	// UPGRADES.md's checks before build 1 may stop: its version drains,
	// and the one workflow pinned to it is the running spawn (the
	// delete, AutoUpgrade, is not held there).
	// (No require inside the Eventually conditions: they run on another
	// goroutine; an error is the output the failure message shows.)
	pinnedOnV1 := func() string {
		out, err := srv.CLI(ctx, "workflow", "list", "--query",
			`ExecutionStatus = "Running" AND TemporalWorkflowVersioningBehavior = "Pinned" AND TemporalWorkerDeploymentVersion = "vmflow:`+v1+`"`)
		if err != nil {
			return err.Error()
		}
		return string(out)
	}
	var last string
	require.Eventually(t, func() bool {
		out, err := srv.CLI(ctx, "worker", "deployment", "describe-version", "--deployment-name", DefaultDeploymentName, "--build-id", v1)
		last = string(out)
		return err == nil && strings.Contains(last, "draining")
	}, time.Minute, 500*time.Millisecond, "build 1 does not show draining:\n%s", last)
	require.Eventually(t, func() bool {
		last = pinnedOnV1()
		return strings.Contains(last, workflows.SpawnWorkflowID("ro-spawn"))
	}, time.Minute, 500*time.Millisecond, "the spawn is not listed as pinned to build 1:\n%s", last)
	assert.NotContains(t, last, workflows.DeleteWorkflowID("ro-vm"), "the delete is AutoUpgrade, never pinned")

	// The pinned spawn finishes on build 1, which still runs.
	close(host.launch)
	var sres vmflowv1.SpawnResult
	require.NoError(t, spawn.Get(ctx, &sres), logs(w1, w2))
	assert.EqualValues(t, 42, sres.GetPid())
	builds, behaviors, err := taskBuilds(ctx, c, workflows.SpawnWorkflowID("ro-spawn"))
	require.NoError(t, err)
	require.NotEmpty(t, builds)
	for i, b := range builds {
		assert.Equal(t, "vmflow/"+v1, b, "spawn workflow task %d", i)
		assert.Equal(t, enumspb.VERSIONING_BEHAVIOR_PINNED, behaviors[i], "spawn workflow task %d", i)
	}

	// The parked delete's next round (its backoff timer) runs on build 2
	// while build 1 is still up: it moved because build 2 is current, not
	// because build 1 went away.
	require.Eventually(t, func() bool {
		builds, _, err := taskBuilds(ctx, c, workflows.DeleteWorkflowID("ro-vm"))
		return err == nil && len(builds) > 0 && builds[len(builds)-1] == "vmflow/"+v2
	}, time.Minute, 200*time.Millisecond, "the parked delete never ran a workflow task on build 2\n%s", logs(w1, w2))
	require.Eventually(t, func() bool {
		last = pinnedOnV1()
		return !strings.Contains(last, workflows.SpawnWorkflowID("ro-spawn"))
	}, time.Minute, 500*time.Millisecond, "the spawn still shows as running on build 1:\n%s", last)
	require.Eventually(t, func() bool {
		builds, _, err := taskBuilds(ctx, c, workflows.DeleteWorkflowID(failLaunch))
		return err == nil && len(builds) > 0 && builds[len(builds)-1] == "vmflow/"+v2
	}, time.Minute, time.Second, "the failed spawn's clean-up delete never ran a workflow task on build 2\n%s", logs(w1, w2))
	require.NoError(t, w1.Stop(), "stop build 1")
	host.failRelease.Store(false)
	var dres vmflowv1.DeleteResult
	require.NoError(t, del.Get(ctx, &dres), logs(w2))
	builds, behaviors, err = taskBuilds(ctx, c, workflows.DeleteWorkflowID("ro-vm"))
	require.NoError(t, err)
	require.NotEmpty(t, builds)
	assert.Equal(t, "vmflow/"+v1, builds[0], "the delete started on build 1")
	assert.Equal(t, "vmflow/"+v2, builds[len(builds)-1], "the delete finished on build 2")
	for i, b := range behaviors {
		assert.Equal(t, enumspb.VERSIONING_BEHAVIOR_AUTO_UPGRADE, b, "delete workflow task %d", i)
	}
	// The failed spawn's clean-up delete started as a child of a Pinned
	// spawn on build 1 (a child inherits its parent's pinned version at
	// start), yet it is AutoUpgrade from its first task and finished on
	// build 2 like any other delete.
	require.NoError(t, c.GetWorkflow(ctx, workflows.DeleteWorkflowID(failLaunch), "").Get(ctx, nil), logs(w2))
	builds, behaviors, err = taskBuilds(ctx, c, workflows.DeleteWorkflowID(failLaunch))
	require.NoError(t, err)
	require.NotEmpty(t, builds)
	assert.Equal(t, "vmflow/"+v1, builds[0], "the clean-up delete started on build 1")
	assert.Equal(t, "vmflow/"+v2, builds[len(builds)-1], "the clean-up delete finished on build 2")
	for i, b := range behaviors {
		assert.Equal(t, enumspb.VERSIONING_BEHAVIOR_AUTO_UPGRADE, b, "clean-up delete workflow task %d", i)
	}
	desc, err := c.DescribeWorkflow(ctx, workflows.DeleteWorkflowID("ro-vm"), "")
	require.NoError(t, err)
	vi := desc.RawResponse.GetWorkflowExecutionInfo().GetVersioningInfo()
	assert.Equal(t, v2, vi.GetDeploymentVersion().GetBuildId())
	assert.Equal(t, enumspb.VERSIONING_BEHAVIOR_AUTO_UPGRADE, vi.GetBehavior())
	st, err := vc.Status(ctx, workflows.DeleteWorkflowID("ro-vm"))
	require.NoError(t, err)
	assert.Equal(t, workflows.StageDeleted, st.GetStage())
	t.Logf("rollout test wall time %s", time.Since(began).Round(time.Millisecond))
}
