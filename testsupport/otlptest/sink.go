// Package otlptest is an OTLP/HTTP trace collector for tests: it keeps
// every span a process sends it, so a test can check what tracing exported
// without running a collector.
package otlptest

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

// Span is one span received, with its resource's attributes.
type Span struct {
	Name     string
	Resource map[string]string // string-valued resource attributes: service.name, host_id
}

// Sink receives OTLP/HTTP protobuf at URL()/v1/traces.
type Sink struct {
	srv   *httptest.Server
	mu    sync.Mutex
	spans []Span
}

// Start serves a sink until t ends.
func Start(t testing.TB) *Sink {
	t.Helper()
	s := &Sink{}
	s.srv = httptest.NewServer(http.HandlerFunc(s.export))
	t.Cleanup(s.srv.Close)
	return s
}

// URL is the collector's base URL: OTEL_EXPORTER_OTLP_ENDPOINT.
func (s *Sink) URL() string { return s.srv.URL }

// Spans returns the spans received so far.
func (s *Sink) Spans() []Span {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Span(nil), s.spans...)
}

func (s *Sink) export(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	var req coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(body, &req)
	}
	if err != nil || r.URL.Path != "/v1/traces" {
		http.Error(w, "not an OTLP trace export", http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		res := map[string]string{}
		for _, kv := range rs.GetResource().GetAttributes() {
			res[kv.GetKey()] = kv.GetValue().GetStringValue()
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				s.spans = append(s.spans, Span{Name: sp.GetName(), Resource: res})
			}
		}
	}
	w.Header().Set("Content-Type", "application/x-protobuf")
}

// ClearEnv unsets, for t, every standard variable that turns tracing on or
// off or renames what it exports, so a developer's environment cannot
// change a test's outcome.
func ClearEnv(t *testing.T) {
	for _, v := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
		"OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
		"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_BSP_SCHEDULE_DELAY"} {
		t.Setenv(v, "")
	}
}
