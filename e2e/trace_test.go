package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	enumspb "go.temporal.io/api/enums/v1"

	"vmflow/platform"
	"vmflow/testsupport/otlptest"
	"vmflow/testsupport/stacktest"
	"vmflow/workflows"
)

// envJaeger names the Jaeger binary to run; unset, the checkout's
// bin/jaeger (`make jaeger`, part of `make tools`).
const envJaeger = "VMFLOW_JAEGER"

// Service names of the traced processes: the daemons name themselves; the
// test is the platform API.
const (
	serviceAgent       = "vmflow-hostagent"
	serviceWorker      = "vmflow-worker"
	servicePlatformAPI = "vmflow-e2e-platform-api"
)

// requireJaeger returns the Jaeger binary, or skips t when it is not built.
func requireJaeger(t *testing.T) string {
	t.Helper()
	if p := os.Getenv(envJaeger); p != "" {
		return p
	}
	p, err := filepath.Abs(filepath.Join("..", "bin", "jaeger"))
	if err == nil {
		_, err = os.Stat(p)
	}
	if err != nil {
		t.Skipf("Jaeger not built (%v): `make jaeger` builds bin/jaeger, or set %s", err, envJaeger)
	}
	return p
}

// jaeger is a real Jaeger v2 for one test: its OTLP/HTTP receiver, its
// query API, traces kept in memory.
type jaeger struct {
	otlp  string // OTEL_EXPORTER_OTLP_ENDPOINT
	query string // the query API's base URL
}

// jaegerConfig is Jaeger v2's configuration (it is the OpenTelemetry
// Collector): OTLP/HTTP in, memory storage, the query API, no metrics
// server of its own. Placeholders: the OTLP, query HTTP and query gRPC ports.
const jaegerConfig = `service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
  jaeger_query:
    storage:
      traces: memstore
    enable_tracing: false
    http:
      endpoint: 127.0.0.1:%[2]d
    grpc:
      endpoint: 127.0.0.1:%[3]d
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:%[1]d
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
`

// startJaeger runs Jaeger until t ends, on free ports (picked again when
// another process took one first), and waits until it takes spans and
// answers queries.
func startJaeger(t *testing.T, bin, dir string) *jaeger {
	t.Helper()
	var lastErr error
	for attempt := 1; attempt <= 3; attempt++ {
		var ports [3]int
		for i := range ports {
			p, err := freePort()
			if err != nil {
				t.Fatalf("jaeger: %v", err)
			}
			ports[i] = p
		}
		cfg := filepath.Join(dir, "jaeger.yaml")
		if err := os.WriteFile(cfg, fmt.Appendf(nil, jaegerConfig, ports[0], ports[1], ports[2]), 0o644); err != nil {
			t.Fatalf("jaeger config: %v", err)
		}
		d := &stacktest.Daemon{Name: "jaeger", Bin: bin, Args: []string{"--config", "file:" + cfg}, Log: filepath.Join(dir, "jaeger.log")}
		d.Start(t)
		j := &jaeger{otlp: fmt.Sprintf("http://127.0.0.1:%d", ports[0]), query: fmt.Sprintf("http://127.0.0.1:%d", ports[1])}
		if lastErr = j.waitReady(d, 30*time.Second); lastErr == nil {
			t.Cleanup(func() {
				if err := d.Stop(); err != nil {
					t.Errorf("stop jaeger: %v", err)
				}
				if t.Failed() {
					t.Logf("--- %s (tail) ---\n%s", d.Log, d.Tail(3000))
				}
			})
			return j
		}
		_ = d.Stop()
		t.Logf("jaeger attempt %d: %v", attempt, lastErr)
	}
	t.Fatalf("jaeger did not start: %v", lastErr)
	return nil
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// waitReady waits until the query API answers and the OTLP port accepts,
// or d exits (a port taken meanwhile).
func (j *jaeger) waitReady(d *stacktest.Daemon, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	otlp, err := url.Parse(j.otlp)
	if err != nil {
		return fmt.Errorf("jaeger OTLP URL: %w", err)
	}
	for {
		if d.Exited() {
			return errors.New("jaeger exited: " + d.Tail(1500))
		}
		_, qerr := j.get(ctx, "/api/services", nil)
		conn, derr := (&net.Dialer{}).DialContext(ctx, "tcp", otlp.Host)
		if derr == nil {
			conn.Close()
		}
		if qerr == nil && derr == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("jaeger not ready after %s: query API: %w; OTLP: %w", timeout, qerr, derr)
		case <-time.After(poll): // the poll interval of a deadline-bounded wait
		}
	}
}

// get reads the query API at path with query.
func (j *jaeger) get(ctx context.Context, path string, query url.Values) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	u := j.query + path
	if query != nil {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, fmt.Errorf("jaeger query: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("jaeger query %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("jaeger query %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("jaeger query %s: %s: %s", path, resp.Status, body)
	}
	return body, nil
}

// jTrace is a trace as Jaeger's query API (/api/traces) returns it.
type jTrace struct {
	TraceID   string              `json:"traceID"`
	Spans     []jSpan             `json:"spans"`
	Processes map[string]jProcess `json:"processes"`
}

type jSpan struct {
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	StartTime int64  `json:"startTime"` // µs since the epoch
	Duration  int64  `json:"duration"`  // µs
	Tags      []jTag `json:"tags"`
	ProcessID string `json:"processID"`
}

type jProcess struct {
	ServiceName string `json:"serviceName"`
	Tags        []jTag `json:"tags"`
}

type jTag struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

func tagValue(tags []jTag, key string) string {
	for _, t := range tags {
		if t.Key == key {
			return fmt.Sprint(t.Value)
		}
	}
	return ""
}

func (s jSpan) tag(key string) string { return tagValue(s.Tags, key) }

func (s jSpan) parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

// service is the service that sent span s.
func (tr jTrace) service(s jSpan) string { return tr.Processes[s.ProcessID].ServiceName }

// spans are the trace's spans named op.
func (tr jTrace) spans(op string) []jSpan {
	var out []jSpan
	for _, s := range tr.Spans {
		if s.OperationName == op {
			out = append(out, s)
		}
	}
	return out
}

// find lists the traces of service with a span op whose attributes hold
// tags, through the query API's search.
func (j *jaeger) find(ctx context.Context, service, op string, tags map[string]string) ([]jTrace, error) {
	tj, err := json.Marshal(tags)
	if err != nil {
		return nil, fmt.Errorf("tags: %w", err)
	}
	q := url.Values{"service": {service}, "operation": {op}, "tags": {string(tj)}, "lookback": {"1h"}, "limit": {"20"}}
	b, err := j.get(ctx, "/api/traces", q)
	if err != nil {
		return nil, err
	}
	var resp struct {
		Data   []jTrace `json:"data"`
		Errors []any    `json:"errors"`
	}
	if err := json.Unmarshal(b, &resp); err != nil {
		return nil, fmt.Errorf("decode /api/traces: %w", err)
	}
	if len(resp.Errors) > 0 {
		return nil, fmt.Errorf("/api/traces: %v", resp.Errors)
	}
	return resp.Data, nil
}

// waitTrace waits until the one trace of service with span op and tags holds
// every span in want (spans arrive from three processes, each on its own
// schedule), and returns it.
func (j *jaeger) waitTrace(t *testing.T, service, op string, tags map[string]string, want []string) jTrace {
	t.Helper()
	var found jTrace
	waitFor(t, 30*time.Second, fmt.Sprintf("the trace of %s %s %v with spans %v in Jaeger", service, op, tags, want), func() (bool, string) {
		trs, err := j.find(context.Background(), service, op, tags)
		if err != nil {
			return false, err.Error()
		}
		if len(trs) != 1 {
			return false, fmt.Sprintf("%d traces", len(trs))
		}
		found = trs[0]
		var missing []string
		for _, w := range want {
			if len(found.spans(w)) == 0 {
				missing = append(missing, w)
			}
		}
		return len(missing) == 0, fmt.Sprintf("trace %s has %d spans, missing %v", found.TraceID, len(found.Spans), missing)
	})
	return found
}

// scheduledActivities lists the activity types a workflow scheduled, from
// its history, in order.
func (e *env) scheduledActivities(workflowID string) []string {
	e.t.Helper()
	it := e.c.GetWorkflowHistory(e.ctx(30*time.Second), workflowID, "", false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	var out []string
	for it.HasNext() {
		ev, err := it.Next()
		if err != nil {
			e.t.Fatalf("history of %s: %v", workflowID, err)
		}
		if a := ev.GetActivityTaskScheduledEventAttributes(); a != nil {
			out = append(out, a.GetActivityType().GetName())
		}
	}
	return out
}

// TestTraces: with OTEL_EXPORTER_OTLP_ENDPOINT set for the worker, the
// agent and the platform API's client (this test, dialled through
// platform.Dial), a spawn and a delete are each one trace in a real Jaeger,
// found by the instance's id: from the platform API's start through the
// worker's workflow run to every host activity the workflow scheduled, run
// by the agent, each with instance_id, host_id and its stage; and the
// delete's StopVM holds the stop ladder's steps.
func TestTraces(t *testing.T) {
	timeTest(t)
	bin := requireJaeger(t)
	e := newEnv(t, envOptions{noStart: true})
	j := startJaeger(t, bin, e.out)

	otlptest.ClearEnv(t)
	// Spans leave each process within 200 ms rather than the default 5 s.
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
	t.Setenv(platform.EnvOTLPEndpoint, j.otlp) // the daemons inherit it, as under a unit's EnvironmentFile
	e.agent.Start(t)
	e.worker.Start(t)

	tr, err := platform.StartTracing(e.ctx(10*time.Second), platform.TracingOptions{Service: servicePlatformAPI})
	if err != nil || tr == nil {
		t.Fatalf("tracing: %v (on: %t)", err, tr != nil)
	}
	o := e.srv.TClientOptions()
	o.Tracing = tr
	c, err := platform.Dial(e.ctx(30*time.Second), o)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	plain := e.c
	e.c = c
	t.Cleanup(func() {
		e.c = plain // the env's own clean-ups run after this one
		c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tr.Shutdown(ctx); err != nil {
			t.Errorf("tracing shutdown: %v", err)
		}
	})

	id := "tr-" + suffix(t)
	const graceful = 1 // s: -machine none ignores the power button, so the wait runs out
	e.spawn(e.noneSpawn(id, true))
	if err := e.startDelete(id, graceful).Get(e.ctx(2*time.Minute), nil); err != nil {
		t.Fatalf("delete %s: %v", id, err)
	}

	byID := map[string]string{platform.AttrInstanceID: id}
	stages := map[string]string{
		workflows.ActivityValidateSpawn: workflows.StageValidating,
		workflows.ActivityCreateRecord:  workflows.StageCreatingRecord,
		workflows.ActivityClaimDevices:  workflows.StageClaimingGPUs,
		workflows.ActivityLaunchVM:      workflows.StageLaunching,
		workflows.ActivityBeginDelete:   workflows.StageMarkingStopped,
		workflows.ActivityStopVM:        workflows.StageStopping,
		workflows.ActivityWaitVMExit:    workflows.StageWaitingExit,
		workflows.ActivityReleaseLeases: workflows.StageReleasingLeases,
		workflows.ActivityTearDown:      workflows.StageTearingDown,
		workflows.ActivityDeleteRecord:  workflows.StageTearingDown,
		// New runs' combined activities.
		workflows.ActivityPrepareSpawn:   workflows.StageCreatingRecord,
		workflows.ActivityStopInstance:   workflows.StageStopping,
		workflows.ActivityRemoveInstance: workflows.StageTearingDown,
	}
	for _, wf := range []struct {
		typ, id string
		core    []string // activities the trace must have whatever else ran
	}{
		{workflows.SpawnWorkflow, workflows.SpawnWorkflowID(id), []string{workflows.ActivityPrepareSpawn, workflows.ActivityLaunchVM}},
		{workflows.DeleteWorkflow, workflows.DeleteWorkflowID(id), []string{workflows.ActivityStopInstance,
			workflows.ActivityReleaseLeases, workflows.ActivityRemoveInstance}},
	} {
		acts := e.scheduledActivities(wf.id)
		for _, a := range wf.core {
			if !slices.Contains(acts, a) {
				t.Fatalf("%s scheduled %v, not %s", wf.id, acts, a)
			}
		}
		want := []string{"StartWorkflow:" + wf.typ, "RunWorkflow:" + wf.typ}
		for _, a := range acts {
			want = append(want, "StartActivity:"+a, "RunActivity:"+a)
		}
		// Found by the instance's id on the platform API's start.
		trace := j.waitTrace(t, servicePlatformAPI, "StartWorkflow:"+wf.typ, byID, want)
		t.Logf("%s: trace %s, %d spans", wf.id, trace.TraceID, len(trace.Spans))
		// And by the instance's id on the agent's side: the same trace.
		last := "RunActivity:" + acts[len(acts)-1]
		agentSide, err := j.find(e.ctx(10*time.Second), serviceAgent, last, byID)
		if err != nil || len(agentSide) != 1 || agentSide[0].TraceID != trace.TraceID {
			t.Errorf("%s: the agent's %s by instance_id: %d traces (%v), want trace %s", wf.id, last, len(agentSide), err, trace.TraceID)
		}
		checkTrace(t, trace, wf.typ, acts, id, e.hostID, stages)
		if wf.typ == workflows.DeleteWorkflow {
			checkStopLadder(t, trace, graceful*time.Second)
		}
	}
}

// checkTrace: each span of the workflow's trace comes from the process
// that ran it, hangs under the span that caused it and names the instance,
// the host and (for a host activity) its stage.
func checkTrace(t *testing.T, tr jTrace, typ string, acts []string, id, hostID string, stages map[string]string) {
	t.Helper()
	one := func(op string) jSpan {
		ss := tr.spans(op)
		if len(ss) == 0 {
			t.Fatalf("trace %s has no %s", tr.TraceID, op)
		}
		return ss[0]
	}
	start, run := one("StartWorkflow:"+typ), one("RunWorkflow:"+typ)
	for _, c := range []struct {
		s       jSpan
		service string
		parent  string
	}{
		{start, servicePlatformAPI, ""},
		{run, serviceWorker, start.SpanID},
	} {
		if got := tr.service(c.s); got != c.service {
			t.Errorf("%s sent by %s, want %s", c.s.OperationName, got, c.service)
		}
		if c.s.parent() != c.parent {
			t.Errorf("%s: parent %q, want %q", c.s.OperationName, c.s.parent(), c.parent)
		}
		if c.s.tag(platform.AttrInstanceID) != id || c.s.tag(platform.AttrHostID) != hostID {
			t.Errorf("%s: instance_id %q host_id %q, want %s on %s", c.s.OperationName,
				c.s.tag(platform.AttrInstanceID), c.s.tag(platform.AttrHostID), id, hostID)
		}
	}
	for _, a := range acts {
		for _, call := range tr.spans("StartActivity:" + a) {
			if tr.service(call) != serviceWorker || call.parent() != run.SpanID {
				t.Errorf("%s: sent by %s under %s, want %s under the run %s", call.OperationName, tr.service(call), call.parent(), serviceWorker, run.SpanID)
			}
		}
		ran := one("RunActivity:" + a)
		callIDs := []string{}
		for _, call := range tr.spans("StartActivity:" + a) {
			callIDs = append(callIDs, call.SpanID)
		}
		if !slices.Contains(callIDs, ran.parent()) {
			t.Errorf("%s hangs under %s, not under one of its calls %v", ran.OperationName, ran.parent(), callIDs)
		}
		p := tr.Processes[ran.ProcessID]
		if p.ServiceName != serviceAgent || tagValue(p.Tags, platform.AttrHostID) != hostID {
			t.Errorf("%s sent by %s of host %q, want %s of %s", ran.OperationName, p.ServiceName, tagValue(p.Tags, platform.AttrHostID), serviceAgent, hostID)
		}
		for _, s := range append(tr.spans("StartActivity:"+a), ran) {
			got := [3]string{s.tag(platform.AttrInstanceID), s.tag(platform.AttrHostID), s.tag(platform.AttrStage)}
			if want := [3]string{id, hostID, stages[a]}; got != want {
				t.Errorf("%s (%s): instance_id, host_id, stage = %q, want %q", s.OperationName, tr.service(s), got, want)
			}
		}
	}
}

// checkStopLadder: StopInstance's run holds the ladder's steps in order, each
// from the agent; the graceful wait ran out (-machine none ignores the
// power button) and quit ended it.
func checkStopLadder(t *testing.T, tr jTrace, graceful time.Duration) {
	t.Helper()
	stops := tr.spans("RunActivity:" + workflows.ActivityStopInstance)
	if len(stops) != 1 {
		t.Fatalf("%d StopVM runs in trace %s", len(stops), tr.TraceID)
	}
	stop := stops[0]
	var steps []jSpan
	for _, s := range tr.Spans {
		if s.parent() == stop.SpanID {
			steps = append(steps, s)
		}
	}
	slices.SortFunc(steps, func(a, b jSpan) int { return int(a.StartTime - b.StartTime) })
	var names []string
	for _, s := range steps {
		names = append(names, s.OperationName)
		if tr.service(s) != serviceAgent {
			t.Errorf("stop step %s sent by %s", s.OperationName, tr.service(s))
		}
		if s.StartTime < stop.StartTime || s.StartTime+s.Duration > stop.StartTime+stop.Duration {
			t.Errorf("stop step %s [%d, +%d µs] outside StopVM [%d, +%d µs]", s.OperationName, s.StartTime, s.Duration, stop.StartTime, stop.Duration)
		}
	}
	if want := []string{"powerdown", "graceful-wait", "quit", "quit-wait"}; !slices.Equal(names, want) {
		t.Fatalf("StopVM's steps: %v, want %v", names, want)
	}
	wait := steps[1]
	if d := time.Duration(wait.Duration) * time.Microsecond; d < graceful || wait.tag("exited") != "false" {
		t.Errorf("graceful-wait: %s, exited %s; want the whole %s, not exited", d, wait.tag("exited"), graceful)
	}
	if steps[0].tag("via") != "qmp" || steps[3].tag("exited") != "true" {
		t.Errorf("powerdown via %q, quit-wait exited %q: want qmp, true", steps[0].tag("via"), steps[3].tag("exited"))
	}
	t.Logf("StopVM %d µs: %s", stop.Duration, strings.Join(func() []string {
		var out []string
		for _, s := range steps {
			out = append(out, s.OperationName+" "+strconv.FormatInt(s.Duration, 10)+" µs")
		}
		return out
	}(), ", "))
}
