package workflows

import (
	"fmt"
	"strings"
	"time"
	"unicode"

	"go.temporal.io/sdk/log"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
	"google.golang.org/protobuf/proto"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// tracker keeps one workflow's visible state in the three places an
// operator looks: the status query, the search attributes (VmStage,
// VmNeedsAttention) and the Web UI's Current Details. Every change goes
// through it, so the three never disagree.
type tracker struct {
	kind       string // "spawn", "delete", "reconcile"
	instanceID string
	hostID     string
	status     *vmflowv1.WorkflowStatus
	retryCh    workflow.ReceiveChannel
	logger     log.Logger
	wfLogger   log.Logger // the workflow's, without the ids

	// Operator actions (operator.go): ops carries accepted retry and
	// abandon updates to the wait in progress; wait is that wait (nil
	// while the workflow is running a step); canAbandon is set by a
	// delete, the only workflow abandon is for.
	ops        workflow.Channel
	wait       *waitState
	canAbandon bool
	// hostDown: the host did not pick up the last try and has not answered
	// since; abandon is accepted (and queued for the next wait) meanwhile.
	hostDown bool
	// since: when the current try began (the stage started, a wait ended,
	// a stuck round started again); the retry update's answer names it.
	since time.Time

	// onlyChanges: upsert the search attributes only when their values
	// changed (an upsert is a command and a billed action). Runs recorded
	// before this existed upserted on every publish; they replay with it
	// off (see DeleteInstance's version check).
	onlyChanges bool
	// lazy (runs recorded with changeLazySA, or delete version 2): the
	// search attributes are upserted only where an operator's query must
	// be exact: at the start (ids, first stage), whenever VmNeedsAttention
	// changes, when the workflow waits (attention: backoff, host
	// unreachable, release failed, stuck, parked) and when it ends
	// (terminal stages). Stage progress in between goes to Current
	// Details only, which is not billed. It implies onlyChanges.
	lazy      bool
	upserted  bool // the values below were sent
	sentStage string
	sentNeeds bool
}

// changeLazySA is the GetVersion change id of spawn and reconcile runs
// whose tracker is lazy (see tracker.lazy). Deletes use versionStuckBound
// version 2 instead, which they record anyway.
const changeLazySA = "sa-on-wait"

// newLazyTracker is newTracker for runs with lazy search attributes: one
// upsert sets the ids, first stage and VmNeedsAttention=false.
func newLazyTracker(ctx workflow.Context, kind, instanceID, hostID, firstStage string) (*tracker, error) {
	t, err := newTrackerSA(ctx, kind, instanceID, hostID, firstStage, true)
	if err != nil {
		return nil, err
	}
	t.logger.Info("stage", "stage", firstStage)
	return t, nil
}

func newTracker(ctx workflow.Context, kind, instanceID, hostID string) (*tracker, error) {
	return newTrackerSA(ctx, kind, instanceID, hostID, "", false)
}

func newTrackerSA(ctx workflow.Context, kind, instanceID, hostID, firstStage string, lazy bool) (*tracker, error) {
	t := &tracker{
		kind:        kind,
		instanceID:  instanceID,
		hostID:      hostID,
		status:      &vmflowv1.WorkflowStatus{HostId: hostID},
		retryCh:     workflow.GetSignalChannel(ctx, RetrySignal),
		ops:         workflow.NewBufferedChannel(ctx, maxPendingOps),
		wfLogger:    workflow.GetLogger(ctx),
		lazy:        lazy,
		onlyChanges: lazy,
		since:       workflow.Now(ctx),
	}
	t.logger = t.baseLogger("host_id", hostID)
	if err := workflow.SetQueryHandler(ctx, StatusQuery, func() (*vmflowv1.WorkflowStatus, error) {
		return proto.Clone(t.status).(*vmflowv1.WorkflowStatus), nil
	}); err != nil {
		return nil, fmt.Errorf("register status query: %w", err)
	}
	if err := t.registerUpdates(ctx); err != nil {
		return nil, err
	}
	var sa []temporal.SearchAttributeUpdate
	if instanceID != "" {
		sa = append(sa, SAInstanceID.ValueSet(instanceID))
	}
	if hostID != "" {
		sa = append(sa, SAHostID.ValueSet(hostID))
	}
	if lazy {
		t.status.Stage, t.status.Attempt = firstStage, 1
		sa = append(sa, SAStage.ValueSet(firstStage), SANeedsAttention.ValueSet(false))
		workflow.SetCurrentDetails(ctx, t.details())
		// Set at start already (vmflow's client does): nothing to upsert.
		// The start's attributes are in the history: replay decides the same.
		start := workflow.GetTypedSearchAttributes(ctx)
		if v, _ := start.GetKeyword(SAInstanceID); v == instanceID || instanceID == "" {
			if h, _ := start.GetKeyword(SAHostID); h == hostID {
				st, _ := start.GetKeyword(SAStage)
				needs, ok := start.GetBool(SANeedsAttention)
				if st == firstStage && ok && !needs {
					sa = nil
				}
			}
		}
	}
	if len(sa) > 0 {
		if err := workflow.UpsertTypedSearchAttributes(ctx, sa...); err != nil {
			return nil, fmt.Errorf("set search attributes: %w", err)
		}
	}
	if lazy {
		t.upserted, t.sentStage, t.sentNeeds = true, firstStage, false
	}
	return t, nil
}

// baseLogger is the workflow's logger with the instance id and kv.
func (t *tracker) baseLogger(kv ...any) log.Logger {
	return log.With(t.wfLogger, append([]any{"instance_id", t.instanceID}, kv...)...)
}

// stage moves the workflow to a new stage; the attempt count starts again.
func (t *tracker) stage(ctx workflow.Context, stage string) {
	if t.status.Stage == stage {
		return
	}
	t.status.Stage = stage
	t.status.Attempt = 1
	t.status.NextRetryTime = ""
	t.since = workflow.Now(ctx)
	t.publishSA(ctx, terminalStage(stage))
	t.logger.Info("stage", "stage", stage)
}

// failed records a failure that the workflow will retry at next.
func (t *tracker) failed(ctx workflow.Context, stage string, err error, attempt uint32, next time.Time) {
	t.attention(ctx, stage, errorText(err), attempt, next)
}

// attention shows stage needing attention with text as its last error; a zero
// next means no retry is scheduled.
func (t *tracker) attention(ctx workflow.Context, stage, text string, attempt uint32, next time.Time) {
	t.status.Stage = stage
	t.status.Attempt = attempt
	t.status.LastError = text
	t.status.NeedsAttention = true
	t.status.NextRetryTime = ""
	if !next.IsZero() {
		t.status.NextRetryTime = next.UTC().Format(time.RFC3339)
	}
	t.publishSA(ctx, true) // the workflow waits, or starts a stuck round
	t.logger.Warn("needs attention", "stage", stage, "attempt", attempt, "error", t.status.LastError,
		"next_retry_time", t.status.NextRetryTime)
}

// recovered clears needs-attention once the failing step went through.
func (t *tracker) recovered(ctx workflow.Context) {
	if !t.status.NeedsAttention {
		return
	}
	t.status.NeedsAttention = false
	t.status.NextRetryTime = ""
	// The failure is behind us; status says what is wrong now, and the
	// history keeps what went wrong before.
	t.status.LastError = ""
	t.publish(ctx)
}

func (t *tracker) setRetained(ctx workflow.Context, retained bool) {
	if t.status.MetadataRetained == retained {
		return
	}
	t.status.MetadataRetained = retained
	t.publish(ctx)
}

// terminalStage: a stage a workflow ends in, whose VmStage must be exact.
func terminalStage(stage string) bool {
	switch stage {
	case StageRunning, StageSpawnFailed, StageDeleted, StageAlreadyAbsent, StageNotOwned, StageAbandoned, StageReconciled:
		return true
	}
	return false
}

// publish refreshes Current Details and, unless the tracker is lazy,
// the search attributes.
func (t *tracker) publish(ctx workflow.Context) {
	t.publishSA(ctx, false)
}

// publishSA publishes; exact means the search attributes must match now (a
// wait or the end), else a lazy tracker upserts only on an attention change.
func (t *tracker) publishSA(ctx workflow.Context, exact bool) {
	// Current Details is workflow metadata, not a command: it is always
	// refreshed, so the attempt and last error stay current for free.
	workflow.SetCurrentDetails(ctx, t.details())
	if t.onlyChanges && t.upserted && t.sentStage == t.status.Stage && t.sentNeeds == t.status.NeedsAttention {
		return
	}
	if t.lazy && !exact && t.sentNeeds == t.status.NeedsAttention {
		return
	}
	if err := workflow.UpsertTypedSearchAttributes(ctx,
		SAStage.ValueSet(t.status.Stage),
		SANeedsAttention.ValueSet(t.status.NeedsAttention),
	); err != nil {
		t.logger.Warn("upsert search attributes failed", "error", err.Error())
		return
	}
	t.upserted, t.sentStage, t.sentNeeds = true, t.status.Stage, t.status.NeedsAttention
}

// details is the Current Details markdown the Web UI shows between
// activity attempts, when the pending-activity card is gone.
func (t *tracker) details() string {
	var b strings.Builder
	if t.hostID == "" {
		b.WriteString(fmt.Sprintf("**%s** %s, placing\n\n", t.kind, codeSpan(t.instanceID)))
	} else {
		b.WriteString(fmt.Sprintf("**%s** %s on host %s\n\n", t.kind, codeSpan(t.instanceID), codeSpan(t.hostID)))
	}
	b.WriteString(fmt.Sprintf("- stage: %s\n", codeSpan(t.status.Stage)))
	for _, h := range t.status.GetHostsTried() {
		b.WriteString(fmt.Sprintf("- host tried: %s\n", codeSpan(h)))
	}
	if t.status.Attempt > 1 || t.status.LastError != "" {
		b.WriteString(fmt.Sprintf("- attempt: %d\n", t.status.Attempt))
	}
	if t.status.LastError != "" {
		// QMP error text from a hostile QEMU, guest serial output, an
		// operator's reason: shown as text, never as markup.
		b.WriteString(fmt.Sprintf("- last error: %s\n", codeSpan(t.status.LastError)))
	}
	if t.status.NextRetryTime != "" {
		b.WriteString(fmt.Sprintf("- next retry: %s (or now: `temporal workflow update execute --workflow-id <id> --name retry`)\n", codeSpan(t.status.NextRetryTime)))
	}
	if t.status.MetadataRetained {
		b.WriteString("- metadata retained: the instance record and its GPU claim are kept on the host\n")
	}
	if t.status.NeedsAttention {
		b.WriteString("- **needs attention**\n")
	}
	return b.String()
}

// codeSpan is s as one CommonMark code span, where nothing is markup, so any
// text shows as its characters.
func codeSpan(s string) string {
	if s == "" {
		return ""
	}
	s = strings.Map(func(r rune) rune {
		switch {
		case r == '\n' || r == '\r' || r == '\t':
			// A line break would end the span's paragraph and start blocks.
			return ' '
		case unicode.IsControl(r), bidiControl(r):
			// Terminal escapes, NUL, and reordering of what an operator reads.
			return unicode.ReplacementChar
		}
		return r
	}, strings.ToValidUTF8(s, string(unicode.ReplacementChar)))
	run, longest := 0, 0
	for _, r := range s {
		if r != '`' {
			run = 0
			continue
		}
		run++
		longest = max(longest, run)
	}
	fence := strings.Repeat("`", longest+1)
	// The renderer strips one space on each side.
	if strings.HasPrefix(s, "`") || strings.HasSuffix(s, "`") || strings.HasPrefix(s, " ") || strings.HasSuffix(s, " ") {
		s = " " + s + " "
	}
	return fence + s + fence
}

// bidiControl: the Unicode controls that reorder text on display (the
// embeddings, overrides and isolates, and the marks).
func bidiControl(r rune) bool {
	return (r >= '\u202a' && r <= '\u202e') || (r >= '\u2066' && r <= '\u2069') || r == '\u200e' || r == '\u200f' || r == '\u061c'
}

// drainRetries consumes retry signals already delivered, so a continue-as-new
// leaves none behind; the new run tries at once anyway.
func (t *tracker) drainRetries() int {
	n := 0
	for {
		var sig vmflowv1.RetrySignal
		if !t.retryCh.ReceiveAsync(&sig) {
			return n
		}
		n++
	}
}

// backoff returns base * 2^(attempt-1), capped at max.
func backoff(base, max time.Duration, attempt uint32) time.Duration {
	d := base
	for i := uint32(1); i < attempt && d < max; i++ {
		d *= 2
	}
	return min(d, max)
}
