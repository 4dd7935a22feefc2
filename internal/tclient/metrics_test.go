package tclient

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestMetricsHandlerServesSDKAndOwnMetrics(t *testing.T) {
	m, err := NewMetrics()
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })

	own := prometheus.NewCounter(prometheus.CounterOpts{Name: "vmflow_reattach_total", Help: "test"})
	require.NoError(t, m.Registry.Register(own))
	own.Inc()

	h := m.SDKHandler().WithTags(map[string]string{"task_queue": "vmflow"})
	h.Counter("temporal_request").Inc(2)
	h.Timer("temporal_request_latency").Record(150 * time.Millisecond)
	h.Gauge("temporal_num_pollers").Update(3)

	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	body := rec.Body.String()
	assert.Contains(t, body, "vmflow_reattach_total 1")
	assert.Contains(t, body, `temporal_request_total{task_queue="vmflow"} 2`)
	assert.Contains(t, body, "temporal_request_latency_seconds_bucket")
	assert.Contains(t, body, `temporal_num_pollers{task_queue="vmflow"} 3`)
	assert.Contains(t, body, "go_goroutines")
}

func TestMetricsServe(t *testing.T) {
	m, err := NewMetrics()
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.ServeListener(ctx, ln) }()

	reqCtx, reqCancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer reqCancel()
	req, err := http.NewRequestWithContext(reqCtx, http.MethodGet, "http://"+ln.Addr().String()+"/metrics", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.NoError(t, err)
	assert.Contains(t, string(b), "go_goroutines")

	cancel()
	select {
	case err := <-done:
		assert.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after its context was cancelled")
	}

	// A busy address is reported, not swallowed.
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	err = m.Serve(context.Background(), busy.Addr().String())
	assert.ErrorContains(t, err, "metrics listen")
}

// TestSDKLabelsBounded: a caller scheduling 1,000 random activity names
// (from 1,000 random workflow types) adds at most one series per metric
// beside the registered names. Fails if each name becomes a series of
// its own.
func TestSDKLabelsBounded(t *testing.T) {
	m, err := NewMetrics()
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	m.AllowTypes([]string{"SpawnInstance"}, []string{"LaunchVM"})

	record := func(wf, act string) {
		tags := map[string]string{"namespace": "default", "task_queue": "vmflow-host-h1", "workflow_type": wf, "activity_type": act}
		h := m.SDKHandler().WithTags(tags)
		h.Counter("temporal_activity_execution_failed").Inc(1)
		h.Timer("temporal_activity_execution_latency").Record(time.Millisecond)
		assert.Equal(t, act, tags["activity_type"], "the SDK's map is left as it was")
	}
	record("SpawnInstance", "LaunchVM")
	for i := range 1000 {
		record(fmt.Sprintf("wf-%d-%x", i, rand.Uint64()), fmt.Sprintf("act-%d-%x", i, rand.Uint64()))
	}

	mfs, err := m.Registry.Gather()
	require.NoError(t, err)
	series := map[string]int{}
	seen := map[string]bool{}
	for _, mf := range mfs {
		for _, s := range mf.GetMetric() {
			series[mf.GetName()]++
			for _, l := range s.GetLabel() {
				if l.GetName() == "activity_type" || l.GetName() == "workflow_type" {
					seen[l.GetName()+"="+l.GetValue()] = true
				}
			}
		}
	}
	assert.Equal(t, 2, series["temporal_activity_execution_failed_total"], "LaunchVM and other")
	assert.Equal(t, 2, series["temporal_activity_execution_latency_seconds"])
	assert.Equal(t, map[string]bool{"activity_type=LaunchVM": true, "activity_type=other": true,
		"workflow_type=SpawnInstance": true, "workflow_type=other": true}, seen)
}
