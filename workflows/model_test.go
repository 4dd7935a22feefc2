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
	historypb "go.temporal.io/api/history/v1"
	sdkpb "go.temporal.io/api/sdk/v1"
	"go.temporal.io/sdk/client"
	sdklog "go.temporal.io/sdk/log"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
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
const workflowModelChecks = 300

// drains is how many retries the healthy host gets to finish a delete.
const drains = 12

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

// scenario is one drawn sequence: the host, the delete, the activity
// outcomes in the order attempts consume them, and timed events.
type scenario struct {
	cleanup  bool // a failed spawn's clean-up (only_if_created_by_*)
	host     modelHost
	outcomes []outcome
	events   []event // sorted by time
}

var scenarios = rapid.Custom(func(t *rapid.T) scenario {
	sc := scenario{cleanup: rapid.Bool().Draw(t, "cleanup")}
	sc.host = modelHost{exists: rapid.IntRange(0, 9).Draw(t, "exists") > 0, ours: true, claim: rapid.Bool().Draw(t, "claim"), vmAlive: true}
	if sc.cleanup {
		sc.host.ours = rapid.IntRange(0, 4).Draw(t, "ours") > 0
	}
	outcomes := rapid.Custom(func(t *rapid.T) outcome {
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
	sc.outcomes = rapid.SliceOfN(outcomes, n, n).Draw(t, "outcomes")
	// Most events in the first minutes, where a delete spends its steps;
	// some hours later, in long waits.
	scales := []int{60, 600, 3600, 4 * 3600}
	events := rapid.Custom(func(t *rapid.T) event {
		scale := scales[rapid.IntRange(0, len(scales)-1).Draw(t, "scale")]
		return event{
			at:   time.Duration(rapid.IntRange(1, scale).Draw(t, "at")) * time.Second,
			kind: eventKind(rapid.IntRange(0, int(evKinds)-1).Draw(t, "event")),
		}
	})
	n = rapid.IntRange(0, 30).Draw(t, "event_count")
	sc.events = rapid.SliceOfN(events, n, n).Draw(t, "events")
	sort.SliceStable(sc.events, func(i, j int) bool { return sc.events[i].at < sc.events[j].at })
	return sc
})

func (sc scenario) request() *vmflowv1.DeleteRequest {
	req := &vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1"}
	if sc.cleanup {
		req.OnlyIfCreatedByWorkflowId, req.OnlyIfCreatedByRunId = "spawn/vm1", "run-1"
	}
	return req
}

func newFakeHost(sc scenario, stats map[string]int, now func() time.Time) *fakeHost {
	return &fakeHost{state: sc.host, outcomes: sc.outcomes, failures: map[string]bool{}, stats: stats, now: now}
}

// model runs one scenario in the SDK's test environment.
type model struct {
	t       *rapid.T
	sc      scenario
	f       *fakeHost
	steps   int
	updates []*modelUpdate
	start   time.Time
	bound   time.Duration
	drainAt time.Duration
	env     *env // the current run's, for its clock
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
		m := &model{t: rt, sc: scenarios.Draw(rt, "scenario"), bound: Config{}.WithDefaults().DeleteStuckAfter}
		m.f = newFakeHost(m.sc, stats, func() time.Time { return m.env.Now() })
		runs += m.run()
		steps += m.steps + len(m.f.calls)
	})
	t.Logf("workflow model: %d checks, %d runs, %d steps (events and activity attempts) in %s; seen:%s",
		checks, runs, steps, time.Since(began).Round(time.Millisecond), formatStats(stats))
}

func formatStats(stats map[string]int) string {
	keys := make([]string, 0, len(stats))
	for k := range stats {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%d", k, stats[k])
	}
	return b.String()
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

// run drives the delete through all its runs; it returns how many.
func (m *model) run() int {
	evs := append([]event(nil), m.sc.events...)
	m.drainAt = 4*time.Hour + time.Minute
	// The drain: the host turns healthy; retry every 20 minutes.
	for i := 0; i < drains; i++ {
		evs = append(evs, event{at: m.drainAt + time.Duration(i)*20*time.Minute, kind: evRetrySignal})
	}
	req := m.sc.request()
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
		m.f.stats["continue-as-new"]++
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
	e.OnUpsertTypedSearchAttributes(mock.Anything).Return(nil).Maybe()
	e.SetStartTime(start)
	e.SetTestTimeout(20 * time.Second)
	m.env = e
	RegisterHostActivities(e, m.f)
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
		m.t.Fatalf("the delete did not end on a healthy host after %d retries (last stage %q)", drains, m.lastStage)
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
	f := m.f
	f.mu.Lock()
	m.steps++
	f.stats[eventNames[ev.kind]]++
	f.mu.Unlock()
	if ev.at >= m.drainAt {
		f.healthy()
	}
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
	default:
		f.hostEvent(ev.kind)
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

// check runs the checks that hold at every step. A violation is judged
// again a second later, three times: while an activity runs, the test
// environment fires its timers by the wall clock, so a callback may come
// while an attempt's result is on its way to the workflow (the host has
// answered, the workflow has not seen it); only one that lasts is a
// failure.
func (m *model) check(e *env) {
	m.checkDetails(e)
	m.recheck(e, 3)
}

func (m *model) recheck(e *env, left int) {
	v := m.violation(e)
	switch {
	case v == "":
	case left == 0:
		m.t.Fatalf("%s", v)
	default:
		e.RegisterDelayedCallback(func() { m.recheck(e, left-1) }, time.Second)
	}
}

// violation says which per-step check the workflow breaks now ("": none).
func (m *model) violation(e *env) string {
	st := m.status(e)
	m.lastStage = st.GetStage()
	f := m.f
	f.mu.Lock()
	defer f.mu.Unlock()
	now := e.Now()
	var last *call
	if len(f.calls) > 0 {
		last = &f.calls[len(f.calls)-1]
	}
	// Parked: the last answer was one only an operator can change, and no
	// attempt came since.
	parked := last != nil && !last.ok && last.nonRetry && last.activity != ActivityReleaseLeases ||
		last != nil && last.notOwned && f.owned
	waiting := st.GetStage() == StageReleaseFailed || st.GetStage() == StageHostUnreachable
	var failingSince time.Time
	for i := len(f.calls) - 1; i >= 0 && !f.calls[i].ok; i-- {
		failingSince = f.calls[i].at
	}
	// A stage's round runs out at the stuck bound (or one pickup and one
	// whole attempt, when longer), and then shows; a retry interval (a
	// minute at most) of slack.
	stuck := false
	if !failingSince.IsZero() {
		c := New(Config{}).calls()[last.activity]
		round := max(m.bound, Config{}.WithDefaults().ScheduleToStartTimeout+c.timeout)
		stuck = now.Sub(failingSince) > round+2*time.Minute
	}
	if terminalStage(st.GetStage()) {
		return ""
	}
	switch {
	case (parked || waiting || stuck) && !st.GetNeedsAttention():
		return fmt.Sprintf("at %s: waits on an operator or is stuck (parked %v, stage %s, failing since %s) without needs_attention; status %v",
			now.Sub(m.start), parked, st.GetStage(), failingSince.Sub(m.start), st)
	case last != nil && last.ok && !last.notOwned && st.GetNeedsAttention() && !waiting:
		return fmt.Sprintf("at %s: needs_attention after %s succeeded; status %v", now.Sub(m.start), last.activity, st)
	}
	if st.GetNeedsAttention() {
		if st.GetLastError() == "" {
			return fmt.Sprintf("at %s: needs_attention without a last error; status %v", now.Sub(m.start), st)
		}
		if !m.carriesFailure(st.GetLastError()) {
			return fmt.Sprintf("at %s: last error %q names no failure the host gave", now.Sub(m.start), st.GetLastError())
		}
	}
	return ""
}

// carriesFailure: text quotes an error the host gave, or says the host did
// not pick up, or the not-owned answer of a delete that owned the record.
func (m *model) carriesFailure(text string) bool {
	if strings.Contains(text, "did not pick up") || strings.Contains(text, "when it began") || strings.Contains(text, "timeout (") {
		return true
	}
	for msg := range m.f.failures {
		if strings.Contains(text, msg) {
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
	f := m.f
	f.stats["end-"+st.GetStage()]++
	switch {
	case res.GetNotOwned() && f.owned:
		m.t.Fatalf("completed not-owned after it owned the record; status %v", st)
	case res.GetAbandoned():
		if st.GetStage() != StageAbandoned || !strings.Contains(st.GetLastError(), "abandoned") || res.GetAbandonReason() == "" {
			m.t.Fatalf("abandoned without saying so: result %v, status %v", res, st)
		}
	case res.GetNotOwned():
		if f.state.ours && f.state.exists && !f.state.torn {
			m.t.Fatalf("completed not-owned on its own readable record; status %v", st)
		}
	default:
		if f.state.exists && f.state.claim {
			m.t.Fatalf("completed %s while the host record holds a claim; status %v", st.GetStage(), st)
		}
		if st.GetStage() == StageDeleted && f.state.exists {
			m.t.Fatalf("completed deleted with the record still on the host; status %v", st)
		}
	}
	if st.GetNeedsAttention() {
		m.t.Fatalf("ended needing attention; status %v", st)
	}
}

// fakeHost is the host behind the model's activities: its state, the
// drawn outcomes it answers with, and what it answered. It implements the
// host activities for the test environment and for a real worker alike.
type fakeHost struct {
	mu       sync.Mutex
	state    modelHost
	outcomes []outcome
	next     int
	calls    []call
	failures map[string]bool // every error text it gave (first line)
	owned    bool            // a BeginDelete of the clean-up found the record its own
	stats    map[string]int
	now      func() time.Time
}

var _ HostActivities = (*fakeHost)(nil)

var errNotModelled = errors.New("not part of the model")

func (*fakeHost) ValidateSpawn(context.Context, *vmflowv1.SpawnRequest) error { return errNotModelled }
func (*fakeHost) CreateRecord(context.Context, *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	return nil, errNotModelled
}
func (*fakeHost) ClaimDevices(context.Context, *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	return nil, errNotModelled
}
func (*fakeHost) LaunchVM(context.Context, *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	return nil, errNotModelled
}
func (*fakeHost) ReconcileHost(context.Context, *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	return nil, errNotModelled
}

// BeginDelete answers as the agent does: an agent of the previous build
// (oldAgent) says not-owned for a record it cannot read when the request
// names a creator; this build's says RecordUnreadable.
func (f *fakeHost) BeginDelete(_ context.Context, req *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	var res *vmflowv1.BeginDeleteResult
	err := f.attempt(ActivityBeginDelete, func(hs *modelHost) error {
		res = nil
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
				return f.unreadable()
			case !hs.ours:
				res = &vmflowv1.BeginDeleteResult{NotOwned: true, CreatedBy: "spawn/vm1 (run run-0)"}
				return nil
			}
		}
		hs.marker = true
		if hs.torn {
			return f.unreadable()
		}
		hs.deleting = true
		res = &vmflowv1.BeginDeleteResult{HasClaim: hs.claim}
		return nil
	})
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.calls[len(f.calls)-1].notOwned = res.GetNotOwned()
	if !res.GetNotOwned() && !res.GetAlreadyAbsent() && req.GetOnlyIfCreatedByWorkflowId() != "" {
		f.owned = true
	}
	f.mu.Unlock()
	return res, nil
}

func (f *fakeHost) StopVM(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	if err := f.recordStep(ActivityStopVM, func(hs *modelHost) error { hs.vmAlive = false; return nil }); err != nil {
		return nil, err
	}
	return &vmflowv1.StopVMResult{StepReached: "quit"}, nil
}

func (f *fakeHost) WaitVMExit(context.Context, *vmflowv1.InstanceRef) error {
	return f.recordStep(ActivityWaitVMExit, func(hs *modelHost) error {
		if hs.vmAlive {
			return f.fail(ErrTypeStillAlive, false, "thread group still present", false)
		}
		return nil
	})
}

func (f *fakeHost) ReleaseLeases(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	had := false
	err := f.recordStep(ActivityReleaseLeases, func(hs *modelHost) error {
		if hs.vmAlive {
			return f.fail(ErrTypeReleaseFailed, false, "the VM may be alive", false)
		}
		had, hs.claim = hs.claim, false
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &vmflowv1.ReleaseVGPUResult{Released: had}, nil
}

func (f *fakeHost) TearDown(context.Context, *vmflowv1.InstanceRef) error {
	return f.recordStep(ActivityTearDown, func(*modelHost) error { return nil })
}

// DeleteRecord refuses while the record holds a claim, as the store does
// (invariant 1).
func (f *fakeHost) DeleteRecord(context.Context, *vmflowv1.InstanceRef) error {
	return f.recordStep(ActivityDeleteRecord, func(hs *modelHost) error {
		if hs.claim {
			return f.fail(ErrTypeClaimHeld, false, "the record still holds a vGPU claim", false)
		}
		hs.exists = false
		return nil
	})
}

// recordStep is attempt for a step on an existing record: a missing one is
// done already, an unreadable one fails.
func (f *fakeHost) recordStep(name string, do func(hs *modelHost) error) error {
	return f.attempt(name, func(hs *modelHost) error {
		if !hs.exists {
			return nil
		}
		if hs.torn {
			return f.unreadable()
		}
		return do(hs)
	})
}

// attempt answers one activity attempt: the next drawn outcome, applied to
// the host through do (which may refuse by the host's state). Once the
// outcomes run out every attempt goes through.
func (f *fakeHost) attempt(name string, do func(hs *modelHost) error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	o := outcome{kind: outOK}
	if f.next < len(f.outcomes) {
		o = f.outcomes[f.next]
		f.next++
	}
	f.stats[name]++
	var err error
	switch o.kind {
	case outOK:
		err = do(&f.state)
	case outAppErr:
		et := modelErrTypes[o.errType]
		err = f.fail(et.typ, et.nonRetryable, "injected", o.hostile)
	case outUnreachable:
		f.stats["unreachable"]++
		err = temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)
	case outTimeout:
		f.stats["timeout-after-work"]++
		_ = do(&f.state)
		err = temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_START_TO_CLOSE, nil)
	}
	c := call{activity: name, ok: err == nil, at: f.now()}
	var ae *temporal.ApplicationError
	if errors.As(err, &ae) {
		c.nonRetry = ae.NonRetryable()
		c.msg = ae.Message()
		f.stats["err-"+ae.Type()]++
	}
	f.calls = append(f.calls, c)
	return err
}

// hostEvent applies a host event (the others change nothing here).
func (f *fakeHost) hostEvent(kind eventKind) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch kind {
	case evTear:
		f.state.torn = f.state.exists
	case evRepair:
		f.state.torn = false
	case evOldAgent:
		f.state.oldAgent = true
	case evNewAgent:
		f.state.oldAgent = false
	}
}

// healthy ends every fault: the record readable, this build's agent, every
// attempt going through.
func (f *fakeHost) healthy() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.state.torn, f.state.oldAgent, f.next = false, false, len(f.outcomes)
}

func (f *fakeHost) unreadable() error {
	return f.fail(ErrTypeRecordUnreadable, true, "record /var/lib/vmflow/instances/vm1/record.json: unexpected EOF", false)
}

// fail is a host error with a text unique to it (called with f.mu held);
// a hostile one carries markdown and a line break, as QMP error text from a
// hostile QEMU or guest output may.
func (f *fakeHost) fail(typ string, nonRetryable bool, what string, hostile bool) error {
	msg := fmt.Sprintf("%s (fault %d)", what, len(f.failures)+1)
	if hostile {
		msg += " qmp: [fix](https://evil.example/) ![t](https://evil.example/t.png) <img src=x onerror=alert(1)>\n\n# owned\n*x*"
	}
	f.failures[strings.SplitN(msg, "\n", 2)[0]] = true
	return temporal.NewApplicationErrorWithOptions(msg, typ, temporal.ApplicationErrorOptions{NonRetryable: nonRetryable})
}

// workflowModelReplaysEnv sets how many scenarios TestWorkflowModelReplays
// runs on the dev server.
const workflowModelReplaysEnv = "VMFLOW_WORKFLOW_MODEL_REPLAYS"

// TestWorkflowModelReplays runs a sample of the model's scenarios on the
// dev server, with the fake host as the host's real activity worker and
// the events sent by a real client (in order, the waits shortened), the
// server suggesting continue-as-new after 20 history events. Then it
// replays every run's history with WorkflowReplayer against the current
// code on workers with other flags: whatever path a scenario took
// (parks, abandon, continue-as-new with carried ownership, updates
// accepted while a round runs) replays deterministically.
func TestWorkflowModelReplays(t *testing.T) {
	n := 4
	if v := os.Getenv(workflowModelReplaysEnv); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n <= 0 {
			t.Fatalf("%s=%q: want a positive number", workflowModelReplaysEnv, v)
		}
	}
	srv := devserver.Start(t, devserver.Options{ExtraArgs: []string{
		"--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=20",
	}})
	c := srv.Client(t)
	cfg := Config{
		ReleaseBackoff: 100 * time.Millisecond, ReleaseBackoffMax: 200 * time.Millisecond,
		ScheduleToStartTimeout: 2 * time.Second,
		UnreachableBackoff:     100 * time.Millisecond, UnreachableBackoffMax: 200 * time.Millisecond,
		DeleteStuckAfter: 2 * time.Second, ActivityTimeoutCap: 5 * time.Second,
	}
	stats := map[string]int{}
	var ran, replayed, continued int
	// First a clean-up that owns its record, fails release rounds until
	// the server suggests continue-as-new, and whose continued run meets an
	// unreadable record through an agent of the previous build (the
	// not-owned answer it parks on); then random ones.
	releaseFails := outcome{kind: outAppErr, errType: 3}
	crafted := scenario{cleanup: true, host: modelHost{exists: true, ours: true, claim: true, vmAlive: true},
		outcomes: []outcome{{}, {}, {}, releaseFails, releaseFails, releaseFails},
		events:   []event{{kind: evTear}, {kind: evOldAgent}, {kind: evLook}, {kind: evLook}, {kind: evLook}, {kind: evLook}, {kind: evRetryUpdate}},
	}
	for seed := -1; ran < n; seed++ {
		sc := crafted
		if seed >= 0 {
			sc = scenarios.Example(seed)
		}
		// Short ones (the server runs in real time) with a failure or
		// two, so that they wait, park, or continue as new.
		failures := 0
		for _, o := range sc.outcomes {
			if o.kind != outOK {
				failures++
			}
		}
		if seed >= 0 && (len(sc.outcomes) > 12 || len(sc.events) > 10 || failures < 2) {
			continue
		}
		ran++
		host := newFakeHost(sc, stats, time.Now)
		hostID := fmt.Sprintf("model-%d", seed+1)
		queue := "vmflow-model-" + strconv.Itoa(seed+1)
		vc := startStack(t, c, queue, cfg, hostID, host)
		req := sc.request()
		req.HostId = hostID
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		run, err := vc.StartDelete(ctx, req)
		if err != nil {
			cancel()
			t.Fatalf("seed %d: start: %v", seed, err)
		}
		// Get follows continue-as-new and moves the run's id on with it.
		firstRun := run.GetRunID()
		done := make(chan error, 1)
		var res vmflowv1.DeleteResult
		go func() { done <- run.Get(ctx, &res) }()
		id := run.GetID()
		send := func(ev event) {
			host.hostEvent(ev.kind)
			uctx, ucancel := context.WithTimeout(ctx, 10*time.Second)
			defer ucancel()
			switch ev.kind {
			case evRetrySignal:
				_ = c.SignalWorkflow(uctx, id, "", RetrySignal, &vmflowv1.RetrySignal{Reason: "model"})
			case evAbandonSignal:
				_ = c.SignalWorkflow(uctx, id, "", AbandonSignal, &vmflowv1.AbandonSignal{Reason: "model: host gone"})
			case evAbandonSignalNoReason:
				_ = c.SignalWorkflow(uctx, id, "", AbandonSignal, &vmflowv1.AbandonSignal{})
			case evRetryUpdate:
				_, _ = vc.Retry(uctx, id, "model") // refused or answered: both are fine here
			case evAbandonUpdate:
				_, _ = vc.Abandon(uctx, req.GetInstanceId(), "model: host gone")
			}
		}
		ended := false
		wait := func(d time.Duration) bool {
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("seed %d: the delete failed: %v", seed, err)
				}
				ended = true
			case <-time.After(d):
			}
			return ended
		}
		// The crafted one's events a second apart: its first round (3 s)
		// ends after the record turned unreadable.
		gap := 200 * time.Millisecond
		if seed < 0 {
			gap = time.Second
		}
		for _, ev := range sc.events {
			if wait(gap) {
				break
			}
			send(ev)
		}
		// The drain: a healthy host, retry every two seconds.
		host.healthy()
		for i := 0; i < 60 && !wait(2*time.Second); i++ {
			send(event{kind: evRetrySignal})
		}
		if !ended {
			cancel()
			t.Fatalf("seed %d: the delete did not end on a healthy host", seed)
		}
		if seed < 0 && (res.GetNotOwned() || host.next < len(host.outcomes) || host.state.exists) {
			t.Errorf("the crafted clean-up ended %v with the record there %v: it owned the record and the host was healthy at last", &res, host.state.exists)
		}
		for runID := firstRun; runID != ""; {
			hist := history(ctx, t, c, &modelRun{id: id, runID: runID})
			for name, flags := range otherFlags() {
				// A copy each time: the replayer changes the history it
				// is given (the next replay of the same one then fails).
				if err := newReplayer(t, flags).ReplayWorkflowHistory(nil, proto.Clone(hist).(*historypb.History)); err != nil {
					t.Errorf("seed %d run %s on %s flags: %v", seed, runID, name, err)
					if dir := os.Getenv("VMFLOW_MODEL_HISTORY_DIR"); dir != "" {
						b, _ := protojson.Marshal(hist)
						_ = os.WriteFile(fmt.Sprintf("%s/seed-%d-%s.json", dir, seed, runID), b, 0o644)
					}
				}
			}
			replayed++
			if runID != firstRun {
				continued++
			}
			runID = hist.GetEvents()[len(hist.GetEvents())-1].GetWorkflowExecutionContinuedAsNewEventAttributes().GetNewExecutionRunId()
		}
		cancel()
	}
	t.Logf("workflow model on the dev server: %d scenarios, %d runs replayed (%d continued as new); seen:%s", ran, replayed, continued, formatStats(stats))
	if continued == 0 {
		t.Error("no scenario continued as new: the replays miss the carried input")
	}
}

// modelRun names one run for history.
type modelRun struct {
	client.WorkflowRun
	id, runID string
}

func (r *modelRun) GetID() string    { return r.id }
func (r *modelRun) GetRunID() string { return r.runID }
