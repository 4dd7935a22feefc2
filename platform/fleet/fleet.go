package fleet

import (
	"context"
	"fmt"
	"sort"
	"time"

	commonpb "go.temporal.io/api/common/v1"
	enumspb "go.temporal.io/api/enums/v1"
	workflowpb "go.temporal.io/api/workflow/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/temporal"
	"google.golang.org/protobuf/encoding/protojson"

	"vmflow/internal/contract"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// Publish makes v the published view of its host: it starts the host's
// FleetHost workflow on queue (the workflow worker's) with v as its memo,
// ending the run that held the last view. One billed action (the start;
// the termination is not billed); call it only when the view changed.
func Publish(ctx context.Context, c client.Client, queue string, v *vmflowv1.HostView) error {
	host := v.GetHostId()
	_, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{
		ID:                       workflows.FleetHostWorkflowID(host),
		TaskQueue:                queue,
		WorkflowIDConflictPolicy: enumspb.WORKFLOW_ID_CONFLICT_POLICY_TERMINATE_EXISTING,
		WorkflowIDReusePolicy:    enumspb.WORKFLOW_ID_REUSE_POLICY_ALLOW_DUPLICATE,
		Memo:                     map[string]any{workflows.FleetViewMemo: v},
		TypedSearchAttributes:    temporal.NewSearchAttributes(workflows.SAHostID.ValueSet(host)),
		StaticSummary:            "fleet view of host " + host,
	}, workflows.FleetHostWorkflow, &vmflowv1.HostView{HostId: host, PublishedAt: v.GetPublishedAt()})
	if err != nil {
		return fmt.Errorf("publish the fleet view of %s: %w", host, err)
	}
	return nil
}

var lenient = protojson.UnmarshalOptions{DiscardUnknown: true}

// HandoverGrace is how long a FleetHost run ended by its host's next
// publish still stands for that host's view in a read. Visibility writes
// the ended run's close and the new run's start as two records, in
// either order: between them the host would vanish from a read of the
// running runs alone, and a spawn placed then fail NoFleetCapacity on a
// fleet with room (seen: 1 of 30 spawns, one host missing). The cost: a
// host retired by terminating its run is offered for this long after.
const HandoverGrace = 10 * time.Second

// viewQuery lists the FleetHost workflows of the hosts whose agents
// publish to queue (one fleet; several may share a namespace): the
// running ones, and those closed after closedAfter (a handover's ended
// run while its replacement is not yet visible).
func viewQuery(queue string, closedAfter time.Time) string {
	return fmt.Sprintf("WorkflowType = '%s' AND TaskQueue = '%s' AND (ExecutionStatus = 'Running' OR CloseTime > '%s')",
		workflows.FleetHostWorkflow, queue, closedAfter.UTC().Format(time.RFC3339Nano))
}

// maxHosts bounds a read (pages of 1,000).
const maxHosts = 10000

// Read lists the published view of every host of the fleet of queue (the
// workflow task queue its agents publish to; "" is "vmflow") from
// visibility (no billed action), one per host: its latest run's, running
// or ended within HandoverGrace (a publish under way). Sorted by host id.
func Read(ctx context.Context, c client.Client, queue string) ([]*vmflowv1.HostView, error) {
	return ReadAt(ctx, c, queue, time.Now())
}

// ReadAt is Read as of now: a run ended before now less HandoverGrace
// offers nothing (tests step past the grace without waiting it out).
func ReadAt(ctx context.Context, c client.Client, queue string, now time.Time) ([]*vmflowv1.HostView, error) {
	if queue == "" {
		queue = workflows.DefaultTaskQueue
	}
	if !validQueue(queue) {
		return nil, fmt.Errorf("read the fleet view: task queue %q: only letters, digits, '-', '_' and '.'", queue)
	}
	type seen struct {
		v     *vmflowv1.HostView
		start time.Time
	}
	byHost := map[string]seen{}
	var token []byte
	for n := 0; n < maxHosts; {
		resp, err := c.ListWorkflow(ctx, &workflowservice.ListWorkflowExecutionsRequest{Query: viewQuery(queue, now.Add(-HandoverGrace)), PageSize: 1000, NextPageToken: token})
		if err != nil {
			return nil, fmt.Errorf("read the fleet view: %w", err)
		}
		for _, e := range resp.GetExecutions() {
			n++
			p := e.GetMemo().GetFields()[workflows.FleetViewMemo]
			if p == nil {
				continue
			}
			v := &vmflowv1.HostView{}
			// Leniently: an agent of a newer build may publish fields
			// this one does not know, and its host stays offered.
			if err := lenient.Unmarshal(p.GetData(), v); err != nil || !workflows.ValidID(v.GetHostId()) {
				continue // not a view at all: that host is not offered
			}
			start := e.GetStartTime().AsTime()
			if have, ok := byHost[v.GetHostId()]; !ok || start.After(have.start) {
				byHost[v.GetHostId()] = seen{v, start}
			}
		}
		if token = resp.GetNextPageToken(); len(token) == 0 {
			break
		}
	}
	out := make([]*vmflowv1.HostView, 0, len(byHost))
	for _, s := range byHost {
		out = append(out, s.v)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetHostId() < out[j].GetHostId() })
	return out, nil
}

// validQueue keeps a queue name from breaking out of the query's quotes.
func validQueue(q string) bool {
	for _, r := range q {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return false
		}
	}
	return q != ""
}

// Live reports whether host's task queue has an activity poller: its agent
// runs (or stopped within the server's poller memory, minutes: the
// grant's short ScheduleToStart covers that).
func Live(ctx context.Context, c client.Client, host string) (bool, error) {
	resp, err := c.DescribeTaskQueue(ctx, workflows.HostTaskQueue(host), enumspb.TASK_QUEUE_TYPE_ACTIVITY)
	if err != nil {
		return false, fmt.Errorf("describe %s: %w", workflows.HostTaskQueue(host), err)
	}
	return len(resp.GetPollers()) > 0, nil
}

// run is one workflow execution as a lookup needs it.
type run struct {
	runID  string
	start  time.Time
	host   string
	status enumspb.WorkflowExecutionStatus
}

// runs lists the executions of workflow id (made from a valid instance
// id: no quote can end the query's string), newest first.
func runs(ctx context.Context, c client.Client, id string) ([]run, error) {
	resp, err := c.ListWorkflow(ctx, &workflowservice.ListWorkflowExecutionsRequest{
		Query: fmt.Sprintf("WorkflowId = '%s'", id), PageSize: 100})
	if err != nil {
		return nil, fmt.Errorf("list the runs of %s: %w", id, err)
	}
	var out []run
	for _, e := range resp.GetExecutions() {
		out = append(out, run{runID: e.GetExecution().GetRunId(), start: e.GetStartTime().AsTime(), host: hostOf(e), status: e.GetStatus()})
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].start.After(out[j].start) })
	return out, nil
}

// hostOf is an execution's VmHostId, "" when unset.
func hostOf(e *workflowpb.WorkflowExecutionInfo) string {
	return keyword(e.GetSearchAttributes(), workflows.SAHostID.GetName())
}

func keyword(sa *commonpb.SearchAttributes, name string) string {
	p := sa.GetIndexedFields()[name]
	if p == nil {
		return ""
	}
	var s string
	if err := converter.GetDefaultDataConverter().FromPayload(p, &s); err != nil {
		return ""
	}
	return s
}

// InstanceHost is the host the instance's latest placed spawn names
// (VmHostId), or placing when its latest spawn is still choosing one.
func InstanceHost(ctx context.Context, c client.Client, instanceID string) (host string, placing bool, err error) {
	if !workflows.ValidID(instanceID) {
		return "", false, fmt.Errorf("instance_id %q: must match %s", instanceID, contract.IDPattern)
	}
	rs, err := runs(ctx, c, workflows.SpawnWorkflowID(instanceID))
	if err != nil {
		return "", false, err
	}
	for i, r := range rs {
		if r.host != "" {
			return r.host, false, nil
		}
		if i == 0 && r.status == enumspb.WORKFLOW_EXECUTION_STATUS_RUNNING {
			return "", true, nil
		}
	}
	return "", false, nil
}

// previousHost is the host an earlier spawn of the instance (not run
// self) was placed on, when no delete of the instance completed since:
// its record may be there, and a placement elsewhere would make a second
// instance of one id.
func previousHost(ctx context.Context, c client.Client, instanceID, self string) (string, error) {
	if !workflows.ValidID(instanceID) {
		return "", fmt.Errorf("instance_id %q: must match %s", instanceID, contract.IDPattern)
	}
	rs, err := runs(ctx, c, workflows.SpawnWorkflowID(instanceID))
	if err != nil {
		return "", err
	}
	var prev *run
	for i := range rs {
		if rs[i].runID != self && rs[i].host != "" {
			prev = &rs[i]
			break
		}
	}
	if prev == nil {
		return "", nil
	}
	ds, err := runs(ctx, c, workflows.DeleteWorkflowID(instanceID))
	if err != nil {
		return "", err
	}
	for _, d := range ds {
		if d.status == enumspb.WORKFLOW_EXECUTION_STATUS_COMPLETED && d.start.After(prev.start) {
			return "", nil
		}
	}
	return prev.host, nil
}
