package tclient

import (
	"context"
	"io"
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
