package workflows

import (
	"errors"
	"fmt"
	"time"

	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// hostCall describes one host activity: how long an attempt may take and
// how the SDK retries it before the workflow sees an error.
type hostCall struct {
	name      string
	summary   string
	timeout   time.Duration // StartToClose of one attempt
	heartbeat time.Duration // 0: the activity does not heartbeat
	retry     *temporal.RetryPolicy
}

var (
	// errAbandoned ends a delete that an operator abandoned while its host
	// was unreachable.
	errAbandoned = errors.New("abandoned")
	// errContinueAsNew asks the caller to continue as new: the history has
	// grown long in a wait loop.
	errContinueAsNew = errors.New("continue as new")
	// errHostGaveUp: the host stayed unreachable past the caller's limit.
	errHostGaveUp = errors.New("host unreachable")
)

// hostRunner runs activities on one host's task queue. When the agent does
// not pick a task up within ScheduleToStart (it is down or partitioned), the
// workflow does not fail: it shows host-unreachable, waits for a backoff timer
// or the retry signal, and schedules the activity again. ScheduleToStart
// timeouts are never retried by the server, so this loop is the retry.
type hostRunner struct {
	w         *Workflows
	t         *tracker
	hostID    string
	giveUp    time.Duration           // 0: wait forever
	abandonCh workflow.ReceiveChannel // nil: abandon not accepted
	canLoop   bool                    // continue-as-new may be requested from the wait loop

	unreachableSince time.Time
	abandonReason    string
}

func (h *hostRunner) options(c hostCall) workflow.ActivityOptions {
	return workflow.ActivityOptions{
		TaskQueue:              HostTaskQueue(h.hostID),
		ScheduleToStartTimeout: h.w.cfg.ScheduleToStartTimeout,
		StartToCloseTimeout:    c.timeout,
		HeartbeatTimeout:       c.heartbeat,
		RetryPolicy:            c.retry,
		Summary:                fmt.Sprintf("%s %s", c.summary, h.t.instanceID),
	}
}

func isScheduleToStart(err error) bool {
	var te *temporal.TimeoutError
	return errors.As(err, &te) && te.TimeoutType() == enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START
}

// run executes c with in, decoding into out. It returns the activity's error,
// or errAbandoned, errContinueAsNew or errHostGaveUp from the wait loop.
func (h *hostRunner) run(ctx workflow.Context, c hostCall, in, out any) error {
	var attempt uint32
	for {
		if err := ctx.Err(); err != nil {
			return err // cancelled: the record stays as it is on the host
		}
		actx := workflow.WithActivityOptions(ctx, h.options(c))
		err := workflow.ExecuteActivity(actx, c.name, in).Get(ctx, out)
		if !isScheduleToStart(err) {
			if attempt > 0 {
				h.t.logger.Info("host reachable again", "activity", c.name)
				h.unreachableSince = time.Time{}
				h.t.recovered(ctx)
			}
			return err
		}
		now := workflow.Now(ctx)
		if h.unreachableSince.IsZero() {
			h.unreachableSince = now
		}
		if h.giveUp > 0 && now.Sub(h.unreachableSince) >= h.giveUp {
			return fmt.Errorf("%w: no agent polled %s for %s", errHostGaveUp, HostTaskQueue(h.hostID), now.Sub(h.unreachableSince).Round(time.Second))
		}
		attempt++
		wait := backoff(h.w.cfg.UnreachableBackoff, h.w.cfg.UnreachableBackoffMax, attempt)
		if h.giveUp > 0 {
			wait = min(wait, h.giveUp-now.Sub(h.unreachableSince))
		}
		prev := h.t.status.Stage
		h.t.failed(ctx, StageHostUnreachable,
			fmt.Errorf("host %s did not pick up %s within %s (agent down?)", h.hostID, c.name, h.w.cfg.ScheduleToStartTimeout),
			attempt, now.Add(wait))
		if h.abandonCh != nil {
			h.rejectStaleAbandons()
		}
		abandoned := false
		h.t.waitRetry(ctx, wait, func(sel workflow.Selector) {
			if h.abandonCh == nil {
				return
			}
			sel.AddReceive(h.abandonCh, func(ch workflow.ReceiveChannel, more bool) {
				var sig vmflowv1.AbandonSignal
				ch.Receive(ctx, &sig)
				if sig.GetReason() == "" {
					h.t.logger.Warn("abandon refused: a reason is required")
					return
				}
				abandoned, h.abandonReason = true, sig.GetReason()
			})
		})
		if abandoned {
			return errAbandoned
		}
		if h.canLoop && workflow.GetInfo(ctx).GetContinueAsNewSuggested() {
			return errContinueAsNew
		}
		h.t.status.Stage = prev // shown again while the next attempt is scheduled
	}
}

// rejectStaleAbandons drops abandon signals sent while the host was still
// answering: abandon is accepted only while the stage is host-unreachable.
func (h *hostRunner) rejectStaleAbandons() {
	for {
		var sig vmflowv1.AbandonSignal
		if !h.abandonCh.ReceiveAsync(&sig) {
			return
		}
		h.t.logger.Warn("abandon refused: the host was reachable when it was sent", "reason", sig.GetReason())
	}
}

// errorText is the most useful line of an error for an operator: the
// application error's own message rather than the activity-error wrapper.
func errorText(err error) string {
	if err == nil {
		return ""
	}
	var appErr *temporal.ApplicationError
	if errors.As(err, &appErr) {
		if appErr.Type() != "" {
			return appErr.Type() + ": " + appErr.Message()
		}
		return appErr.Message()
	}
	var te *temporal.TimeoutError
	if errors.As(err, &te) {
		return "timeout (" + te.TimeoutType().String() + "): " + te.Message()
	}
	return err.Error()
}

func errorType(err error) string {
	var appErr *temporal.ApplicationError
	if errors.As(err, &appErr) {
		return appErr.Type()
	}
	return ""
}

func invalidInput(format string, args ...any) error {
	return temporal.NewNonRetryableApplicationError(fmt.Sprintf(format, args...), ErrTypeInvalidInput, nil)
}
