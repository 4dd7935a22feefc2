package tclient

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.temporal.io/sdk/client"
	temporalotel "go.temporal.io/sdk/contrib/opentelemetry"
	"go.uber.org/zap"

	"vmflow/internal/service"
)

// Metrics is one Prometheus registry shared by the SDK's metrics (through
// OpenTelemetry, since the SDK's tally contrib module is not served here)
// and vmflow's own collectors, served on one /metrics endpoint.
type Metrics struct {
	// Registry is where vmflow's own collectors register.
	Registry *prometheus.Registry
	// Readiness is what /readyz answers; each binary names its conditions.
	Readiness *service.Readiness
	// Connection follows the Temporal client's connection for
	// vmflow_temporal_connected; the client's dial options must carry its
	// DialOptions (daemon.Flags.Temporal adds them).
	Connection *Connection

	provider *sdkmetric.MeterProvider
	sdk      client.MetricsHandler
	log      *zap.Logger
	allowed  atomic.Pointer[typeNames]
}

// OtherType is the workflow_type or activity_type label of a name this
// process did not register (AllowTypes).
const OtherType = "other"

// The SDK's tag names for the two caller-chosen labels
// (go.temporal.io/sdk/internal/common/metrics: WorkflowTypeNameTagName,
// ActivityTypeNameTagName; internal, so not importable).
const (
	workflowTypeTag = "workflow_type"
	activityTypeTag = "activity_type"
)

// typeNames are the workflow and activity names whose labels are kept.
type typeNames struct {
	workflows, activities map[string]bool
}

// MetricsOption configures NewMetrics.
type MetricsOption func(*Metrics)

// WithMetricsLogger logs metric-recording errors (an instrument the meter
// refuses) instead of discarding them. The SDK contrib's default would panic.
func WithMetricsLogger(l *zap.Logger) MetricsOption {
	return func(m *Metrics) {
		if l != nil {
			m.log = l
		}
	}
}

// NewMetrics builds the registry (runtime, process, vmflow_build_info), an
// OTel MeterProvider exporting into it and the SDK's handler over it.
func NewMetrics(opts ...MetricsOption) (*Metrics, error) {
	m := &Metrics{Registry: prometheus.NewRegistry(), Readiness: service.NewReadiness(), Connection: &Connection{}, log: zap.NewNop()}
	for _, o := range opts {
		o(m)
	}
	if err := m.Registry.Register(collectors.NewGoCollector()); err != nil {
		return nil, fmt.Errorf("register go collector: %w", err)
	}
	if err := m.Registry.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, fmt.Errorf("register process collector: %w", err)
	}
	if err := m.Registry.Register(service.Info().BuildInfoCollector()); err != nil {
		return nil, fmt.Errorf("register build info: %w", err)
	}
	connected := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "vmflow_temporal_connected",
		Help: "1 while this process holds an open connection to the Temporal frontend whose credentials were not refused at the last call; 0 before the first dial, while the connection is down, or with its credentials refused.",
	}, func() float64 {
		if m.Connection.Connected() {
			return 1
		}
		return 0
	})
	if err := m.Registry.Register(connected); err != nil {
		return nil, fmt.Errorf("register temporal connection: %w", err)
	}
	exporter, err := otelprom.New(
		otelprom.WithRegisterer(m.Registry),
		// target_info and otel_scope_* labels only add noise for a
		// single-process exporter scraped by Prometheus.
		otelprom.WithoutTargetInfo(),
		otelprom.WithoutScopeInfo(),
	)
	if err != nil {
		return nil, fmt.Errorf("otel prometheus exporter: %w", err)
	}
	m.provider = sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter), sdkmetric.WithView(latencyView()))
	m.sdk = temporalotel.NewMetricsHandler(temporalotel.MetricsHandlerOptions{
		Meter: m.provider.Meter("temporal-sdk-go"),
		OnError: func(err error) {
			m.log.Warn("temporal sdk metric", zap.Error(err))
		},
		// The SDK's counters only go up; monotonic counters are exported
		// as Prometheus counters (_total) that rate() works on.
		UseMonotonicCounters: true,
	})
	return m, nil
}

// latencyView gives every SDK histogram (all timers, in seconds) vmflow's
// latency bounds (service.LatencyBuckets).
func latencyView() sdkmetric.View {
	return sdkmetric.NewView(
		sdkmetric.Instrument{Kind: sdkmetric.InstrumentKindHistogram},
		sdkmetric.Stream{Aggregation: sdkmetric.AggregationExplicitBucketHistogram{Boundaries: service.LatencyBuckets()}},
	)
}

// AllowTypes names the workflow and activity types this process registered;
// SDK metrics with any other (anyone who can schedule chooses them) are
// labelled OtherType, so names cannot grow series for ever. Replaces the lists.
func (m *Metrics) AllowTypes(workflowTypes, activityTypes []string) {
	n := &typeNames{workflows: map[string]bool{}, activities: map[string]bool{}}
	for _, w := range workflowTypes {
		n.workflows[w] = true
	}
	for _, a := range activityTypes {
		n.activities[a] = true
	}
	m.allowed.Store(n)
}

// SDKHandler is client.Options.MetricsHandler: the SDK's OTel handler with its
// type labels bounded by AllowTypes.
func (m *Metrics) SDKHandler() client.MetricsHandler { return boundedHandler{h: m.sdk, m: m} }

// boundedHandler maps the caller-chosen labels of the SDK's metrics to
// OtherType unless AllowTypes named them. The SDK sets them through WithTags
// only.
type boundedHandler struct {
	h client.MetricsHandler
	m *Metrics
}

func (b boundedHandler) WithTags(tags map[string]string) client.MetricsHandler {
	var known typeNames
	if n := b.m.allowed.Load(); n != nil {
		known = *n
	}
	copied := false
	for key, names := range map[string]map[string]bool{workflowTypeTag: known.workflows, activityTypeTag: known.activities} {
		v, ok := tags[key]
		if !ok || v == OtherType || names[v] {
			continue
		}
		if !copied { // the SDK's map is not ours to change
			tags, copied = maps.Clone(tags), true
		}
		tags[key] = OtherType
	}
	return boundedHandler{h: b.h.WithTags(tags), m: b.m}
}

func (b boundedHandler) Counter(name string) client.MetricsCounter { return b.h.Counter(name) }
func (b boundedHandler) Gauge(name string) client.MetricsGauge     { return b.h.Gauge(name) }
func (b boundedHandler) Timer(name string) client.MetricsTimer     { return b.h.Timer(name) }

// Unwrap is the SDK's convention for a handler that wraps another.
func (b boundedHandler) Unwrap() client.MetricsHandler { return b.h }

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{Registry: m.Registry})
}

// Serve serves /metrics, /healthz and /readyz on addr until ctx is done, then
// shuts down with a short grace; a listen failure returns at once.
func (m *Metrics) Serve(ctx context.Context, addr string) error {
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics listen %s: %w", addr, err)
	}
	return m.ServeListener(ctx, ln)
}

// ServeListener is Serve on an open listener (tests pass one on port 0 and
// read its address).
func (m *Metrics) ServeListener(ctx context.Context, ln net.Listener) error {
	mux := http.NewServeMux()
	// Bounded, so a collector that hangs costs one timed-out scrape, not a
	// goroutine per scrape for ever, and health probes still answer. (The
	// agent's store gauges are a snapshot: a scrape reads no record.)
	mux.Handle("/metrics", http.TimeoutHandler(m.Handler(), 20*time.Second, "metrics scrape timed out\n"))
	mux.HandleFunc("/healthz", service.Healthz)
	mux.Handle("/readyz", m.Readiness)
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       2 * time.Minute,
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("metrics serve: %w", err)
	case <-ctx.Done():
	}
	shutCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutCtx); err != nil {
		return fmt.Errorf("metrics shutdown: %w", err)
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics serve: %w", err)
	}
	return nil
}

// Shutdown flushes and stops the meter provider.
func (m *Metrics) Shutdown(ctx context.Context) error {
	if err := m.provider.Shutdown(ctx); err != nil {
		return fmt.Errorf("meter provider shutdown: %w", err)
	}
	return nil
}
