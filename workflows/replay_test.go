package workflows

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"
	"google.golang.org/protobuf/proto"

	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
)

// otherFlags are worker settings far from the defaults and from the ones
// any history here was recorded with: a replay must not depend on them
// (workers of one queue may run with different flags during a rollout).
func otherFlags() map[string]Config {
	return map[string]Config{
		"defaults": {},
		"far": {
			ReleaseBackoff: 7 * time.Hour, ReleaseBackoffMax: 9 * time.Hour,
			ScheduleToStartTimeout: 3 * time.Hour,
			UnreachableBackoff:     11 * time.Hour, UnreachableBackoffMax: 13 * time.Hour,
			SpawnHostWait:   17 * time.Hour,
			GracefulTimeout: 19 * time.Minute, GroupExitCap: 23 * time.Minute,
			ActivityTimeoutCap: time.Second,
			DeleteStuckAfter:   29 * time.Hour,
		},
		"near": {
			ReleaseBackoff: time.Millisecond, ReleaseBackoffMax: time.Millisecond,
			ScheduleToStartTimeout: time.Millisecond,
			UnreachableBackoff:     time.Millisecond, UnreachableBackoffMax: time.Millisecond,
			SpawnHostWait: time.Millisecond, DeleteStuckAfter: time.Second,
		},
	}
}

func newReplayer(t *testing.T, cfg Config) worker.WorkflowReplayer {
	t.Helper()
	r, err := worker.NewWorkflowReplayerWithOptions(worker.WorkflowReplayerOptions{DataConverter: platform.DataConverter()})
	require.NoError(t, err)
	New(cfg).Register(r)
	return r
}

// TestReplayRecordedHistories replays histories recorded from real runs on
// the dev server (temporal workflow show --output json) against the current
// workflow code, on workers with different flags: a change that breaks
// determinism, or a flag that decides which commands a workflow issues,
// fails here before it reaches workers with running workflows. Record new
// ones with `temporal workflow show --workflow-id ID --output json >
// testdata/NAME.json` (TestReplayIgnoresWorkerFlags records two with
// VMFLOW_RECORD_HISTORIES=1).
func TestReplayRecordedHistories(t *testing.T) {
	files, err := filepath.Glob("testdata/*.json")
	require.NoError(t, err)
	require.NotEmpty(t, files, "no recorded histories in testdata/")
	for name, cfg := range otherFlags() {
		for _, f := range files {
			t.Run(name+"/"+filepath.Base(f), func(t *testing.T) {
				require.NoError(t, newReplayer(t, cfg).ReplayWorkflowHistoryFromJSONFile(nil, f))
			})
		}
	}
}

// TestReplayIgnoresWorkerFlags runs a spawn and a reconcile whose host never
// answers on a dev-server worker with short limits, until each gives up,
// and replays their histories on workers with other flags. Before the
// limits were recorded (--spawn-host-wait and the ScheduleToStart timeout
// read straight from Config) the replay with longer limits waited where
// the history gave up: a non-determinism error.
func TestReplayIgnoresWorkerFlags(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	const queue = "vmflow-replay-flags"
	w := worker.New(c, queue, worker.Options{})
	New(Config{
		ScheduleToStartTimeout: time.Second,
		UnreachableBackoff:     200 * time.Millisecond, UnreachableBackoffMax: 200 * time.Millisecond,
		SpawnHostWait: 2 * time.Second,
	}).Register(w)
	require.NoError(t, w.Start())
	defer w.Stop()

	// No worker polls gone-host's queue.
	opts := func(id string) client.StartWorkflowOptions {
		return client.StartWorkflowOptions{ID: id, TaskQueue: queue}
	}
	spawn, err := c.ExecuteWorkflow(ctx, opts(SpawnWorkflowID("rv1")), SpawnWorkflow,
		&vmflowv1.SpawnRequest{InstanceId: "rv1", HostId: "gone-host", Vcpus: 1, MemoryMib: 64, Machine: "none"})
	require.NoError(t, err)
	reconcile, err := c.ExecuteWorkflow(ctx, opts("reconcile-vgpu/gone-host-run"), ReconcileWorkflow,
		&vmflowv1.ReconcileVGPURequest{HostId: "gone-host"})
	require.NoError(t, err)

	var ae *temporal.ApplicationError
	err = spawn.Get(ctx, nil)
	require.ErrorAs(t, err, &ae, "the spawn gives up")
	assert.Equal(t, ErrTypeHostUnreachable, ae.Type())
	require.Error(t, reconcile.Get(ctx, nil), "the reconcile gives up")

	for _, run := range []client.WorkflowRun{spawn, reconcile} {
		hist := history(ctx, t, c, run)
		for name, cfg := range otherFlags() {
			t.Run(run.GetID()+"/"+name, func(t *testing.T) {
				// A copy each time: the replayer changes the history it is
				// given, and a second replay of the same one can fail.
				assert.NoError(t, newReplayer(t, cfg).ReplayWorkflowHistory(nil, proto.Clone(hist).(*historypb.History)))
			})
		}
	}
	if os.Getenv("VMFLOW_RECORD_HISTORIES") != "" {
		for file, id := range map[string]string{
			"spawn-host-unreachable-gave-up.json":     spawn.GetID(),
			"reconcile-host-unreachable-gave-up.json": reconcile.GetID(),
		} {
			out, err := srv.CLI(ctx, "workflow", "show", "--workflow-id", id, "--output", "json")
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join("testdata", file), out, 0o644))
		}
	}
}

func history(ctx context.Context, t *testing.T, c client.Client, run client.WorkflowRun) *historypb.History {
	t.Helper()
	it := c.GetWorkflowHistory(ctx, run.GetID(), run.GetRunID(), false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	h := &historypb.History{}
	for it.HasNext() {
		ev, err := it.Next()
		require.NoError(t, err)
		h.Events = append(h.Events, ev)
	}
	return h
}
