package workflows

import (
	"errors"
	"fmt"
	"time"

	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// DeleteInstance stops an instance's VM, waits until its whole group is gone,
// releases its vGPU and removes its record, never failing with record and claim
// left (invariant 1): stuck or failed stages wait, needing attention, for retry
// or abandon. A clean-up of another spawn's record ends not-owned (invariant 9).
func (w *Workflows) DeleteInstance(ctx workflow.Context, req *vmflowv1.DeleteRequest) (*vmflowv1.DeleteResult, error) {
	res, err := w.deleteInstance(ctx, req)
	awaitHandlers(ctx)
	return res, err
}

func (w *Workflows) deleteInstance(ctx workflow.Context, req *vmflowv1.DeleteRequest) (*vmflowv1.DeleteResult, error) {
	if req == nil {
		return nil, invalidInput("empty delete request")
	}
	if !ValidID(req.GetInstanceId()) {
		return nil, invalidInput("instance_id %q: must match %s", req.GetInstanceId(), idPattern)
	}
	if req.GetHostId() != "" && !ValidID(req.GetHostId()) {
		return nil, invalidInput("host_id %q: must match %s (or be empty: the instance's host is found)", req.GetHostId(), idPattern)
	}
	stuckAfter, version := w.stuckBound(ctx, req)
	if req.GetHostId() == "" {
		if version < 4 {
			// Runs recorded before placement failed here, before any command.
			return nil, invalidInput("host_id %q: must match %s", req.GetHostId(), idPattern)
		}
		host, err := w.findHost(ctx, req.GetInstanceId())
		if err != nil {
			return nil, err
		}
		if host == "" {
			t, err := newLazyTracker(ctx, "delete", req.GetInstanceId(), "", StageAlreadyAbsent)
			if err != nil {
				return nil, err
			}
			t.logger.Info("no spawn of the instance names a host: nothing to delete")
			return &vmflowv1.DeleteResult{AlreadyAbsent: true}, nil
		}
		req.HostId = host // continue-as-new carries it
	}
	var t *tracker
	var err error
	if version >= 2 {
		t, err = newLazyTracker(ctx, "delete", req.GetInstanceId(), req.GetHostId(), StageMarkingStopped)
	} else {
		t, err = newTracker(ctx, "delete", req.GetInstanceId(), req.GetHostId())
	}
	if err != nil {
		return nil, err
	}
	t.onlyChanges = stuckAfter > 0 // new runs only: see stuckBound
	t.canAbandon = true
	h := &hostRunner{
		w: w, t: t, hostID: req.GetHostId(), canLoop: true,
		abandonCh:  workflow.GetSignalChannel(ctx, AbandonSignal),
		stuckAfter: stuckAfter,
	}
	calls := w.calls()
	ref := &vmflowv1.InstanceRef{InstanceId: req.GetInstanceId()}
	// Whatever the loop's outcome, abandon and continue-as-new end the run
	// the same way from every stage.
	end := func(err error) (*vmflowv1.DeleteResult, error) {
		switch {
		case errors.Is(err, errAbandoned):
			t.stage(ctx, StageAbandoned)
			// Abandon cleans nothing up: say where what is left stays.
			t.status.LastError = fmt.Sprintf("abandoned: %s (the instance's record and any lease it holds stay on host %s; if it comes back, a new delete finishes the job)",
				h.abandonReason, req.GetHostId())
			t.status.NeedsAttention = false
			t.publish(ctx)
			return &vmflowv1.DeleteResult{Abandoned: true, AbandonReason: h.abandonReason}, nil
		case errors.Is(err, errContinueAsNew):
			return nil, w.continueDelete(ctx, t, req)
		default:
			return nil, err
		}
	}

	var begin *vmflowv1.BeginDeleteResult
	// From version 5 on a delete the platform asked for marks, stops and
	// waits for the group in one activity (StopInstance). A failed spawn's
	// clean-up keeps BeginDelete a step of its own: that the record was
	// its spawn's when it began must reach the history before any later
	// step can fail and be retried (a retry that finds the record unreadable
	// is told "not owned", which parks only a delete that knows it owned it).
	combined := version >= deleteVersionCombined && req.GetOnlyIfCreatedByWorkflowId() == ""
	if combined {
		t.stage(ctx, StageStopping)
		// The delete may begin inside the activity, and a host lost
		// meanwhile never says so: from here the record is kept on the
		// host until the delete removes it (an abandon says where).
		t.setRetained(ctx, true)
		var res vmflowv1.StopInstanceResult
		in := &vmflowv1.StopInstanceRequest{InstanceId: req.GetInstanceId(), GracefulTimeoutSeconds: req.GetGracefulTimeoutSeconds()}
		if err := w.beginDelete(ctx, h, req, w.stopCall(req, ActivityStopInstance), in, &res, res.GetBegin); err != nil {
			return end(err)
		}
		begin = res.GetBegin()
	} else {
		t.stage(ctx, StageMarkingStopped)
		var res vmflowv1.BeginDeleteResult
		in := &vmflowv1.BeginDeleteRequest{
			InstanceId:                req.GetInstanceId(),
			OnlyIfCreatedByWorkflowId: req.GetOnlyIfCreatedByWorkflowId(),
			OnlyIfCreatedByRunId:      req.GetOnlyIfCreatedByRunId(),
		}
		if err := w.beginDelete(ctx, h, req, calls[ActivityBeginDelete], in, &res, func() *vmflowv1.BeginDeleteResult { return &res }); err != nil {
			return end(err)
		}
		begin = &res
	}
	if begin.GetNotOwned() {
		// The host touched nothing; the instance belongs to the spawn
		// that created it, which is not a failure of this delete.
		t.logger.Info("record created by another spawn: left alone", "created_by", begin.GetCreatedBy(),
			"workflow_id", req.GetOnlyIfCreatedByWorkflowId(), "run_id", req.GetOnlyIfCreatedByRunId())
		t.status.NeedsAttention = false
		t.stage(ctx, StageNotOwned)
		return &vmflowv1.DeleteResult{NotOwned: true, CreatedBy: begin.GetCreatedBy()}, nil
	}
	if begin.GetAlreadyAbsent() {
		t.setRetained(ctx, false)
		t.stage(ctx, StageAlreadyAbsent)
		return &vmflowv1.DeleteResult{AlreadyAbsent: true}, nil
	}
	if req.GetOnlyIfCreatedByWorkflowId() != "" {
		req.CarriedOwned = true // decided: continue-as-new carries it
	}
	t.setRetained(ctx, true)

	if !combined {
		t.stage(ctx, StageStopping)
		stopIn := &vmflowv1.StopVMRequest{InstanceId: req.GetInstanceId(), GracefulTimeoutSeconds: req.GetGracefulTimeoutSeconds()}
		var res vmflowv1.StopVMResult
		if err := h.runStage(ctx, w.stopCall(req, ActivityStopVM), stopIn, &res); err != nil {
			return end(err)
		}
		t.stage(ctx, StageWaitingExit)
		if err := h.runStage(ctx, calls[ActivityWaitVMExit], ref, nil); err != nil {
			return end(err)
		}
	}

	if err := w.releaseLoop(ctx, t, h, req, version); err != nil {
		return end(err)
	}

	t.stage(ctx, StageTearingDown)
	if version >= deleteVersionCombined {
		if err := h.runStage(ctx, calls[ActivityRemoveInstance], ref, nil); err != nil {
			return end(err)
		}
	} else {
		if err := h.runStage(ctx, calls[ActivityTearDown], ref, nil); err != nil {
			return end(err)
		}
		if err := h.runStage(ctx, calls[ActivityDeleteRecord], ref, nil); err != nil {
			return end(err)
		}
	}
	t.setRetained(ctx, false)
	t.stage(ctx, StageDeleted)
	return &vmflowv1.DeleteResult{}, nil
}

// releaseLoop releases the instance's vGPU round after round until it
// succeeds, waiting between rounds for the backoff timer or a retry.
func (w *Workflows) releaseLoop(ctx workflow.Context, t *tracker, h *hostRunner, req *vmflowv1.DeleteRequest, version workflow.Version) error {
	call, stage := w.calls()[ActivityReleaseVGPU], StageReleasingVGPU
	if version >= 3 {
		call, stage = w.calls()[ActivityReleaseLeases], StageReleasingLeases
	}
	ref := &vmflowv1.InstanceRef{InstanceId: req.GetInstanceId()}
	attempts := req.GetCarriedAttempts()
	t.stage(ctx, stage)
	for {
		if attempts > 0 {
			t.status.Attempt = attempts + 1
			t.publish(ctx)
		}
		var res vmflowv1.ReleaseVGPUResult
		err := h.run(ctx, call, ref, &res)
		if err == nil {
			t.recovered(ctx)
			return nil
		}
		if errors.Is(err, errAbandoned) || errors.Is(err, errContinueAsNew) {
			return err
		}
		var appErr *temporal.ApplicationError
		if errors.As(err, &appErr) && appErr.NonRetryable() && appErr.Type() == ErrTypeInvalidInput {
			return err
		}
		attempts++
		if req.GetCarriedFirstFailureTime() == "" {
			req.CarriedFirstFailureTime = workflow.Now(ctx).UTC().Format(time.RFC3339)
		}
		req.CarriedAttempts = attempts
		wait := backoff(w.cfg.ReleaseBackoff, w.cfg.ReleaseBackoffMax, attempts)
		t.failed(ctx, StageReleaseFailed, err, attempts, workflow.Now(ctx).Add(wait))
		t.waitRetry(ctx, wait, nil)
		if err := ctx.Err(); err != nil {
			return err
		}
		if workflow.GetInfo(ctx).GetContinueAsNewSuggested() {
			return errContinueAsNew
		}
		t.status.Stage = stage
	}
}

// continueDelete continues the delete as new under the same workflow id,
// carrying the attempt count and first failure; it restarts from the top, as
// every activity is idempotent.
func (w *Workflows) continueDelete(ctx workflow.Context, t *tracker, req *vmflowv1.DeleteRequest) error {
	if n := t.drainRetries(); n > 0 {
		// The new run tries at once, which is what the signal asked for.
		t.logger.Info("retry signals folded into continue-as-new", "count", n)
	}
	h := workflow.GetSignalChannel(ctx, AbandonSignal)
	for {
		var sig vmflowv1.AbandonSignal
		if !h.ReceiveAsync(&sig) {
			break
		}
		t.logger.Warn("abandon refused: sent while continuing as new", "reason", sig.GetReason())
	}
	next := &vmflowv1.DeleteRequest{
		InstanceId:              req.GetInstanceId(),
		HostId:                  req.GetHostId(),
		GracefulTimeoutSeconds:  req.GetGracefulTimeoutSeconds(),
		CarriedAttempts:         req.GetCarriedAttempts(),
		CarriedFirstFailureTime: req.GetCarriedFirstFailureTime(),
		// The bound recorded when the delete started (0 from a run that
		// predates it: the next run records the worker's default).
		StuckAfterSeconds:         req.GetStuckAfterSeconds(),
		OnlyIfCreatedByWorkflowId: req.GetOnlyIfCreatedByWorkflowId(),
		OnlyIfCreatedByRunId:      req.GetOnlyIfCreatedByRunId(),
		CarriedOwned:              req.GetCarriedOwned(),
	}
	return workflow.NewContinueAsNewError(ctx, DeleteWorkflow, next)
}

// beginDelete runs call (BeginDelete, or StopInstance from version 5 on),
// whose BeginDelete answer begun reads from out. A clean-up that owned the
// record when it began (carried_owned) and is now told not-owned parks
// instead of ending, which would leave record and claim in Deleting with no
// workflow to finish them.
func (w *Workflows) beginDelete(ctx workflow.Context, h *hostRunner, req *vmflowv1.DeleteRequest, call hostCall, in, out any, begun func() *vmflowv1.BeginDeleteResult) error {
	stage := h.t.status.Stage
	for round := uint32(1); ; round++ {
		if err := h.runStage(ctx, call, in, out); err != nil {
			return err
		}
		// Only runs continued by this code carry carried_owned, so older
		// histories replay unchanged.
		b := begun()
		if !b.GetNotOwned() || !req.GetCarriedOwned() {
			return nil
		}
		h.t.attention(ctx, stage, fmt.Sprintf("the host says the record was created by %s, but this delete found it created by %s (run %s) when it began: "+
			"left alone (not retried: repair the record, then signal retry; if the host is gone for good, signal abandon with a reason)",
			b.GetCreatedBy(), req.GetOnlyIfCreatedByWorkflowId(), req.GetOnlyIfCreatedByRunId()), round, time.Time{})
		if err := h.park(ctx); err != nil {
			return err
		}
		if workflow.GetInfo(ctx).GetContinueAsNewSuggested() {
			return errContinueAsNew
		}
	}
}

// stopCall is the call of the stop activity name for req: its attempt
// longer by what req's graceful timeout asks beyond the worker's default.
func (w *Workflows) stopCall(req *vmflowv1.DeleteRequest, name string) hostCall {
	c := w.calls()[name]
	if g := time.Duration(req.GetGracefulTimeoutSeconds()) * time.Second; g > w.cfg.GracefulTimeout {
		c.timeout += g - w.cfg.GracefulTimeout
	}
	return c
}

// versionStuckBound marks delete runs that bound their stages (runStage)
// and upsert search attributes only on change (version 1), and only where
// they must be exact (version 2, a lazy tracker), and release through
// ReleaseLeases (version 3, the lease engine's name: no marker of its own,
// which would cost a billed upsert), and may be started without a host,
// which it finds (version 4, placement), and marks, stops and waits in one
// activity and tears down and removes the record in another (version 5:
// StopInstance and RemoveInstance, three round trips fewer). Runs recorded
// before it replay with neither.
const versionStuckBound = "delete-stuck-bound"

// deleteVersionCombined is the versionStuckBound version of deletes that
// stop in one activity (StopInstance) and remove in one (RemoveInstance).
const deleteVersionCombined workflow.Version = 5

// stuckBound returns the delete's stuck bound (0 for runs from before it) and
// its versionStuckBound: the request's, or the worker's recorded once
// (recorded), stored in req so continue-as-new carries it.
func (w *Workflows) stuckBound(ctx workflow.Context, req *vmflowv1.DeleteRequest) (time.Duration, workflow.Version) {
	v := workflow.GetVersion(ctx, versionStuckBound, workflow.DefaultVersion, deleteVersionCombined)
	if v == workflow.DefaultVersion {
		return 0, v
	}
	secs := req.GetStuckAfterSeconds()
	if secs == 0 {
		secs = recorded(ctx, uint32(max(w.cfg.DeleteStuckAfter/time.Second, 1)), uint32(Config{}.WithDefaults().DeleteStuckAfter/time.Second))
		req.StuckAfterSeconds = secs
	}
	return time.Duration(secs) * time.Second, v
}

// findHost is the host the instance's latest spawn was placed on ("": none
// names one), asked again every few seconds while that spawn still
// places (FindInstanceHost's marker records each answer).
func (w *Workflows) findHost(ctx workflow.Context, instanceID string) (string, error) {
	lctx := withFleetLookup(ctx)
	for wait := 0; ; wait++ {
		var out vmflowv1.FindInstanceHostResult
		err := workflow.ExecuteLocalActivity(lctx, LocalActivityFindInstanceHost, &vmflowv1.FindInstanceHostRequest{InstanceId: instanceID}).Get(ctx, &out)
		if err != nil {
			return "", temporal.NewApplicationErrorWithOptions("delete: the instance's host could not be found: "+errorText(err), ErrTypeUnavailable,
				temporal.ApplicationErrorOptions{NonRetryable: true, Cause: err})
		}
		if !out.GetPlacing() {
			return out.GetHostId(), nil
		}
		if wait >= findHostWaits {
			// Never "already absent" while the spawn may still land.
			return "", temporal.NewNonRetryableApplicationError(fmt.Sprintf("delete: the spawn of %s has been placing for %s and has no host yet: delete it again once it ends",
				instanceID, findHostWaits*findHostEvery), ErrTypeBusy, nil)
		}
		if err := workflow.Sleep(ctx, findHostEvery); err != nil {
			return "", err
		}
	}
}

// A delete started while its spawn still places waits for the placement:
// up to findHostWaits × findHostEvery (constants: they decide commands).
const (
	findHostWaits = 60
	findHostEvery = 2 * time.Second
)

func deleteSummary(req *vmflowv1.DeleteRequest) string {
	if req.GetHostId() == "" {
		return fmt.Sprintf("delete %s (host found)", req.GetInstanceId())
	}
	return fmt.Sprintf("delete %s on %s", req.GetInstanceId(), req.GetHostId())
}
