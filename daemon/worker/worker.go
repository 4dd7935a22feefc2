// Package worker is the vmflow-worker daemon: it runs vmflow's workflows
// on their task queue, with the deployment version it joins and a clean
// stop on SIGTERM. Flags, logging and metrics are package daemon's.
package worker

import (
	"context"
	"fmt"
	"time"

	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"
	"go.uber.org/zap"

	"vmflow/daemon"
	"vmflow/internal/tclient"
	"vmflow/platform"
	"vmflow/platform/fleet"
	"vmflow/workflows"
)

// workerOptions are the SDK worker's options. No default versioning behaviour:
// each workflow sets its own at registration, and one without is refused.
func workerOptions(cfg Config) worker.Options {
	// WorkerStopTimeout: on SIGTERM the SDK stops polling and lets running
	// tasks finish for this long before it cancels them (0 cancels at once).
	o := worker.Options{WorkerStopTimeout: cfg.StopTimeout}
	if cfg.Versioning {
		o.DeploymentOptions = worker.DeploymentOptions{UseVersioning: true, Version: cfg.Deployment}
	}
	return o
}

// reportRouting logs whether this version is the deployment's current one (a
// version that is not gets no workflow tasks) and the command that makes it so.
func reportRouting(ctx context.Context, c client.Client, v worker.WorkerDeploymentVersion, log *zap.Logger) {
	log = log.With(zap.String("deployment_name", v.DeploymentName), zap.String("build_id", v.BuildID))
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	h := c.WorkerDeploymentClient().GetHandle(v.DeploymentName)
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for {
		d, err := h.Describe(ctx, client.WorkerDeploymentDescribeOptions{})
		if err == nil && knowsVersion(d.Info, v) {
			cur := d.Info.RoutingConfig.CurrentVersion
			switch {
			case cur != nil && *cur == v:
				log.Info("worker deployment: this build is the current version")
			default:
				current := "unversioned workers"
				if cur != nil {
					current = cur.BuildID
				}
				log.Warn("worker deployment: this build is not the current version and gets no workflow tasks until it is made current",
					zap.String("current", current),
					zap.String("make_current", fmt.Sprintf("temporal worker deployment set-current-version --deployment-name %s --build-id %s", v.DeploymentName, v.BuildID)))
			}
			return
		}
		select {
		case <-ctx.Done():
			log.Warn("worker deployment: could not read the deployment's routing", zap.Error(err))
			return
		case <-tick.C:
		}
	}
}

func knowsVersion(d client.WorkerDeploymentInfo, v worker.WorkerDeploymentVersion) bool {
	for _, s := range d.VersionSummaries {
		if s.Version == v {
			return true
		}
	}
	return false
}

// Run runs vmflow's workflows until ctx ends (SIGTERM), then stops
// gracefully: no new tasks, running ones get cfg.StopTimeout to finish.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Log()
	m, err := daemon.NewMetrics(log)
	if err != nil {
		return err
	}
	m.Readiness.NotReady("worker", "the Temporal worker has not started")
	// The metrics server outlives ctx (SIGTERM): it serves until Run
	// returns, through the graceful stop.
	life, endLife := context.WithCancel(context.Background())
	defer endLife()
	cfg.ServeMetrics(life, m)

	topts := cfg.Temporal(m, "")
	copts, err := platform.ClientOptions(topts)
	if err != nil {
		return daemon.UsageError(fmt.Errorf("temporal configuration: %w", err))
	}
	ns := copts.Namespace
	if ns == "" {
		ns = client.DefaultNamespace
	}
	c, err := platform.Dial(ctx, topts)
	if err != nil {
		return fmt.Errorf("connect to Temporal: %w", err)
	}
	defer c.Close()
	if err := tclient.EnsureSearchAttributes(ctx, c, ns, tclient.SearchAttributes()); err != nil {
		// Workflows upsert these; without them every workflow task fails.
		return fmt.Errorf("search attributes of namespace %s: %w", ns, err)
	}

	w := worker.New(c, cfg.TaskQueue, workerOptions(cfg))
	workflows.New(cfg.Workflows).Register(w)
	// Placement's local activities read the fleet view through c.
	(&fleet.Placer{Client: c, Logger: log}).Register(w)
	if err := w.Start(); err != nil {
		return fmt.Errorf("start worker on %s: %w", cfg.TaskQueue, err)
	}
	m.Readiness.Ready("worker")
	log.Info("worker running", zap.String("task_queue", cfg.TaskQueue), zap.String("namespace", ns),
		zap.Duration("release_backoff", cfg.Workflows.ReleaseBackoff), zap.Bool("versioning", cfg.Versioning),
		zap.String("deployment_name", cfg.Deployment.DeploymentName), zap.String("build_id", cfg.Deployment.BuildID))
	if cfg.Versioning {
		go reportRouting(ctx, c, cfg.Deployment, log)
	}
	<-ctx.Done()
	m.Readiness.NotReady("stopping", "stopping: running tasks finish, no new ones are taken")
	log.Info("stopping worker: no new tasks, running ones may finish", zap.Duration("stop_timeout", cfg.StopTimeout))
	w.Stop()
	return nil
}
