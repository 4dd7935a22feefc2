package workflows

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
)

// visible is what an operator's visibility query sees of one workflow: its
// search attributes as the server holds them.
type visible struct {
	stage, instance, host string
	needs                 bool
}

func searchAttrs(ctx context.Context, t *testing.T, c client.Client, id string) visible {
	t.Helper()
	d, err := c.DescribeWorkflow(ctx, id, "")
	require.NoError(t, err)
	f := d.RawResponse.GetWorkflowExecutionInfo().GetSearchAttributes().GetIndexedFields()
	var v visible
	decode := func(p *commonpb.Payload, into any) {
		if p != nil {
			require.NoError(t, converter.GetDefaultDataConverter().FromPayload(p, into))
		}
	}
	decode(f[SAStage.GetName()], &v.stage)
	decode(f[SAInstanceID.GetName()], &v.instance)
	decode(f[SAHostID.GetName()], &v.host)
	decode(f[SANeedsAttention.GetName()], &v.needs)
	return v
}

// settledActions reads the server's action counter once it holds still:
// the server exports it on a reporting interval, behind the calls.
func settledActions(ctx context.Context, t *testing.T, srv *devserver.Server) map[string]float64 {
	t.Helper()
	var cur map[string]float64
	require.Eventually(t, func() bool {
		prev := cur
		var err error
		cur, err = srv.Actions(ctx, srv.Namespace())
		require.NoError(t, err)
		return prev != nil && maps.Equal(prev, cur)
	}, time.Minute, 2*time.Second, "the server's action counter never held still")
	return cur
}

// pairCost is what a spawn and its clean delete cost: billed actions counted
// from both histories, by kind, and the server's action counter's increase,
// by type.
type pairCost struct {
	history map[string]int
	server  map[string]float64
}

func sum(m map[string]float64) float64 {
	n := 0.0
	for _, v := range m {
		n += v
	}
	return n
}

// spawnDeleteCost spawns instance id with a vGPU on host through vc,
// deletes it, and counts what the two cost. srv must count actions
// (Options.Metrics), and nothing else may run in its namespace meanwhile.
func spawnDeleteCost(ctx context.Context, t *testing.T, srv *devserver.Server, c client.Client, vc *Client, id, host string) pairCost {
	t.Helper()
	before := settledActions(ctx, t, srv)
	req := &vmflowv1.SpawnRequest{InstanceId: id, HostId: host, Vcpus: 1, MemoryMib: 64, Machine: "none", VgpuProfile: "p"}
	run, err := vc.StartSpawn(ctx, req)
	require.NoError(t, err)
	require.NoError(t, run.Get(ctx, nil))
	del, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: id, HostId: host})
	require.NoError(t, err)
	require.NoError(t, del.Get(ctx, nil))
	// The server's counter is exported on a reporting interval: wait until
	// it shows both starts and then holds still.
	var after map[string]float64
	require.Eventually(t, func() bool {
		prev := after
		after, err = srv.Actions(ctx, srv.Namespace())
		require.NoError(t, err)
		return after["grpc_StartWorkflowExecution"]-before["grpc_StartWorkflowExecution"] >= 2 && maps.Equal(prev, after)
	}, time.Minute, 2*time.Second, "the server's action counter never showed both starts")

	cost := pairCost{history: map[string]int{}, server: map[string]float64{}}
	for _, wid := range []string{SpawnWorkflowID(id), DeleteWorkflowID(id)} {
		events, err := devserver.History(ctx, c, wid, "")
		require.NoError(t, err)
		for k, n := range devserver.BilledActions(events) {
			cost.history[k] += n
		}
	}
	for typ, v := range after {
		if d := v - before[typ]; d > 0 {
			cost.server[typ] = d
		}
	}
	return cost
}

// TestSpawnDeleteActions runs a spawn with a vGPU and a clean delete with
// the real workflows on a dev server (host activities stubbed) and counts
// their billed actions from the histories, with the server's own `action`
// counter beside them. Before lazy search attributes (one upsert per stage
// change) the pair cost 27 billed actions; then 15 (the client sets the
// first upsert's values at start, which is not billed); with the combined
// activities 10 (13 on the server's counter). It also checks
// that what a visibility query sees is exact where it must be: at the end,
// and while a delete waits in release-failed.
func TestSpawnDeleteActions(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{Metrics: true})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	const queue = "vmflow-actions-test"
	host := &scriptedHost{}
	vc := startStack(t, c, queue, Config{ReleaseBackoff: time.Hour, ReleaseBackoffMax: time.Hour}, "h1", host)

	cost := spawnDeleteCost(ctx, t, srv, c, vc, "vm1", "h1")
	total := devserver.Sum(cost.history)
	t.Logf("spawn (vGPU) + clean delete: %d billed actions from histories %v, %.0f on the server's action counter %v (namespace %s)",
		total, cost.history, sum(cost.server), cost.server, srv.Namespace())
	// Issue 36's goal, 15 by the server's counter with a real agent, less
	// the agent's two fleet-view publishes (one per change of its offer):
	// 13. Before the combined activities: 15 billed, 18 counted.
	assert.LessOrEqual(t, total, 10, "billed actions of a spawn plus a clean delete")
	assert.LessOrEqual(t, sum(cost.server), 13.0, "the server's action counter for a spawn plus a clean delete")

	want := visible{stage: StageRunning, instance: "vm1", host: "h1"}
	assert.Equal(t, want, searchAttrs(ctx, t, c, SpawnWorkflowID("vm1")), "a finished spawn")
	want.stage = StageDeleted
	assert.Equal(t, want, searchAttrs(ctx, t, c, DeleteWorkflowID("vm1")), "a finished delete")

	// A delete that waits in release-failed shows it, with needs-attention,
	// until a retry lets it finish.
	host.failRelease.Store(true)
	del2, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: "vm2", HostId: "h1"})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st, err := vc.Status(ctx, DeleteWorkflowID("vm2"))
		return err == nil && st.GetStage() == StageReleaseFailed
	}, time.Minute, 100*time.Millisecond, "delete never reached release-failed")
	assert.Equal(t, visible{stage: StageReleaseFailed, instance: "vm2", host: "h1", needs: true},
		searchAttrs(ctx, t, c, DeleteWorkflowID("vm2")), "a delete waiting in release-failed")
	host.failRelease.Store(false)
	_, err = vc.Retry(ctx, DeleteWorkflowID("vm2"), "test: fault cleared")
	require.NoError(t, err)
	require.NoError(t, del2.Get(ctx, nil))
	assert.Equal(t, visible{stage: StageDeleted, instance: "vm2", host: "h1"},
		searchAttrs(ctx, t, c, DeleteWorkflowID("vm2")), "a delete finished after release-failed")
	events, err := devserver.History(ctx, c, DeleteWorkflowID("vm2"), "")
	require.NoError(t, err)
	n := devserver.BilledActions(events)
	t.Logf("delete with one failed release round: %d billed actions: %v", devserver.Sum(n), n)
	if os.Getenv("VMFLOW_RECORD_HISTORIES") != "" {
		// Histories of the combined activities' path, for
		// TestReplayRecordedHistories (those of the lazy path before it,
		// *-lazy-sa.json, stay as recorded then).
		for file, id := range map[string]string{
			"spawn-vgpu-combined.json":                       SpawnWorkflowID("vm1"),
			"delete-combined.json":                           DeleteWorkflowID("vm1"),
			"delete-release-failed-then-retry-combined.json": DeleteWorkflowID("vm2"),
		} {
			out, err := srv.CLI(ctx, "workflow", "show", "--workflow-id", id, "--output", "json")
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join("testdata", file), out, 0o644))
		}
	}
}

// reconcilingHost is scriptedHost whose reconcile releases the claim of
// every delete in wake (what the agent's round does for a deleting
// instance whose VM is gone).
type reconcilingHost struct {
	scriptedHost
	wake []string
}

func (h *reconcilingHost) ReconcileHost(context.Context, *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	h.failRelease.Store(false)
	return &vmflowv1.ReconcileVGPUResult{ClaimsReleased: uint32(len(h.wake)), RetriedDeletes: h.wake}, nil
}

// TestTriggeredReconcileActions: one ReconcileVGPU run started by its
// Schedule (as the agent's scan triggers it) costs a handful of billed
// actions, counted from its history with the server's counter beside, and
// still wakes a delete waiting in release-failed whose claim it released.
func TestTriggeredReconcileActions(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{Metrics: true})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const queue = "vmflow-reconcile-actions-test"
	host := &reconcilingHost{wake: []string{"vm3"}}
	vc := startStack(t, c, queue, Config{ReleaseBackoff: time.Hour, ReleaseBackoffMax: time.Hour}, "h1", host)

	host.failRelease.Store(true)
	del, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: "vm3", HostId: "h1"})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st, err := vc.Status(ctx, DeleteWorkflowID("vm3"))
		return err == nil && st.GetStage() == StageReleaseFailed
	}, time.Minute, 100*time.Millisecond, "delete never reached release-failed")

	id := ReconcileScheduleID("h1")
	sched, err := c.ScheduleClient().Create(ctx, client.ScheduleOptions{
		ID:     id,
		Spec:   client.ScheduleSpec{Intervals: []client.ScheduleIntervalSpec{{Every: 24 * time.Hour}}},
		Paused: true, // only the trigger starts a run here
		Action: &client.ScheduleWorkflowAction{
			ID: id, Workflow: ReconcileWorkflow, TaskQueue: queue,
			Args: []any{&vmflowv1.ReconcileVGPURequest{HostId: "h1"}},
		},
	})
	require.NoError(t, err)
	before := settledActions(ctx, t, srv)
	require.NoError(t, sched.Trigger(ctx, client.ScheduleTriggerOptions{}))
	done, cancelDone := context.WithTimeout(ctx, 30*time.Second)
	defer cancelDone()
	require.NoError(t, del.Get(done, nil), "the reconcile woke the delete waiting out its hour")

	var runID string
	require.Eventually(t, func() bool {
		d, err := sched.Describe(ctx)
		require.NoError(t, err)
		if len(d.Info.RecentActions) == 0 {
			return false
		}
		res := d.Info.RecentActions[0].StartWorkflowResult
		runID = res.WorkflowID
		r, err := c.DescribeWorkflow(ctx, res.WorkflowID, res.FirstExecutionRunID)
		return err == nil && r.WorkflowCloseTime != nil
	}, time.Minute, 200*time.Millisecond, "the triggered reconcile never finished")
	events, err := devserver.History(ctx, c, runID, "")
	require.NoError(t, err)
	n := devserver.BilledActions(events)
	t.Logf("triggered ReconcileVGPU run: %d billed actions from its history: %v", devserver.Sum(n), n)
	assert.Equal(t, visible{stage: StageReconciled, host: "h1"}, searchAttrs(ctx, t, c, runID), "a finished reconcile")
	assert.LessOrEqual(t, devserver.Sum(n), 5, "a reconcile run: schedule action, start, activity, two upserts")
	if os.Getenv("VMFLOW_RECORD_HISTORIES") != "" {
		out, err := srv.CLI(ctx, "workflow", "show", "--workflow-id", runID, "--output", "json")
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join("testdata", "reconcile-woke-delete-lazy-sa.json"), out, 0o644))
	}

	var after map[string]float64
	require.Eventually(t, func() bool {
		prev := after
		after, err = srv.Actions(ctx, srv.Namespace())
		require.NoError(t, err)
		return after["grpc_StartWorkflowExecution"]+after["schedule_action"] > before["grpc_StartWorkflowExecution"]+before["schedule_action"] && maps.Equal(prev, after)
	}, time.Minute, 2*time.Second, "the server's action counter never moved")
	for typ, v := range after {
		if d := v - before[typ]; d > 0 {
			t.Logf("server action counter during the reconcile (and the delete it woke): %s +%.0f", typ, d)
		}
	}
}
