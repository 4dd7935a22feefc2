package workflows

import (
	"fmt"
	"time"

	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
	"google.golang.org/protobuf/proto"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Operator actions: retry and abandon, each both a Workflow Update (the
// caller gets the new status, or the reason it was refused) and a signal
// (tctl has no update command; ReconcileVGPU signals deletes). Both paths
// end a wait through tracker.waitRetry and judge abandon with
// tracker.abandonRefusal; they differ only where the signal's recorded
// behaviour must replay unchanged: a retry signal sent while nothing waits
// stays buffered and ends the next wait at once, and an abandon signal is
// weighed when the next wait that accepts abandon begins
// (hostRunner.rejectStaleAbandons). An update is judged at once; a retry
// update that finds a try running (a step, a release round) is answered
// at once, naming that try, and leaves nothing behind: that try is the
// retry, and the caller is not held for a round that may last minutes.
//
// Neither the handlers nor their validators are commands: an accepted
// update is a protocol message the server records as
// WorkflowExecutionUpdateAccepted/Completed, a rejected one is not recorded
// at all, and the wait they end issues the same commands as a signal
// would. So they need no GetVersion; histories recorded before them replay
// as they were (TestReplayRecordedHistories).

// maxPendingOps bounds accepted updates not yet taken by the wait. One wait
// takes one; the rest are settled when it ends (settle), so the buffer
// holds at most the updates of one workflow task.
const maxPendingOps = 64

type opKind int

const (
	opRetry opKind = iota + 1
	opAbandon
)

// operatorOp is one accepted update on its way to the wait.
type operatorOp struct {
	kind   opKind
	reason string
	done   bool  // the workflow acted on it
	err    error // refused after it was accepted: the wait ended first
	// A retry that ended no wait: a try was running, or began as it
	// came. Its answer says which (alreadyRetrying).
	running bool
}

// waitState is the wait in progress: what retry and abandon may end.
type waitState struct {
	abandon bool // abandon with a reason ends it (host unreachable, or parked)
}

// registerUpdates registers the retry and abandon updates, which return the
// status once the workflow acted (retry scheduled, or ended as abandoned).
func (t *tracker) registerUpdates(ctx workflow.Context) error {
	err := workflow.SetUpdateHandlerWithOptions(ctx, RetryUpdate,
		func(ctx workflow.Context, req *vmflowv1.RetrySignal) (*vmflowv1.WorkflowStatus, error) {
			return t.operate(ctx, &operatorOp{kind: opRetry, reason: req.GetReason()})
		},
		workflow.UpdateHandlerOptions{Validator: func(_ workflow.Context, req *vmflowv1.RetrySignal) error {
			if err := reasonRefusal(RetryUpdate, req.GetReason()); err != nil {
				return err
			}
			return t.retryRefusal()
		}})
	if err != nil {
		return fmt.Errorf("register %s update: %w", RetryUpdate, err)
	}
	err = workflow.SetUpdateHandlerWithOptions(ctx, AbandonUpdate,
		func(ctx workflow.Context, req *vmflowv1.AbandonSignal) (*vmflowv1.WorkflowStatus, error) {
			return t.operate(ctx, &operatorOp{kind: opAbandon, reason: req.GetReason()})
		},
		workflow.UpdateHandlerOptions{Validator: func(_ workflow.Context, req *vmflowv1.AbandonSignal) error {
			if err := reasonRefusal(AbandonUpdate, req.GetReason()); err != nil {
				return err
			}
			return t.abandonRefusal(req.GetReason())
		}})
	if err != nil {
		return fmt.Errorf("register %s update: %w", AbandonUpdate, err)
	}
	return nil
}

// refused is the error a validator rejects with: non-retryable, its type
// the one callers branch on, its message the reason for the operator.
func refused(format string, args ...any) error {
	return temporal.NewNonRetryableApplicationError(fmt.Sprintf(format, args...), ErrTypeRefused, nil)
}

// MaxReasonBytes bounds an operator's reason: it is kept in the workflow's
// status, its result and the Web UI's details, and every payload counts
// against the history's size limit.
const MaxReasonBytes = 1024

// reasonRefusal refuses an update whose reason is longer than
// MaxReasonBytes. A validator's check, so a refused update is not recorded.
func reasonRefusal(update, reason string) error {
	if len(reason) > MaxReasonBytes {
		return refused("%s refused: the reason is %d bytes, longer than %d", update, len(reason), MaxReasonBytes)
	}
	return nil
}

// retryRefusal refuses a retry only in the stage the workflow ends in; any
// wait is cut short, and a step in progress is the retry already.
func (t *tracker) retryRefusal() error {
	if terminalStage(t.status.Stage) {
		return refused("retry refused: the %s has ended (stage %s)", t.kind, t.status.Stage)
	}
	return nil
}

// alreadyRetrying is the retry update's answer while a step or round runs:
// what runs since when, so the operator need not wait.
func (t *tracker) alreadyRetrying() string {
	return fmt.Sprintf("already retrying: attempt %d since %s", t.status.Attempt, t.since.UTC().Format(time.RFC3339))
}

// abandonRefusal says why an abandon cannot act now: it needs a reason and a
// wait that accepts it (host unreachable, or parked on an operator's fix).
func (t *tracker) abandonRefusal(reason string) error {
	switch {
	case !t.canAbandon:
		return refused("abandon refused: only a delete can be abandoned (this is a %s)", t.kind)
	case reason == "":
		return refused("abandon refused: a reason is required")
	case t.hostDown:
		// Known unreachable, also while the next try waits to be picked
		// up: the abandon is queued and taken by the next wait.
	case t.wait == nil || !t.wait.abandon:
		return refused("abandon refused: host %s is reachable (stage %s)", t.hostID, t.status.Stage)
	}
	return nil
}

// operate hands an accepted update to the wait and returns the status once
// the workflow acted on it (the update's result).
func (t *tracker) operate(ctx workflow.Context, op *operatorOp) (*vmflowv1.WorkflowStatus, error) {
	queue := t.wait != nil || (op.kind == opAbandon && t.hostDown)
	if !queue {
		// A step or round runs (a retry is answered at once, the caller
		// is not held for the round), or the wait the validator saw
		// ended before this handler ran (a timer in the same workflow
		// task).
		t.settle(op)
	} else if !t.ops.SendAsync(op) {
		return nil, refused("%s refused: too many operator actions at once; send it again", op.name())
	}
	if err := workflow.Await(ctx, func() bool { return op.done || op.err != nil }); err != nil {
		return nil, err
	}
	if op.err != nil {
		return nil, op.err
	}
	st := proto.Clone(t.status).(*vmflowv1.WorkflowStatus)
	if op.running {
		st.Note = t.alreadyRetrying()
	}
	return st, nil
}

func (op *operatorOp) name() string {
	if op.kind == opAbandon {
		return AbandonUpdate
	}
	return RetryUpdate
}

// settle ends an accepted update whose wait ended without it: a retry is done,
// an abandon refused.
func (t *tracker) settle(op *operatorOp) {
	if op.kind == opRetry {
		op.done, op.running = true, true
		t.logger.Info("retry update: a try is running already", "reason", op.reason)
		return
	}
	op.err = refused("abandon refused: the wait ended before it took effect (stage %s); send it again if host %s is still unreachable",
		t.status.Stage, t.hostID)
}

// waitRetry blocks until a retry, d passing (d <= 0: no timer, free however
// long), or an abandon on abandonCh (if set). An abandon without a reason is
// refused and ends the wait as the timer would.
func (t *tracker) waitRetry(ctx workflow.Context, d time.Duration, abandonCh workflow.ReceiveChannel) (retried bool, abandonReason string) {
	timerCtx, cancel := workflow.WithCancel(ctx)
	defer cancel()
	t.wait = &waitState{abandon: abandonCh != nil}
	defer t.endWait(ctx)
	// The order of the cases is the order of the recorded histories:
	// timer (or cancel), retry signal, abandon signal; updates last.
	sel := workflow.NewSelector(ctx)
	if d > 0 {
		sel.AddFuture(workflow.NewTimer(timerCtx, d), func(workflow.Future) {})
	} else {
		// Without a timer nothing else would end the wait on a cancel.
		sel.AddReceive(ctx.Done(), func(workflow.ReceiveChannel, bool) {})
	}
	sel.AddReceive(t.retryCh, func(c workflow.ReceiveChannel, more bool) {
		var sig vmflowv1.RetrySignal
		c.Receive(ctx, &sig)
		retried = true
		t.logger.Info("retry", "via", "signal", "reason", sig.GetReason())
	})
	if abandonCh != nil {
		sel.AddReceive(abandonCh, func(c workflow.ReceiveChannel, more bool) {
			var sig vmflowv1.AbandonSignal
			c.Receive(ctx, &sig)
			if err := t.abandonRefusal(sig.GetReason()); err != nil {
				t.logger.Warn(errorText(err), "via", "signal")
				return
			}
			abandonReason = sig.GetReason()
			t.logger.Warn("abandon", "via", "signal", "reason", abandonReason)
		})
	}
	sel.AddReceive(t.ops, func(c workflow.ReceiveChannel, more bool) {
		var op *operatorOp
		c.Receive(ctx, &op)
		if op.kind == opAbandon && abandonCh == nil {
			// Only a wait that can end in abandon takes one; any other
			// refuses it rather than report an abandon that never was.
			t.settle(op)
			return
		}
		op.done = true
		if op.kind == opAbandon {
			abandonReason = op.reason
			t.logger.Warn("abandon", "via", "update", "reason", abandonReason)
			return
		}
		retried = true
		t.logger.Info("retry", "via", "update", "reason", op.reason)
	})
	sel.Select(ctx)
	return retried, abandonReason
}

// hostAnswered refuses abandons queued while the host was unreachable: it
// answered, so it is not gone.
func (t *tracker) hostAnswered() {
	t.hostDown = false
	if t.wait != nil {
		return // the wait's own end settles what it holds
	}
	for {
		var op *operatorOp
		if !t.ops.ReceiveAsync(&op) {
			return
		}
		if op.kind == opAbandon {
			op.err = refused("abandon refused: host %s answered again (stage %s)", t.hostID, t.status.Stage)
			continue
		}
		t.settle(op)
	}
}

// endWait settles updates accepted during the wait but not taken, so none
// waits on a wait that is over or ends a later one.
func (t *tracker) endWait(ctx workflow.Context) {
	t.wait = nil
	t.status.NextRetryTime = "" // the timer, if any, is over
	t.since = workflow.Now(ctx) // the next try starts now
	for {
		var op *operatorOp
		if !t.ops.ReceiveAsync(&op) {
			return
		}
		t.settle(op)
	}
}

// awaitHandlers lets running update handlers finish before the run ends, as
// their answer is the status after it acted; a no-op with none in flight.
func awaitHandlers(ctx workflow.Context) {
	// A cancelled ctx ends the wait early; the run ends anyway.
	_ = workflow.Await(ctx, func() bool { return workflow.AllHandlersFinished(ctx) })
}
