package metrics

import (
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/internal/service"
	"vmflow/internal/service/servicetest"
)

// A 3 s stop and a 12 s stop land in different buckets of /metrics (the
// old bounds had 10 and 15), a 4-minute stop is not just "over the top",
// and every vmflow histogram resolves 1 ms to 10 min.
func TestHistogramBuckets(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, err := New(reg, nil)
	require.NoError(t, err)
	a.StopDuration.WithLabelValues("powerdown").Observe((3 * time.Second).Seconds())
	a.StopDuration.WithLabelValues("kill").Observe((4 * time.Minute).Seconds())
	a.ObserveRelease("vgpu", 800*time.Millisecond)
	a.LaunchDuration.Observe((120 * time.Millisecond).Seconds())
	a.ExitDetect.Observe((40 * time.Microsecond).Seconds())

	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	code, body := servicetest.Get(t, srv.URL)
	require.Equal(t, http.StatusOK, code)
	hs, err := servicetest.Histograms(body)
	require.NoError(t, err)

	stop := hs["vmflow_stop_duration_seconds"]
	assert.Equal(t, 0.0, stop[2.5])
	assert.Equal(t, 1.0, stop[5], "3 s")
	assert.Equal(t, 1.0, stop[120])
	assert.Equal(t, 2.0, stop[300], "4 min")
	launch := hs["vmflow_launch_duration_seconds"]
	assert.Equal(t, 0.0, launch[0.1])
	assert.Equal(t, 1.0, launch[0.25], "120 ms")
	assert.Equal(t, 1.0, hs["vmflow_exit_detect_seconds"][0.0001], "40 µs")

	for name, buckets := range hs {
		var bounds []float64
		for b := range buckets {
			bounds = append(bounds, b)
		}
		slices.Sort(bounds)
		for _, want := range service.LatencyBuckets() {
			assert.Contains(t, bounds, want, "%s resolves %gs", name, want)
		}
	}
	assert.Equal(t, 1.0, hs["vmflow_lease_release_duration_seconds"][1], "800 ms")
	assert.Len(t, hs, 4)
}
