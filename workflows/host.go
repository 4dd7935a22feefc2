package workflows

import (
	"errors"
	"fmt"
	"slices"
	"time"

	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	"vmflow/internal/contract"
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
	// scheduleToClose bounds all attempts together; 0: no bound (the
	// retry policy decides). Set by runStage only.
	scheduleToClose time.Duration
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
	w      *Workflows
	t      *tracker
	hostID string
	// giveUp is the worker's limit on how long the host may stay
	// unreachable before run fails with errHostGaveUp (0: wait forever).
	// It decides which commands follow, so run uses it only through
	// hostWait, which fixes it for the run.
	giveUp    time.Duration
	abandonCh workflow.ReceiveChannel // nil: abandon not accepted
	canLoop   bool                    // continue-as-new may be requested from the wait loop
	// stuckAfter: a stage run by runStage that has not succeeded for this
	// long shows needs-attention. 0: runStage is plain run (runs started
	// before the bound existed replay that way).
	stuckAfter time.Duration

	unreachableSince time.Time
	abandonReason    string
	fixedGiveUp      *time.Duration // hostWait's value, once fixed
}

// changeHostWait is the GetVersion change id of runs that record the host
// wait limit (--spawn-host-wait for a spawn, the ScheduleToStart timeout
// for a reconcile) the first time their host is unreachable.
const changeHostWait = "host-wait-recorded"

// hostWait returns the run's limit on an unreachable host, recorded the first
// time it is needed so a replay on another flag value decides the same.
func (h *hostRunner) hostWait(ctx workflow.Context) time.Duration {
	if h.giveUp <= 0 {
		return 0
	}
	if h.fixedGiveUp == nil {
		v := h.giveUp
		// Only runs whose host was away pay for these markers; older runs
		// replay with the worker's value.
		if workflow.GetVersion(ctx, changeHostWait, workflow.DefaultVersion, 1) >= 1 {
			v = recorded(ctx, h.giveUp, Config{}.WithDefaults().SpawnHostWait)
		}
		h.fixedGiveUp = &v
	}
	return *h.fixedGiveUp
}

func (h *hostRunner) options(c hostCall) workflow.ActivityOptions {
	return workflow.ActivityOptions{
		TaskQueue:              HostTaskQueue(h.hostID),
		ScheduleToStartTimeout: h.w.cfg.ScheduleToStartTimeout,
		StartToCloseTimeout:    c.timeout,
		ScheduleToCloseTimeout: c.scheduleToClose,
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
		// For tracing's spans of the call (a context value, no command).
		actx = workflow.WithValue(actx, contract.StageKey, h.t.status.Stage)
		err := workflow.ExecuteActivity(actx, c.name, in).Get(ctx, out)
		if !isScheduleToStart(err) {
			if attempt > 0 {
				h.t.logger.Info("host reachable again", "activity", c.name)
				h.unreachableSince = time.Time{}
				h.t.hostAnswered()
				h.t.recovered(ctx)
			}
			return err
		}
		h.t.hostDown = h.abandonCh != nil
		now := workflow.Now(ctx)
		if h.unreachableSince.IsZero() {
			h.unreachableSince = now
		}
		giveUp := h.hostWait(ctx)
		if giveUp > 0 && now.Sub(h.unreachableSince) >= giveUp {
			return fmt.Errorf("%w: no agent polled %s for %s", errHostGaveUp, HostTaskQueue(h.hostID), now.Sub(h.unreachableSince).Round(time.Second))
		}
		attempt++
		wait := backoff(h.w.cfg.UnreachableBackoff, h.w.cfg.UnreachableBackoffMax, attempt)
		if giveUp > 0 {
			wait = min(wait, giveUp-now.Sub(h.unreachableSince))
		}
		prev := h.t.status.Stage
		h.t.failed(ctx, StageHostUnreachable,
			fmt.Errorf("host %s did not pick up %s within %s (agent down?)", h.hostID, c.name, h.w.cfg.ScheduleToStartTimeout),
			attempt, now.Add(wait))
		if h.abandonCh != nil {
			h.rejectStaleAbandons()
		}
		if _, reason := h.t.waitRetry(ctx, wait, h.abandonCh); reason != "" {
			h.abandonReason = reason
			return errAbandoned
		}
		if h.canLoop && workflow.GetInfo(ctx).GetContinueAsNewSuggested() {
			return errContinueAsNew
		}
		h.t.status.Stage = prev // shown again while the next attempt is scheduled
	}
}

// runStage runs a stage activity that retries without limit, in rounds bounded
// by the stuck bound, so it is never stuck unseen and never fails the delete:
// a round that runs out shows needs-attention, a non-retryable failure parks.
// Returns nil, errAbandoned, errContinueAsNew or ctx's cancel.
func (h *hostRunner) runStage(ctx workflow.Context, c hostCall, in, out any) error {
	if h.stuckAfter <= 0 {
		return h.run(ctx, c, in, out)
	}
	stage := h.t.status.Stage
	// A round is at least one pickup plus one whole attempt.
	c.scheduleToClose = max(h.stuckAfter, h.w.cfg.ScheduleToStartTimeout+c.timeout)
	for round := uint32(1); ; round++ {
		if round > 1 {
			// needs-attention stays until the stage succeeds (recovered).
			// Details only: the search attributes have not changed.
			h.t.status.Stage, h.t.status.Attempt = stage, round
			h.t.since = workflow.Now(ctx)
			h.t.publish(ctx)
		}
		err := h.run(ctx, c, in, out)
		if err == nil {
			h.t.recovered(ctx)
			return nil
		}
		if errors.Is(err, errAbandoned) || errors.Is(err, errContinueAsNew) || errors.Is(err, errHostGaveUp) {
			return err
		}
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
		if retryable(c.retry, err) {
			// Only running out of time ends a retryable round.
			h.t.attention(ctx, stage, fmt.Sprintf("no progress for %s, retrying: %s", h.stuckAfter, errorText(err)), round, time.Time{})
			c.retry = slowStart(c.retry, h.stuckAfter)
		} else {
			h.t.attention(ctx, stage, errorText(err)+
				" (not retried: repair the host, then signal retry; if the host is gone for good, signal abandon with a reason)",
				round, time.Time{})
			if err := h.park(ctx); err != nil {
				return err
			}
		}
		if h.canLoop && workflow.GetInfo(ctx).GetContinueAsNewSuggested() {
			return errContinueAsNew
		}
	}
}

// park waits, without a timer, for a retry (nil) or an abandon with a reason
// (errAbandoned); abandons sent before it parked are refused.
func (h *hostRunner) park(ctx workflow.Context) error {
	if h.abandonCh != nil {
		h.rejectStaleAbandons()
	}
	for {
		retried, reason := h.t.waitRetry(ctx, 0, h.abandonCh)
		switch {
		case reason != "":
			h.abandonReason = reason
			return errAbandoned
		case retried:
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		}
		// An abandon without a reason was refused: keep waiting.
	}
}

// retryable reports whether p retries err: not marked non-retryable nor of one
// of p's non-retryable types (without an attempt limit such an error comes
// back only when ScheduleToClose ran out).
func retryable(p *temporal.RetryPolicy, err error) bool {
	var appErr *temporal.ApplicationError
	if !errors.As(err, &appErr) {
		return true
	}
	return !appErr.NonRetryable() && (p == nil || !slices.Contains(p.NonRetryableErrorTypes, appErr.Type()))
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
	// A ScheduleToClose timeout wraps the last attempt's failure, which may
	// be a timeout itself (a StopVM that hung): the innermost one says most.
	var last *temporal.TimeoutError
	for e := err; e != nil; e = errors.Unwrap(e) {
		if te, ok := e.(*temporal.TimeoutError); ok {
			last = te
		}
	}
	if last != nil {
		return "timeout (" + last.TimeoutType().String() + "): " + last.Message()
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

// recorded returns v as this run first recorded it with SideEffect, whatever v
// is on a replaying worker: values that decide commands never come straight
// from Config. fallback keeps the run deterministic if decoding fails.
func recorded[T comparable](ctx workflow.Context, v, fallback T) T {
	var out, zero T
	if err := workflow.SideEffect(ctx, func(workflow.Context) any { return v }).Get(&out); err != nil || out == zero {
		return fallback
	}
	return out
}
