package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	commonpb "go.temporal.io/api/common/v1"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/metrics"
	"vmflow/hostagent/network"
	"vmflow/hostagent/store"
	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// reconcileSchedule is the Schedule this build wants for the host: ReconcileVGPU
// every cfg.ReconcileEvery, skipping a run while one is going.
func reconcileSchedule(cfg Config) client.ScheduleOptions {
	id := workflows.ReconcileScheduleID(cfg.HostID)
	return client.ScheduleOptions{
		ID:      id,
		Spec:    client.ScheduleSpec{Intervals: []client.ScheduleIntervalSpec{{Every: cfg.ReconcileEvery}}},
		Overlap: enumspb.SCHEDULE_OVERLAP_POLICY_SKIP,
		// No execution, run or retry limit: a round ends by its own retries
		// (about 20 minutes with default flags), and a shorter limit could cut
		// it after it released claims and before it woke their deletes.
		Action: &client.ScheduleWorkflowAction{
			ID:        id,
			Workflow:  workflows.ReconcileWorkflow,
			Args:      []any{&vmflowv1.ReconcileVGPURequest{HostId: cfg.HostID}},
			TaskQueue: cfg.TaskQueue,
		},
	}
}

// ensureReconcileSchedule creates the host's reconcile Schedule, or updates
// one that differs in anything this build sets, keeping its state (an
// operator's pause and note); a matching one costs no action.
func ensureReconcileSchedule(ctx context.Context, c client.Client, cfg Config, log *zap.Logger) error {
	want := reconcileSchedule(cfg)
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err := c.ScheduleClient().Create(cctx, want)
	if err == nil {
		return nil
	}
	if !errors.Is(err, temporal.ErrScheduleAlreadyRunning) {
		return fmt.Errorf("create schedule %s: %w", want.ID, err)
	}
	h := c.ScheduleClient().GetHandle(cctx, want.ID)
	d, err := h.Describe(cctx)
	if err != nil {
		return fmt.Errorf("describe schedule %s: %w", want.ID, err)
	}
	diff := scheduleDiff(&d.Schedule, want)
	if len(diff) == 0 {
		return nil
	}
	err = h.Update(cctx, client.ScheduleUpdateOptions{
		DoUpdate: func(in client.ScheduleUpdateInput) (*client.ScheduleUpdate, error) {
			s := in.Description.Schedule
			s.Spec, s.Action = &want.Spec, want.Action
			if s.Policy == nil {
				s.Policy = &client.SchedulePolicies{}
			}
			s.Policy.Overlap = want.Overlap
			return &client.ScheduleUpdate{Schedule: &s}, nil
		},
	})
	if err != nil {
		return fmt.Errorf("update schedule %s (%v): %w", want.ID, diff, err)
	}
	log.Info("reconcile schedule updated to this build's", zap.String("schedule_id", want.ID), zap.Strings("changed", diff),
		zap.Duration("every", cfg.ReconcileEvery))
	return nil
}

// scheduleDiff names what of have differs from want (empty: nothing).
func scheduleDiff(have *client.Schedule, want client.ScheduleOptions) []string {
	var diff []string
	add := func(differs bool, what string) {
		if differs {
			diff = append(diff, what)
		}
	}
	add(!hasOnlyInterval(have.Spec, want.Spec.Intervals[0].Every), "interval")
	add(have.Policy == nil || have.Policy.Overlap != want.Overlap, "overlap")
	a, ok := have.Action.(*client.ScheduleWorkflowAction)
	if !ok {
		return append(diff, "action")
	}
	w := want.Action.(*client.ScheduleWorkflowAction)
	add(a.ID != w.ID, "workflow_id")
	add(a.Workflow != w.Workflow, "workflow_type")
	add(a.TaskQueue != w.TaskQueue, "task_queue")
	add(!sameArgs(a.Args, w.Args), "args")
	add(a.WorkflowExecutionTimeout != w.WorkflowExecutionTimeout || a.WorkflowRunTimeout != w.WorkflowRunTimeout ||
		// The server fills in its default task timeout (10 s).
		(a.WorkflowTaskTimeout != w.WorkflowTaskTimeout && a.WorkflowTaskTimeout != 10*time.Second), "timeouts")
	add(a.RetryPolicy != nil, "retry_policy")
	add(len(a.Memo) > 0 || a.TypedSearchAttributes.Size() > 0 || len(a.UntypedSearchAttributes) > 0, "memo_or_search_attributes")
	return diff
}

// hasOnlyInterval says whether spec runs exactly every d and nothing else.
func hasOnlyInterval(spec *client.ScheduleSpec, d time.Duration) bool {
	return spec != nil && len(spec.Intervals) == 1 && spec.Intervals[0].Every == d && spec.Intervals[0].Offset == 0 &&
		len(spec.Calendars) == 0 && len(spec.CronExpressions) == 0 && len(spec.Skip) == 0 &&
		spec.Jitter == 0 && spec.StartAt.IsZero() && spec.EndAt.IsZero()
}

// sameArgs: have, the payloads a Describe returns, decode to want's
// messages.
func sameArgs(have, want []any) bool {
	if len(have) != len(want) {
		return false
	}
	for i := range want {
		p, ok := have[i].(*commonpb.Payload)
		w, isMsg := want[i].(proto.Message)
		if !ok || !isMsg {
			return false
		}
		got := w.ProtoReflect().New().Interface()
		if err := platform.DataConverter().FromPayload(p, got); err != nil || !proto.Equal(got, w) {
			return false
		}
	}
	return true
}

// triggerReconcile starts a ReconcileVGPU run of the host's schedule now
// (one schedule action and the run's own actions), unless one is running.
func triggerReconcile(ctx context.Context, c client.Client, scheduleID string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err := c.ScheduleClient().GetHandle(ctx, scheduleID).Trigger(ctx, client.ScheduleTriggerOptions{
		Overlap: enumspb.SCHEDULE_OVERLAP_POLICY_SKIP,
	})
	if err != nil {
		return fmt.Errorf("trigger schedule %s: %w", scheduleID, err)
	}
	return nil
}

// scanForReconcile runs the free read-only scan every `every` and triggers a
// reconcile round for work two scans in a row found, backing off to `safety`
// for the same work; a failed scan is retried next tick. Each orphan is
// counted in am (when set) at the first scan that finds it.
func scanForReconcile(ctx context.Context, scan func(context.Context) (lease.Work, error), every, safety time.Duration,
	trigger func(context.Context) error, am *metrics.Agent, log *zap.Logger) {
	gate := &lease.Gate{Min: every, Max: safety}
	var prev lease.Work
	eachRound(ctx, every, func(rctx context.Context) {
		cur, err := scan(rctx)
		if err != nil {
			log.Warn("reconcile scan failed; the schedule still runs", zap.Error(err))
			return
		}
		due := lease.Due(prev, cur)
		if am != nil {
			for kind, n := range lease.NewOrphans(prev, cur) {
				am.OrphansFound.WithLabelValues(kind).Add(float64(n))
			}
		}
		prev = cur
		if !gate.Should(time.Now(), due) {
			return
		}
		if err := trigger(ctx); err != nil {
			log.Warn("reconcile scan found work, trigger failed; the schedule still runs", zap.Strings("work", due), zap.Error(err))
			return
		}
		log.Info("reconcile scan found work: reconcile triggered", zap.Strings("work", due))
	})
}

// eachRound runs round every `every` until ctx ends, each with a context
// bounded by the interval.
func eachRound(ctx context.Context, every time.Duration, round func(context.Context)) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		// select picks at random when a tick is pending as ctx ends: an
		// agent that is stopping must not run one round more.
		if ctx.Err() != nil {
			return
		}
		rctx, cancel := context.WithTimeout(ctx, every)
		round(rctx)
		cancel()
	}
}

// reconcileTAPs removes, every `every` until ctx ends, the TAPs no record
// leases once past their grace and sets leased TAPs that lost their bridge
// or their port settings up again (network.ReconcileTAPs, counted in
// vmflow_network_ports_reattached_total), and makes the
// host-path filter again when it is not whole. Local work: no Temporal
// call. A failed round is logged and tried again.
func reconcileTAPs(ctx context.Context, nw *network.Net, am *metrics.Agent, every time.Duration, log *zap.Logger) {
	eachRound(ctx, every, func(rctx context.Context) {
		if restored, err := nw.RestoreHostPath(); err != nil {
			log.Error("network host-path filter not restored; tried again next round", zap.Error(err))
		} else if restored {
			log.Warn("network host-path filter was not whole (flushed by hand, or the host's addresses changed); made again")
		}
		round, err := nw.ReconcileTAPs(rctx)
		am.NetworkPortsReattached.Add(float64(len(round.Reattached)))
		am.OrphansFound.WithLabelValues(store.KindNetwork).Add(float64(len(round.Removed)))
		if err != nil {
			log.Warn("TAP reconcile failed; tried again next round", zap.Strings("removed", round.Removed), zap.Strings("reattached", round.Reattached), zap.Error(err))
		}
		if dropped, err := nw.FilterDropped(); err != nil {
			log.Warn("read the network filter's drop count", zap.Error(err))
		} else {
			am.SetNetworkFilterDropped(dropped.Spoofed)
			am.SetNetworkRateDropped(dropped.OverRate)
		}
	})
}
