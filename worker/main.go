// Command vmflow-worker runs vmflow's workflows. main is wiring only: flags,
// logger, metrics, the Temporal client, registration, and a clean stop on
// SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"
	"go.uber.org/zap"

	"vmflow/internal/service"
	"vmflow/internal/tclient"
	"vmflow/platform"
	"vmflow/workflows"
)

func main() {
	os.Exit(run())
}

func run() int {
	cfg, err := parseConfig(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmflow-worker:", err)
		return 2
	}
	if cfg.Version {
		fmt.Fprintln(os.Stdout, service.Info().String("vmflow-worker"))
		return 0
	}
	log, err := tclient.NewLogger(cfg.LogLevel)
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmflow-worker:", err)
		return 2
	}
	defer func() { _ = log.Sync() }()
	log.Info("vmflow-worker starting", service.Info().Fields()...)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	metrics, err := tclient.NewMetrics(tclient.WithMetricsLogger(log))
	if err != nil {
		log.Error("metrics", zap.Error(err))
		return 1
	}
	metrics.Readiness.NotReady("worker", "the Temporal worker has not started")
	// The metrics server outlives ctx (SIGTERM): it serves until run
	// returns, through the graceful stop.
	life, endLife := context.WithCancel(context.Background())
	defer endLife()
	if cfg.MetricsAddr != "" {
		go func() {
			if err := metrics.Serve(life, cfg.MetricsAddr); err != nil {
				log.Error("metrics server stopped", zap.Error(err))
			}
		}()
	}

	topts := platform.Options{Logger: log, MetricsHandler: metrics.SDKHandler(), HostPort: cfg.Address, Namespace: cfg.Namespace}
	copts, err := platform.ClientOptions(topts)
	if err != nil {
		log.Error("temporal configuration", zap.Error(err))
		return 2
	}
	ns := copts.Namespace
	if ns == "" {
		ns = client.DefaultNamespace
	}
	c, err := platform.Dial(ctx, topts)
	if err != nil {
		log.Error("connect to Temporal", zap.Error(err))
		return 1
	}
	defer c.Close()
	if err := tclient.EnsureSearchAttributes(ctx, c, ns, tclient.SearchAttributes()); err != nil {
		// Workflows upsert these; without them every workflow task fails.
		log.Error("search attributes", zap.Error(err), zap.String("namespace", ns))
		return 1
	}

	// WorkerStopTimeout: on SIGTERM the SDK stops polling and lets running
	// tasks finish for this long before it cancels them (0 cancels at once).
	w := worker.New(c, cfg.TaskQueue, worker.Options{WorkerStopTimeout: cfg.StopTimeout})
	workflows.New(cfg.Workflows).Register(w)
	if err := w.Start(); err != nil {
		log.Error("start worker", zap.Error(err), zap.String("task_queue", cfg.TaskQueue))
		return 1
	}
	metrics.Readiness.Ready("worker")
	log.Info("worker running", zap.String("task_queue", cfg.TaskQueue), zap.String("namespace", ns),
		zap.Duration("release_backoff", cfg.Workflows.ReleaseBackoff))
	<-ctx.Done()
	metrics.Readiness.NotReady("stopping", "stopping: running tasks finish, no new ones are taken")
	log.Info("stopping worker: no new tasks, running ones may finish", zap.Duration("stop_timeout", cfg.StopTimeout))
	w.Stop()
	return 0
}
