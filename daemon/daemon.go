// Package daemon is the wiring vmflow's two daemons share: vmflow-hostagent
// run (daemon/agent) and vmflow-worker (daemon/worker). Both take the same
// Temporal, metrics, logging and stop flags, log the same way, serve
// /metrics, /healthz and /readyz the same way, and exit with the same codes;
// each binary's main.go only names its parser and its Run. What host
// packages need as well, without Temporal (readiness, sd_notify, build
// info), lives in internal/service.
package daemon

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.uber.org/zap"

	"vmflow/internal/service"
	"vmflow/internal/tclient"
	"vmflow/platform"
	"vmflow/workflows"
)

// Flags are the flags both daemons take. The connection itself (address,
// namespace, TLS, API key) comes from the SDK's envconfig (TEMPORAL_*
// variables or a profile file); --address and --namespace override it.
type Flags struct {
	MetricsAddr string
	LogLevel    string
	Address     string
	Namespace   string
	// Insecure allows an API key over plaintext, TLS skip-verify and
	// plaintext to a non-loopback Temporal (tclient.TransportRisks).
	Insecure bool
	// StopTimeout: after SIGTERM, how long running work may finish
	// before it is cancelled (under the unit's TimeoutStopSec).
	StopTimeout time.Duration
	// Version: print the build and exit (registered when Help.Version).
	Version bool

	// Logger is the daemon's logger: Main builds it from LogLevel with
	// LogFields on every line; a test sets its own. Nil: nothing is logged.
	Logger    *zap.Logger
	LogFields []zap.Field

	// TraceAttributes are the resource attributes of the daemon's spans
	// besides its service name (the agent's host_id); Tracing is what
	// Main started from the environment (nil: tracing off), on every
	// client Temporal dials.
	TraceAttributes []attribute.KeyValue
	Tracing         *platform.Tracing
}

// Help is what the flags' texts say differently for each daemon.
type Help struct {
	Metrics string // what /metrics serves, e.g. " (SDK metrics)"
	Work    string // what runs when SIGTERM comes: "activities", "tasks"
	Refused string // what a refused insecure transport does
	Version bool   // take --version
}

// Register adds the shared flags to fs.
func (f *Flags) Register(fs *flag.FlagSet, h Help) {
	fs.StringVar(&f.MetricsAddr, "metrics-addr", "", "serve Prometheus /metrics"+h.Metrics+" on this address; empty: off")
	fs.StringVar(&f.LogLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&f.Address, "address", "", "Temporal frontend host:port (overrides TEMPORAL_ADDRESS)")
	fs.StringVar(&f.Namespace, "namespace", "", "Temporal namespace (overrides TEMPORAL_NAMESPACE)")
	fs.BoolVar(&f.Insecure, "insecure", false, "allow an insecure Temporal transport: an API key over plaintext, TLS without server verification, or plaintext to a non-loopback address (refused otherwise: "+h.Refused+")")
	fs.DurationVar(&f.StopTimeout, "stop-timeout", service.StopTimeout, "on SIGTERM, stop polling and let running "+h.Work+" finish this long before cancelling them; keep it under the unit's TimeoutStopSec")
	if h.Version {
		fs.BoolVar(&f.Version, "version", false, "print the build's version and revision, and exit")
	}
}

// Check refuses shared flags no daemon can run with.
func (f *Flags) Check() error {
	if f.StopTimeout < 0 {
		return fmt.Errorf("--stop-timeout %s is negative", f.StopTimeout)
	}
	return nil
}

func (f *Flags) flags() *Flags { return f }

// Config is a daemon's parsed command line: a struct embedding Flags.
type Config[C any] interface {
	*C
	flags() *Flags
}

// UsageError marks err as the configuration's fault: Main exits 2, as for
// bad flags.
func UsageError(err error) error { return usageError{err} }

type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

// Main runs a daemon and returns its exit code: 0 for --help and --version, 2
// for bad flags or a UsageError, 1 for any other error from run.
func Main[C any, P Config[C]](ctx context.Context, name string, args []string,
	parse func([]string, io.Writer) (C, error), run func(context.Context, C) error) int {
	cfg, err := parse(args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return service.ExitOK
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		return service.ExitUsage
	}
	f := P(&cfg).flags()
	if f.Version {
		fmt.Fprintln(os.Stdout, service.Info().String(name))
		return service.ExitOK
	}
	log, err := tclient.NewLogger(f.LogLevel)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		return service.ExitUsage
	}
	log = log.With(f.LogFields...)
	defer func() { _ = log.Sync() }()
	f.Logger = log
	log.Info(name+" starting", service.Info().Fields()...)
	tr, err := startTracing(ctx, name, f, log)
	if err != nil {
		log.Error(name+" not started", zap.Error(err))
		return service.ExitUsage
	}
	defer stopTracing(tr, log)
	if err := run(ctx, cfg); err != nil {
		log.Error(name+" stopped", zap.Error(err))
		if errors.As(err, new(usageError)) {
			return service.ExitUsage
		}
		return service.ExitError
	}
	return service.ExitOK
}

// startTracing starts tracing when the environment asks for it
// (platform.TracingRequested) and sets it on f, so every client the daemon
// dials traces; export errors are logged, not printed.
func startTracing(ctx context.Context, name string, f *Flags, log *zap.Logger) (*platform.Tracing, error) {
	if !platform.TracingRequested() {
		return nil, nil
	}
	// The OpenTelemetry SDK reports a failed export through its global
	// handler (stderr by default): this process's log instead.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn("tracing: spans not exported", zap.Error(err))
	}))
	tr, err := platform.StartTracing(ctx, platform.TracingOptions{Service: name, Attributes: f.TraceAttributes})
	if err != nil {
		return nil, err
	}
	f.Tracing = tr
	log.Info("tracing: exporting spans over OTLP", zap.String("endpoint", tr.Endpoint()))
	return tr, nil
}

// stopTracing sends the spans not sent yet, within service.TraceFlushTimeout
// (run's context is over by then).
func stopTracing(tr *platform.Tracing, log *zap.Logger) {
	if tr == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), service.TraceFlushTimeout)
	defer cancel()
	if err := tr.Shutdown(ctx); err != nil {
		log.Warn("tracing: last spans not sent", zap.Error(err))
	}
}

// Log is f.Logger, or a logger that drops everything.
func (f *Flags) Log() *zap.Logger {
	if f.Logger == nil {
		return zap.NewNop()
	}
	return f.Logger
}

// NewMetrics is a daemon's metrics registry; only vmflow's workflow and
// activity names keep their SDK labels, as callers choose the others.
func NewMetrics(log *zap.Logger) (*tclient.Metrics, error) {
	m, err := tclient.NewMetrics(tclient.WithMetricsLogger(log))
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	m.AllowTypes(workflows.WorkflowNames, workflows.HostActivityNames)
	return m, nil
}

// ServeMetrics serves m's /metrics, /healthz and /readyz on --metrics-addr
// until life ends, which outlives run's ctx so they answer through the stop.
func (f *Flags) ServeMetrics(life context.Context, m *tclient.Metrics) {
	if f.MetricsAddr == "" {
		return
	}
	go func() {
		if err := m.Serve(life, f.MetricsAddr); err != nil {
			f.Log().Error("metrics server stopped", zap.Error(err))
		}
	}()
}

// Temporal is the connection the flags ask for, as identity, reporting to m.
// An empty identity is the SDK's default.
func (f *Flags) Temporal(m *tclient.Metrics, identity string) platform.Options {
	return platform.Options{Logger: f.Log(), MetricsHandler: m.SDKHandler(), HostPort: f.Address, Namespace: f.Namespace,
		Identity: identity, Insecure: f.Insecure, GRPCDialOptions: m.Connection.DialOptions(), Tracing: f.Tracing}
}
