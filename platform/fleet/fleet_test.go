package fleet_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"

	"vmflow/platform"
	"vmflow/platform/fleet"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
	"vmflow/workflows"
)

// fakeHost answers the host activities a placed spawn and a delete use;
// full refuses every grant NoHostCapacity. It keeps records by instance.
type fakeHost struct {
	id   string
	full bool
	mu   sync.Mutex
	recs map[string]string // instance → creator run
	log  []string          // "Activity instance" as they ran
}

func (f *fakeHost) note(ctx context.Context, id string) {
	f.log = append(f.log, activity.GetInfo(ctx).ActivityType.Name+" "+id)
}

func (f *fakeHost) ValidateSpawn(ctx context.Context, r *vmflowv1.SpawnRequest) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.note(ctx, r.GetInstanceId())
	return nil
}

func (f *fakeHost) CreateRecord(ctx context.Context, r *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.note(ctx, r.GetInstanceId())
	if r.GetHostId() != f.id {
		return nil, temporal.NewNonRetryableApplicationError("host_id "+r.GetHostId()+" is not "+f.id, workflows.ErrTypeInvalidInput, nil)
	}
	run := activity.GetInfo(ctx).WorkflowExecution.RunID
	if creator, ok := f.recs[r.GetInstanceId()]; ok {
		return &vmflowv1.CreateRecordResult{AlreadyExisted: true, CreatedByThisSpawn: creator == run, CreatedBy: creator}, nil
	}
	if f.full {
		return nil, temporal.NewApplicationError("no room on "+f.id, workflows.ErrTypeNoHostCapacity)
	}
	f.recs[r.GetInstanceId()] = run
	return &vmflowv1.CreateRecordResult{InstanceUuid: "u-" + r.GetInstanceId(), CreatedByThisSpawn: true}, nil
}

func (f *fakeHost) LaunchVM(ctx context.Context, r *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.note(ctx, r.GetInstanceId())
	return &vmflowv1.LaunchVMResult{Pid: 42, AlreadyRunning: r.GetExistingOnly()}, nil
}

func (f *fakeHost) BeginDelete(ctx context.Context, r *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.note(ctx, r.GetInstanceId())
	if _, ok := f.recs[r.GetInstanceId()]; !ok {
		return &vmflowv1.BeginDeleteResult{AlreadyAbsent: true}, nil
	}
	return &vmflowv1.BeginDeleteResult{}, nil
}

func (f *fakeHost) StopVM(ctx context.Context, r *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	return &vmflowv1.StopVMResult{StepReached: "quit"}, nil
}
func (f *fakeHost) WaitVMExit(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (f *fakeHost) ReleaseLeases(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	return &vmflowv1.ReleaseVGPUResult{}, nil
}
func (f *fakeHost) TearDown(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (f *fakeHost) DeleteRecord(ctx context.Context, r *vmflowv1.InstanceRef) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.note(ctx, r.GetInstanceId())
	delete(f.recs, r.GetInstanceId())
	return nil
}

func (f *fakeHost) ran(what string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, l := range f.log {
		if l == what {
			return true
		}
	}
	return false
}

func hostIDs(vs []*vmflowv1.HostView) []string {
	var ids []string
	for _, v := range vs {
		ids = append(ids, v.GetHostId())
	}
	return ids
}

func hostView(id string, free uint32, at time.Time) *vmflowv1.HostView {
	return &vmflowv1.HostView{HostId: id, PublishedAt: at.UTC().Format(time.RFC3339Nano), Kvm: true, VcpusTotal: 16, VcpusFree: free,
		MemoryTotalMib: 65536, MemoryFreeMib: 65536, PinnedMemoryFreeMib: 65536, VmOverheadMib: 256}
}

// TestPlacementOnAServer: on a dev server, with the real worker's
// workflows and placer and fake hosts: the views are read from
// visibility (the latest per host, one fleet per task queue), a host with
// no poller is not asked, a refusal moves the spawn on, VmHostId is found
// by a delete without a host, an instance's earlier host is reused until
// a delete completes; every history replays on a worker with other flags
// (VMFLOW_RECORD_HISTORIES=1 writes them to workflows/testdata).
func TestPlacementOnAServer(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const queue = "fleet-it"
	w := worker.New(c, queue, worker.Options{})
	workflows.New(workflows.Config{ScheduleToStartTimeout: 5 * time.Second, PlacementScheduleToStart: 2 * time.Second}).Register(w)
	(&fleet.Placer{Client: c}).Register(w)
	require.NoError(t, w.Start())
	defer w.Stop()
	hosts := map[string]*fakeHost{"h1": {id: "h1"}, "h2": {id: "h2", full: true}}
	for id, h := range hosts {
		h.recs = map[string]string{}
		hw := worker.New(c, workflows.HostTaskQueue(id), worker.Options{})
		workflows.RegisterHostActivities(hw, h)
		require.NoError(t, hw.Start())
		defer hw.Stop()
	}
	now := time.Now()
	// h2 looks best (most room) and refuses; h3 has no agent; h1 grants.
	// Another fleet's host shares the namespace and is never offered.
	require.NoError(t, fleet.Publish(ctx, c, queue, hostView("h1", 4, now.Add(-time.Hour))))
	require.NoError(t, fleet.Publish(ctx, c, queue, hostView("h1", 6, now)))
	require.NoError(t, fleet.Publish(ctx, c, queue, hostView("h2", 12, now)))
	require.NoError(t, fleet.Publish(ctx, c, queue, hostView("h3", 16, now)))
	require.NoError(t, fleet.Publish(ctx, c, "other-fleet", hostView("x9", 16, now)))
	var views []*vmflowv1.HostView
	require.Eventually(t, func() bool {
		var err error
		views, err = fleet.Read(ctx, c, queue)
		return err == nil && len(views) == 3 && views[0].GetVcpusFree() == 6
	}, 30*time.Second, 100*time.Millisecond, "the three views of the fleet, h1's latest: %v", views)
	live, err := fleet.Live(ctx, c, "h3")
	require.NoError(t, err)
	assert.False(t, live, "no agent polls h3")

	// A run ended by its host's next publish stands for the host until
	// the replacement shows (visibility writes the two apart); one ended
	// longer than HandoverGrace ago (a host retired) is not offered.
	require.NoError(t, fleet.Publish(ctx, c, queue, hostView("h4", 16, now)))
	require.Eventually(t, func() bool {
		views, err := fleet.Read(ctx, c, queue)
		return err == nil && len(views) == 4
	}, 30*time.Second, 100*time.Millisecond, "h4's view")
	require.NoError(t, c.TerminateWorkflow(ctx, workflows.FleetHostWorkflowID("h4"), "", "a publish under way: its replacement not yet visible"))
	require.Eventually(t, func() bool {
		n, err := c.CountWorkflow(ctx, &workflowservice.CountWorkflowExecutionsRequest{
			Query: "WorkflowId = '" + workflows.FleetHostWorkflowID("h4") + "' AND ExecutionStatus = 'Terminated'"})
		return err == nil && n.GetCount() == 1
	}, 30*time.Second, 100*time.Millisecond, "h4's run ended, as visibility sees it")
	views, err = fleet.Read(ctx, c, queue)
	require.NoError(t, err)
	assert.Equal(t, []string{"h1", "h2", "h3", "h4"}, hostIDs(views), "h4's ended run stands until its replacement shows")
	views, err = fleet.ReadAt(ctx, c, queue, time.Now().Add(fleet.HandoverGrace+time.Second))
	require.NoError(t, err)
	assert.Equal(t, []string{"h1", "h2", "h3"}, hostIDs(views), "an ended run past the grace offers nothing")
	assert.Equal(t, uint32(6), views[0].GetVcpusFree(), "h1's latest view, its earlier run ended too")

	vc := workflows.NewClient(c, queue)
	spawn := func(id string) (client.WorkflowRun, *vmflowv1.SpawnResult) {
		run, err := vc.StartSpawn(ctx, &vmflowv1.SpawnRequest{InstanceId: id, Vcpus: 1, MemoryMib: 64, Machine: "none"})
		require.NoError(t, err)
		var res vmflowv1.SpawnResult
		require.NoError(t, run.Get(ctx, &res), id)
		return run, &res
	}
	placed, res := spawn("fv1")
	assert.Equal(t, "h1", res.GetHostId())
	st, err := vc.Status(ctx, workflows.SpawnWorkflowID("fv1"))
	require.NoError(t, err)
	require.Len(t, st.GetHostsTried(), 1, "h3 (no poller) is not asked: %v", st.GetHostsTried())
	assert.Contains(t, st.GetHostsTried()[0], "h2: NoHostCapacity")
	assert.False(t, hosts["h1"].ran("ValidateSpawn fv1"), "the grant is the host's admission")

	require.Eventually(t, func() bool {
		host, placing, err := fleet.InstanceHost(ctx, c, "fv1")
		return err == nil && host == "h1" && !placing
	}, 30*time.Second, 100*time.Millisecond, "VmHostId of the placed spawn")

	// A second spawn of fv1 while its record is there goes to h1 as if
	// named: it finds the first spawn's VM.
	again, res := spawn("fv1")
	assert.Equal(t, "h1", res.GetHostId())
	assert.True(t, hosts["h1"].ran(workflows.ActivityPrepareSpawn+" fv1"), "the earlier host, as if named")

	del, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: "fv1", GracefulTimeoutSeconds: 1})
	require.NoError(t, err)
	var dres vmflowv1.DeleteResult
	require.NoError(t, del.Get(ctx, &dres))
	assert.False(t, dres.GetAlreadyAbsent())
	assert.True(t, hosts["h1"].ran(workflows.ActivityRemoveInstance+" fv1"), "the delete found fv1's host")

	// After that delete, fv1 is placed afresh; an instance never spawned
	// is already absent.
	require.Eventually(t, func() bool {
		d, err := c.DescribeWorkflow(ctx, workflows.DeleteWorkflowID("fv1"), "")
		return err == nil && d.RawResponse.GetWorkflowExecutionInfo().GetStatus() == enumspb.WORKFLOW_EXECUTION_STATUS_COMPLETED
	}, 30*time.Second, 100*time.Millisecond)
	absent, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: "fv-never"})
	require.NoError(t, err)
	require.NoError(t, absent.Get(ctx, &dres))
	assert.True(t, dres.GetAlreadyAbsent())

	replayer, err := worker.NewWorkflowReplayerWithOptions(worker.WorkflowReplayerOptions{DataConverter: platform.DataConverter()})
	require.NoError(t, err)
	workflows.New(workflows.Config{ScheduleToStartTimeout: 3 * time.Hour, PlacementScheduleToStart: time.Hour, PlacementCandidates: 1, SpawnHostWait: time.Hour}).Register(replayer)
	runs := map[string]client.WorkflowRun{"spawn-placed.json": placed, "spawn-placed-again.json": again, "delete-host-found.json": del, "delete-host-none.json": absent}
	for file, run := range runs {
		events, err := devserver.History(ctx, c, run.GetID(), run.GetRunID())
		require.NoError(t, err)
		assert.NoError(t, replayer.ReplayWorkflowHistory(nil, &historypb.History{Events: events}), file)
		if os.Getenv("VMFLOW_RECORD_HISTORIES") != "" {
			out, err := srv.CLI(ctx, "workflow", "show", "--workflow-id", run.GetID(), "--run-id", run.GetRunID(), "--output", "json")
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join("..", "..", "workflows", "testdata", file), out, 0o644))
		}
	}
	assert.False(t, strings.Contains(strings.Join(hosts["h2"].log, " "), "LaunchVM"), "nothing ran on the host that refused")
}
