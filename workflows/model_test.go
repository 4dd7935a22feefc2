package workflows

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/mock"
	"github.com/yuin/goldmark"
	"github.com/yuin/goldmark/extension"
	enumspb "go.temporal.io/api/enums/v1"
	sdkpb "go.temporal.io/api/sdk/v1"
	sdklog "go.temporal.io/sdk/log"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"
	"pgregory.net/rapid"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// A model of DeleteInstance: rapid draws a host (who created the record,
// whether it holds a vGPU claim, whether the delete is a failed spawn's
// clean-up), a sequence of activity outcomes of every class (success,
// retryable and non-retryable errors of each type the host returns, a host
// that does not pick up, an attempt that times out after doing its work),
// and operator and host events at random times: retry and abandon as
// signals and as updates, continue-as-new suggested, the record turning
// unreadable and repaired, an agent of the previous build (which answers
// not-owned for a record it cannot read). The SDK's test environment runs
// the real workflow against a fake host that applies each outcome to its
// state; a run that continues as new is followed by the next run, started
// from the carried input as the server would. After every step (each
// event, each activity attempt seen by the next event) the checks below
// hold; then the host turns healthy and retry is sent until the delete
// ends, and the end is checked.
//
// VMFLOW_WORKFLOW_MODEL_CHECKS sets rapid's checks (make fuzz); a failure
// prints a -rapid.seed that replays it.
const workflowModelChecksEnv = "VMFLOW_WORKFLOW_MODEL_CHECKS"

// workflowModelChecks keeps make test short (a few seconds).
const workflowModelChecks = 60

var modelErrTypes = []struct {
	typ          string
	nonRetryable bool
}{
	{ErrTypeHost, false}, {ErrTypeBusy, false}, {ErrTypeStillAlive, false}, {ErrTypeReleaseFailed, false}, {ErrTypeClaimHeld, false},
	{ErrTypeIdentityMismatch, true}, {ErrTypeVGPUUnavailable, true}, {ErrTypeDeviceClaimedTwice, true}, {ErrTypeAmbiguousQEMU, true},
	{ErrTypeRecordUnreadable, true},
}

type outcomeKind int

const (
	outOK outcomeKind = iota
	outAppErr
	outUnreachable // ScheduleToStart: no agent picked it up
	outTimeout     // StartToClose: the attempt did its work, the answer was lost
)

type outcome struct {
	kind    outcomeKind
	errType int  // index into modelErrTypes
	hostile bool // the error text carries markdown and controls
}

type eventKind int

const (
	evRetrySignal eventKind = iota
	evRetryUpdate
	evAbandonSignal
	evAbandonSignalNoReason
	evAbandonUpdate
	evSuggestCAN
	evTear
	evRepair
	evOldAgent
	evNewAgent
	evLook
	evKinds
)

var eventNames = [...]string{"retry-signal", "retry-update", "abandon-signal", "abandon-signal-no-reason", "abandon-update",
	"suggest-continue-as-new", "record-unreadable", "record-repaired", "old-agent", "new-agent", "look"}

type event struct {
	at   time.Duration // since the delete started
	kind eventKind
}

// modelHost is the host's state as the fake activities keep it.
type modelHost struct {
	exists, ours, claim, vmAlive, marker, deleting bool
	torn, oldAgent                                 bool
}

// call is one activity attempt the fake host answered.
type call struct {
	activity string
	at       time.Time
	ok       bool
	nonRetry bool   // a non-retryable error: runStage parks on it
	msg      string // the error's text, unique per failure
	notOwned bool
}

type model struct {
	t        *rapid.T
	mu       sync.Mutex
	host     modelHost
	cleanup  bool
	outcomes []outcome
	next     int
	calls    []call
	failures map[string]bool // every error text the host gave
	owned    bool            // a BeginDelete of this delete found the record its own
	steps    int
	stats    map[string]int
	updates  []*modelUpdate
	start    time.Time
	bound    time.Duration
	drainAt  time.Duration
	env      *env // the run's, for its clock
	// lastStage: the stage the last check saw.
	lastStage string
}

type modelUpdate struct {
	name     string
	sentAt   time.Time
	outcome  *updateOutcome
	stage    string // the stage when it was sent
	terminal bool
}

func TestWorkflowModel(t *testing.T) {
	if err := setWorkflowModelChecks(); err != nil {
		t.Fatal(err)
	}
	var checks, steps, runs int
	stats := map[string]int{}
	began := time.Now()
	rapid.Check(t, func(rt *rapid.T) {
		checks++
		m := newModel(rt, stats)
		runs += m.run()
		steps += m.steps
	})
	keys := make([]string, 0, len(stats))
	for k := range stats {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%d", k, stats[k])
	}
	t.Logf("workflow model: %d checks, %d runs, %d steps in %s; seen:%s", checks, runs, steps, time.Since(began).Round(time.Millisecond), b.String())
}

// setWorkflowModelChecks applies VMFLOW_WORKFLOW_MODEL_CHECKS (or the short
// default) unless -rapid.checks or RAPID_CHECKS chose a count.
func setWorkflowModelChecks() error {
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !set["rapid.nofailfile"] && os.Getenv("RAPID_NOFAILFILE") == "" {
		if err := flag.Set("rapid.nofailfile", "true"); err != nil {
			return err
		}
	}
	if set["rapid.checks"] || os.Getenv("RAPID_CHECKS") != "" {
		return nil
	}
	n := workflowModelChecks
	if v := os.Getenv(workflowModelChecksEnv); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n <= 0 {
			return fmt.Errorf("%s=%q: want a positive number", workflowModelChecksEnv, v)
		}
	}
	return flag.Set("rapid.checks", strconv.Itoa(n))
}

func newModel(t *rapid.T, stats map[string]int) *model {
	m := &model{t: t, failures: map[string]bool{}, stats: stats, bound: DefaultConfig().DeleteStuckAfter}
	m.cleanup = rapid.Bool().Draw(t, "cleanup")
	m.host = modelHost{exists: rapid.IntRange(0, 9).Draw(t, "exists") > 0, ours: true, claim: rapid.Bool().Draw(t, "claim"), vmAlive: true}
	if m.cleanup {
		m.host.ours = rapid.IntRange(0, 4).Draw(t, "ours") > 0
	}
	gen := rapid.Custom(func(t *rapid.T) outcome {
		o := outcome{}
		switch k := rapid.IntRange(0, 9).Draw(t, "kind"); {
		case k < 4:
			o.kind = outOK
		case k < 8:
			o.kind = outAppErr
		case k < 9:
			o.kind = outUnreachable
		default:
			o.kind = outTimeout
		}
		o.errType = rapid.IntRange(0, len(modelErrTypes)-1).Draw(t, "type")
		o.hostile = rapid.IntRange(0, 7).Draw(t, "hostile") == 0
		return o
	})
	n := rapid.IntRange(0, 80).Draw(t, "outcome_count")
	m.outcomes = rapid.SliceOfN(gen, n, n).Draw(t, "outcomes")
	return m
}

// drawEvents draws the operator and host events, sorted by time.
func (m *model) drawEvents() []event {
	// Most in the first minutes, where a delete spends its steps; some
	// hours later, in long waits.
	scales := []int{60, 600, 3600, 4 * 3600}
	gen := rapid.Custom(func(t *rapid.T) event {
		scale := scales[rapid.IntRange(0, len(scales)-1).Draw(t, "scale")]
		return event{
			at:   time.Duration(rapid.IntRange(1, scale).Draw(t, "at")) * time.Second,
			kind: eventKind(rapid.IntRange(0, int(evKinds)-1).Draw(t, "event")),
		}
	})
	n := rapid.IntRange(0, 30).Draw(m.t, "event_count")
	evs := rapid.SliceOfN(gen, n, n).Draw(m.t, "events")
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].at < evs[j].at })
	return evs
}

// run drives the delete through all its runs; it returns how many.
func (m *model) run() int {
	evs := m.drawEvents()
	m.drainAt = 4*time.Hour + time.Minute
	// The drain: the host turns healthy; retry every 20 minutes.
	const drains = 12
	for i := 0; i < drains; i++ {
		evs = append(evs, event{at: m.drainAt + time.Duration(i)*20*time.Minute, kind: evRetrySignal})
	}
	req := &vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1"}
	if m.cleanup {
		req.OnlyIfCreatedByWorkflowId, req.OnlyIfCreatedByRunId = "spawn/vm1", "run-1"
	}
	m.start = time.Date(2026, 12, 1, 20, 0, 0, 0, time.UTC)
	now := m.start
	fired := 0
	for runs := 1; ; runs++ {
		if runs > 50 {
			m.t.Fatalf("more than 50 runs: continue-as-new loops")
		}
		e, res, next, end := m.runOnce(req, now, evs, &fired)
		m.checkAnswered()
		if next == nil {
			m.checkEnd(e, res)
			return runs
		}
		m.stats["continue-as-new"]++
		req, now = next, end
	}
}

// runOnce runs one run from start with the events not yet fired; it
// returns the result, or the carried input when the run continued as new.
func (m *model) runOnce(req *vmflowv1.DeleteRequest, start time.Time, evs []event, fired *int) (*env, *vmflowv1.DeleteResult, *vmflowv1.DeleteRequest, time.Time) {
	var s testsuite.WorkflowTestSuite
	s.SetLogger(sdklog.NewStructuredLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	e := &env{TestWorkflowEnvironment: s.NewTestWorkflowEnvironment(), lastSeen: map[string]any{}}
	New(Config{}).Register(e)
	e.RegisterActivity(&stubHost{})
	e.OnUpsertTypedSearchAttributes(mock.Anything).Return(nil).Maybe()
	e.SetStartTime(start)
	e.SetTestTimeout(20 * time.Second)
	m.env = e
	m.mockHost(e)
	for i := *fired; i < len(evs); i++ {
		ev, idx := evs[i], i
		// Not before the run's first workflow task has run.
		d := max(m.start.Add(ev.at).Sub(start), time.Second)
		e.RegisterDelayedCallback(func() {
			*fired = idx + 1
			m.apply(e, ev)
			m.check(e)
		}, d)
	}
	e.ExecuteWorkflow(DeleteWorkflow, req)
	if !e.IsWorkflowCompleted() {
		m.t.Fatalf("the delete did not end on a healthy host after %d retries (last stage %q)", 12, m.lastStage)
	}
	err := e.GetWorkflowError()
	var can *workflow.ContinueAsNewError
	if errors.As(err, &can) {
		var next vmflowv1.DeleteRequest
		if err := converterFor(nil).FromPayloads(can.Input, &next); err != nil {
			m.t.Fatalf("decode the carried input: %v", err)
		}
		return e, nil, &next, e.Now()
	}
	if err != nil {
		m.t.Fatalf("the delete failed (it never may): %v", err)
	}
	var res vmflowv1.DeleteResult
	if err := e.GetWorkflowResult(&res); err != nil {
		m.t.Fatalf("result: %v", err)
	}
	return e, &res, nil, e.Now()
}

func (m *model) apply(e *env, ev event) {
	m.mu.Lock()
	m.steps++
	m.stats[eventNames[ev.kind]]++
	if ev.at >= m.drainAt {
		m.host.torn, m.host.oldAgent, m.next = false, false, len(m.outcomes)
	}
	m.mu.Unlock()
	switch ev.kind {
	case evRetrySignal:
		e.SignalWorkflow(RetrySignal, &vmflowv1.RetrySignal{Reason: "model"})
	case evAbandonSignal:
		e.SignalWorkflow(AbandonSignal, &vmflowv1.AbandonSignal{Reason: "model: host gone"})
	case evAbandonSignalNoReason:
		e.SignalWorkflow(AbandonSignal, &vmflowv1.AbandonSignal{})
	case evRetryUpdate, evAbandonUpdate:
		name, arg := RetryUpdate, any(&vmflowv1.RetrySignal{Reason: "model"})
		if ev.kind == evAbandonUpdate {
			name, arg = AbandonUpdate, &vmflowv1.AbandonSignal{Reason: "model: host gone"}
		}
		st := m.status(e)
		u := &modelUpdate{name: name, sentAt: e.Now(), stage: st.GetStage(), terminal: terminalStage(st.GetStage())}
		u.outcome = e.update(name, arg)
		m.updates = append(m.updates, u)
	case evSuggestCAN:
		e.SetContinueAsNewSuggested(true)
	case evTear, evRepair, evOldAgent, evNewAgent:
		m.mu.Lock()
		switch ev.kind {
		case evTear:
			m.host.torn = m.host.exists
		case evRepair:
			m.host.torn = false
		case evOldAgent:
			m.host.oldAgent = true
		case evNewAgent:
			m.host.oldAgent = false
		}
		m.mu.Unlock()
	}
}

func (m *model) status(e *env) *vmflowv1.WorkflowStatus {
	v, err := e.QueryWorkflow(StatusQuery)
	if err != nil {
		m.t.Fatalf("query status: %v", err)
	}
	var st vmflowv1.WorkflowStatus
	if err := v.Get(&st); err != nil {
		m.t.Fatalf("decode status: %v", err)
	}
	return &st
}

// check runs the checks that hold at every step.
func (m *model) check(e *env) {
	st := m.status(e)
	m.lastStage = st.GetStage()
	m.mu.Lock()
	defer m.mu.Unlock()
	now := e.Now()
	var last *call
	if len(m.calls) > 0 {
		last = &m.calls[len(m.calls)-1]
	}
	// Parked: the last answer was one only an operator can change, and no
	// attempt came since.
	parked := last != nil && !last.ok && last.nonRetry && last.activity != ActivityReleaseVGPU ||
		last != nil && last.notOwned && m.owned
	waiting := st.GetStage() == StageReleaseFailed || st.GetStage() == StageHostUnreachable
	var failingSince time.Time
	for i := len(m.calls) - 1; i >= 0 && !m.calls[i].ok; i-- {
		failingSince = m.calls[i].at
	}
	// A stage's round runs out at the stuck bound (or one pickup and one
	// whole attempt, when longer), and then shows; a retry interval (a
	// minute at most) of slack.
	stuck := false
	if !failingSince.IsZero() {
		c := New(Config{}).calls()[last.activity]
		round := max(m.bound, DefaultConfig().ScheduleToStartTimeout+c.timeout)
		stuck = now.Sub(failingSince) > round+2*time.Minute
	}
	if terminalStage(st.GetStage()) {
		return
	}
	switch {
	case (parked || waiting || stuck) && !st.GetNeedsAttention():
		m.t.Fatalf("at %s: waits on an operator or is stuck (parked %v, stage %s, failing since %s) without needs_attention; status %v",
			now.Sub(m.start), parked, st.GetStage(), failingSince.Sub(m.start), st)
	case last != nil && last.ok && !last.notOwned && st.GetNeedsAttention() && !waiting:
		m.t.Fatalf("at %s: needs_attention after %s succeeded; status %v", now.Sub(m.start), last.activity, st)
	}
	if st.GetNeedsAttention() {
		if st.GetLastError() == "" {
			m.t.Fatalf("at %s: needs_attention without a last error; status %v", now.Sub(m.start), st)
		}
		if !m.carriesFailure(st.GetLastError()) {
			m.t.Fatalf("at %s: last error %q names no failure the host gave", now.Sub(m.start), st.GetLastError())
		}
	}
	m.checkDetails(e)
}

// carriesFailure: text quotes an error the host gave, or says the host did
// not pick up, or the not-owned answer of a delete that owned the record.
func (m *model) carriesFailure(text string) bool {
	if strings.Contains(text, "did not pick up") || strings.Contains(text, "when it began") || strings.Contains(text, "timeout (") {
		return true
	}
	for f := range m.failures {
		if strings.Contains(text, f) {
			return true
		}
	}
	return false
}

var modelMarkdown = goldmark.New(goldmark.WithExtensions(extension.GFM))

// checkDetails renders Current Details: a hostile error text adds no
// markup.
func (m *model) checkDetails(e *env) {
	v, err := e.QueryWorkflow("__temporal_workflow_metadata")
	if err != nil {
		m.t.Fatalf("query metadata: %v", err)
	}
	var md sdkpb.WorkflowMetadata
	if err := v.Get(&md); err != nil {
		m.t.Fatalf("decode metadata: %v", err)
	}
	var out bytes.Buffer
	if err := modelMarkdown.Convert([]byte(md.GetCurrentDetails()), &out); err != nil {
		m.t.Fatalf("render details: %v", err)
	}
	for _, tag := range []string{"<a ", "<img", "<h1", "<script", "<em>"} {
		if strings.Contains(out.String(), tag) {
			m.t.Fatalf("Current Details renders %s from an error text:\n%s", tag, md.GetCurrentDetails())
		}
	}
}

// checkAnswered: every accepted update was answered, a retry at the
// instant it was sent (it ends a wait, or a try runs already), and a
// retry is refused only in a workflow's last stage.
func (m *model) checkAnswered() {
	for _, u := range m.updates {
		o := u.outcome
		if o.accepted && !o.done {
			m.t.Fatalf("%s update accepted at %s never answered", u.name, u.sentAt.Sub(m.start))
		}
		if u.name != RetryUpdate {
			continue
		}
		if o.rejected != nil && !u.terminal {
			m.t.Fatalf("retry update refused in stage %s: %v", u.stage, o.rejected)
		}
		if o.accepted && !o.at.Equal(u.sentAt) {
			m.t.Fatalf("retry update sent at %s answered only at %s", u.sentAt.Sub(m.start), o.at.Sub(m.start))
		}
	}
	m.updates = nil
}

// checkEnd checks the delete's end.
func (m *model) checkEnd(e *env, res *vmflowv1.DeleteResult) {
	st := m.status(e)
	m.stats["end-"+st.GetStage()]++
	switch {
	case res.GetNotOwned() && m.owned:
		m.t.Fatalf("completed not-owned after it owned the record; status %v", st)
	case res.GetAbandoned():
		if st.GetStage() != StageAbandoned || !strings.Contains(st.GetLastError(), "abandoned") || res.GetAbandonReason() == "" {
			m.t.Fatalf("abandoned without saying so: result %v, status %v", res, st)
		}
	case res.GetNotOwned():
		if m.host.ours && m.host.exists && !m.host.torn {
			m.t.Fatalf("completed not-owned on its own readable record; status %v", st)
		}
	default:
		if m.host.exists && m.host.claim {
			m.t.Fatalf("completed %s while the host record holds a claim; status %v", st.GetStage(), st)
		}
		if st.GetStage() == StageDeleted && m.host.exists {
			m.t.Fatalf("completed deleted with the record still on the host; status %v", st)
		}
	}
	if st.GetNeedsAttention() {
		m.t.Fatalf("ended needing attention; status %v", st)
	}
}

// mockHost answers every host activity from the fake host and the drawn
// outcomes.
func (m *model) mockHost(e *env) {
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(
		func(_ context.Context, req *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
			var res *vmflowv1.BeginDeleteResult
			err := m.attempt(ActivityBeginDelete, func(hs *modelHost) error {
				if !hs.exists {
					res = &vmflowv1.BeginDeleteResult{AlreadyAbsent: true}
					return nil
				}
				if req.GetOnlyIfCreatedByWorkflowId() != "" {
					switch {
					case hs.torn && hs.oldAgent:
						res = &vmflowv1.BeginDeleteResult{NotOwned: true, CreatedBy: "unknown (the record cannot be read)"}
						return nil
					case hs.torn:
						return m.unreadable()
					case !hs.ours:
						res = &vmflowv1.BeginDeleteResult{NotOwned: true, CreatedBy: "spawn/vm1 (run run-0)"}
						return nil
					}
				}
				hs.marker = true
				if hs.torn {
					return m.unreadable()
				}
				hs.deleting = true
				res = &vmflowv1.BeginDeleteResult{HasClaim: hs.claim}
				return nil
			})
			if err == nil {
				m.mu.Lock()
				c := &m.calls[len(m.calls)-1]
				c.notOwned = res.GetNotOwned()
				if !res.GetNotOwned() && !res.GetAlreadyAbsent() && req.GetOnlyIfCreatedByWorkflowId() != "" {
					m.owned = true
				}
				m.mu.Unlock()
			}
			return res, err
		})
	recordStep := func(name string, do func(hs *modelHost) error) error {
		return m.attempt(name, func(hs *modelHost) error {
			if !hs.exists {
				return nil
			}
			if hs.torn {
				return m.unreadable()
			}
			return do(hs)
		})
	}
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
			err := recordStep(ActivityStopVM, func(hs *modelHost) error { hs.vmAlive = false; return nil })
			if err != nil {
				return nil, err
			}
			return &vmflowv1.StopVMResult{StepReached: "quit"}, nil
		})
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.InstanceRef) error {
			return recordStep(ActivityWaitVMExit, func(hs *modelHost) error {
				if hs.vmAlive {
					return m.fail(ErrTypeStillAlive, false, "thread group still present")
				}
				return nil
			})
		})
	e.OnActivity(h.ReleaseVGPU, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
			had := false
			err := recordStep(ActivityReleaseVGPU, func(hs *modelHost) error {
				if hs.vmAlive {
					return m.fail(ErrTypeReleaseFailed, false, "VM may be alive")
				}
				had, hs.claim = hs.claim, false
				return nil
			})
			if err != nil {
				return nil, err
			}
			return &vmflowv1.ReleaseVGPUResult{Released: had}, nil
		})
	e.OnActivity(h.TearDown, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.InstanceRef) error {
			return recordStep(ActivityTearDown, func(*modelHost) error { return nil })
		})
	e.OnActivity(h.DeleteRecord, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.InstanceRef) error {
			return recordStep(ActivityDeleteRecord, func(hs *modelHost) error {
				if hs.claim {
					return m.fail(ErrTypeClaimHeld, false, "record still holds a vGPU claim")
				}
				hs.exists = false
				return nil
			})
		})
}

// attempt answers one activity attempt: the next drawn outcome, applied to
// the host through do (which may refuse by the host's state).
func (m *model) attempt(name string, do func(hs *modelHost) error) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	o := outcome{kind: outOK}
	if m.next < len(m.outcomes) {
		o = m.outcomes[m.next]
		m.next++
	}
	m.stats[name]++
	c := call{activity: name}
	var err error
	switch o.kind {
	case outOK:
		err = do(&m.host)
	case outAppErr:
		et := modelErrTypes[o.errType]
		err = m.failText(et.typ, et.nonRetryable, "injected", o.hostile)
	case outUnreachable:
		m.stats["unreachable"]++
		err = temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)
	case outTimeout:
		m.stats["timeout-after-work"]++
		_ = do(&m.host)
		err = temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_START_TO_CLOSE, nil)
	}
	c.ok = err == nil
	var ae *temporal.ApplicationError
	if errors.As(err, &ae) {
		c.nonRetry = ae.NonRetryable()
		c.msg = ae.Message()
		m.stats["err-"+ae.Type()]++
	}
	c.at = m.env.Now()
	m.calls = append(m.calls, c)
	m.steps++
	return err
}

func (m *model) unreadable() error {
	return m.fail(ErrTypeRecordUnreadable, true, "record /var/lib/vmflow/instances/vm1/record.json: unexpected EOF")
}

// fail is a host error with a text unique to it (called with m.mu held).
func (m *model) fail(typ string, nonRetryable bool, what string) error {
	return m.failText(typ, nonRetryable, what, false)
}

func (m *model) failText(typ string, nonRetryable bool, what string, hostile bool) error {
	msg := fmt.Sprintf("%s (fault %d)", what, len(m.failures)+1)
	if hostile {
		msg += " qmp: [fix](https://evil.example/) ![t](https://evil.example/t.png) <img src=x onerror=alert(1)>\n\n# owned\n*x*"
	}
	m.failures[strings.SplitN(msg, "\n", 2)[0]] = true
	return temporal.NewApplicationErrorWithOptions(msg, typ, temporal.ApplicationErrorOptions{NonRetryable: nonRetryable})
}
