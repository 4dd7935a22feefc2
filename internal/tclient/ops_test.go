package tclient

import (
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"vmflow/internal/service"
	"vmflow/internal/service/servicetest"
)

// serve runs m's HTTP server on a free port until the test ends and
// returns its base URL.
func serve(t *testing.T, m *Metrics) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.ServeListener(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Error("metrics server did not stop")
		}
	})
	return "http://" + ln.Addr().String()
}

// A 120 ms and a 3 s schedule-to-start land in different buckets of
// /metrics, and every histogram the SDK records (all timers, in seconds)
// has vmflow's bounds, 1 ms to 10 min. With OTel's default bounds (0, 5,
// 10, ... 10000) both latencies were in le="5" and le="0.25" did not exist.
func TestSDKHistogramBuckets(t *testing.T) {
	m, err := NewMetrics()
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	h := m.SDKHandler().WithTags(map[string]string{"task_queue": "vmflow"})
	h.Timer("temporal_activity_schedule_to_start_latency").Record(120 * time.Millisecond)
	h.Timer("temporal_activity_schedule_to_start_latency").Record(3 * time.Second)
	h.Timer("temporal_workflow_task_execution_latency").Record(2 * time.Millisecond)
	h.Timer("temporal_request_latency").Record(9 * time.Minute)

	code, body := servicetest.Get(t, serve(t, m)+"/metrics")
	require.Equal(t, http.StatusOK, code)
	hs, err := servicetest.Histograms(body)
	require.NoError(t, err)

	s2s := hs["temporal_activity_schedule_to_start_latency_seconds"]
	require.NotNil(t, s2s, "schedule-to-start histogram in /metrics:\n%s", body)
	assert.Equal(t, 0.0, s2s[0.1], "nothing at or under 100 ms")
	assert.Equal(t, 1.0, s2s[0.25], "120 ms is in le=0.25")
	assert.Equal(t, 1.0, s2s[2.5], "3 s is above le=2.5")
	assert.Equal(t, 2.0, s2s[5], "3 s is in le=5")
	wft := hs["temporal_workflow_task_execution_latency_seconds"]
	assert.Equal(t, 0.0, wft[0.001])
	assert.Equal(t, 1.0, wft[0.0025], "2 ms is resolved")
	req := hs["temporal_request_latency_seconds"]
	assert.Equal(t, 0.0, req[300])
	assert.Equal(t, 1.0, req[600], "9 min is resolved")

	want := service.LatencyBuckets()
	sdk := 0
	for name, buckets := range hs {
		if !strings.HasPrefix(name, "temporal_") {
			continue
		}
		sdk++
		var bounds []float64
		for b := range buckets {
			bounds = append(bounds, b)
		}
		slices.Sort(bounds)
		assert.Equal(t, want, bounds, "bounds of %s", name)
	}
	assert.Equal(t, 3, sdk, "the three SDK histograms recorded")
}

// vmflow_build_info carries the build in its labels with the value 1.
func TestBuildInfoMetric(t *testing.T) {
	m, err := NewMetrics()
	require.NoError(t, err)
	_, body := servicetest.Get(t, serve(t, m)+"/metrics")
	b := service.Info()
	assert.Contains(t, body, `vmflow_build_info{go_version="`+b.GoVersion+`",revision="`+b.Revision+`",version="`+b.Version+`"} 1`)
}

// /healthz answers while the process runs; /readyz only once every
// condition a binary named is met, and says which are not.
func TestHealthAndReadiness(t *testing.T) {
	m, err := NewMetrics()
	require.NoError(t, err)
	m.Readiness.NotReady("reattach", "re-attaching the host's VMs")
	m.Readiness.NotReady("temporal", "not polling yet")
	base := serve(t, m)

	code, body := servicetest.Get(t, base+"/healthz")
	assert.Equal(t, http.StatusOK, code)
	assert.Equal(t, "ok\n", body)
	code, body = servicetest.Get(t, base+"/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Equal(t, "not ready: reattach: re-attaching the host's VMs; temporal: not polling yet\n", body)

	m.Readiness.Ready("reattach")
	code, body = servicetest.Get(t, base+"/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Equal(t, "not ready: temporal: not polling yet\n", body)

	m.Readiness.Ready("temporal")
	code, body = servicetest.Get(t, base+"/readyz")
	assert.Equal(t, http.StatusOK, code)
	assert.Equal(t, "ready\n", body)

	m.Readiness.NotReady("stopping", "SIGTERM")
	code, _ = servicetest.Get(t, base+"/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
}

// Identical lines beyond 100 a second all reach the log: zap's production
// sampling kept the first 100 and then every 100th, so 250 "release
// failed" lines in a burst came out as 101.
func TestLoggerDoesNotSample(t *testing.T) {
	p := filepath.Join(t.TempDir(), "log.json")
	l, err := newLogger("info", p)
	require.NoError(t, err)
	const n = 250
	for range n {
		l.Error("release failed", zap.String(KeyInstanceID, "vm-1"))
	}
	require.NoError(t, l.Sync())
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	assert.Equal(t, n, strings.Count(string(b), `"msg":"release failed"`))
}
