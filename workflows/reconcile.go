package workflows

import (
	"fmt"

	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// ReconcileVGPU runs one host's vGPU reconcile and wakes every delete whose
// claim it released; unreadable records set needs-attention.
func (w *Workflows) ReconcileVGPU(ctx workflow.Context, req *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	res, err := w.reconcileVGPU(ctx, req)
	awaitHandlers(ctx)
	return res, err
}

func (w *Workflows) reconcileVGPU(ctx workflow.Context, req *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	if req == nil || !ValidID(req.GetHostId()) {
		return nil, invalidInput("host_id %q: must match %s", req.GetHostId(), idPattern)
	}
	// Runs recorded before lazy search attributes replay with one upsert
	// per stage. (GetVersion's own TemporalChangeVersion upsert is not
	// billed.)
	var t *tracker
	var err error
	if workflow.GetVersion(ctx, changeLazySA, workflow.DefaultVersion, 1) >= 1 {
		t, err = newLazyTracker(ctx, "reconcile", "", req.GetHostId(), StageReconciling)
	} else {
		t, err = newTracker(ctx, "reconcile", "", req.GetHostId())
	}
	if err != nil {
		return nil, err
	}
	// The agent triggers the next run when it finds work: don't wait long
	// for a host that is away.
	h := &hostRunner{w: w, t: t, hostID: req.GetHostId(), giveUp: w.cfg.ScheduleToStartTimeout}
	t.stage(ctx, StageReconciling)
	var res vmflowv1.ReconcileVGPUResult
	if err := h.run(ctx, w.calls()[ActivityReconcileHost], req, &res); err != nil {
		t.status.LastError = errorText(err)
		t.publish(ctx)
		return nil, err
	}
	for _, id := range res.GetRetriedDeletes() {
		sig := &vmflowv1.RetrySignal{Reason: "reconcile released the leases of " + id}
		// A delete that is not running (already finished, or never
		// started) is not an error for the reconcile.
		err := workflow.SignalExternalWorkflow(ctx, DeleteWorkflowID(id), "", RetrySignal, sig).Get(ctx, nil)
		if err != nil {
			t.logger.Info("retry not delivered", "workflow_id", DeleteWorkflowID(id), "error", err.Error())
		}
	}
	if n := res.GetUnreadableRecords(); n > 0 {
		// The agent removes no orphan device while a record it cannot
		// read may claim one; until that record is repaired or removed,
		// every round says so.
		t.status.NeedsAttention = true
		t.status.LastError = fmt.Sprintf("%d instance record(s) on host %s cannot be read: no orphan device was removed "+
			"(an unreadable record may claim it); repair or remove the record(s) (see the agent log, vmflow_records_unreadable)",
			n, req.GetHostId())
		t.logger.Warn("needs attention", "error", t.status.LastError)
	}
	t.stage(ctx, StageReconciled)
	return &res, nil
}
