package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"vmflow/internal/service"
	"vmflow/workflows"
)

// config is everything the worker reads from its command line. The
// connection itself (address, namespace, TLS, API key) comes from the SDK's
// envconfig (TEMPORAL_* variables or a profile file); --address and
// --namespace override it.
type config struct {
	TaskQueue   string
	MetricsAddr string
	LogLevel    string
	Address     string
	Namespace   string
	Workflows   workflows.Config
	// StopTimeout: after SIGTERM, how long running tasks may finish
	// before they are cancelled (under the unit's TimeoutStopSec).
	StopTimeout time.Duration
	// Version: print the build and exit.
	Version bool
}

func parseConfig(args []string, stderr io.Writer) (config, error) {
	d := workflows.DefaultConfig()
	var c config
	fs := flag.NewFlagSet("vmflow-worker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, `usage: vmflow-worker [flags]

Runs vmflow's workflows (SpawnInstance, DeleteInstance, ReconcileVGPU).
Connects with the Temporal SDK's envconfig: TEMPORAL_ADDRESS,
TEMPORAL_NAMESPACE, TEMPORAL_TLS_*, TEMPORAL_API_KEY, or a profile in
TEMPORAL_CONFIG_FILE / TEMPORAL_PROFILE.

flags:
`)
		fs.PrintDefaults()
	}
	fs.StringVar(&c.TaskQueue, "task-queue", workflows.DefaultTaskQueue, "task queue the workflows run on")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", "", "serve Prometheus /metrics (SDK metrics) on this address; empty: off")
	fs.StringVar(&c.LogLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&c.Address, "address", "", "Temporal frontend host:port (overrides TEMPORAL_ADDRESS)")
	fs.StringVar(&c.Namespace, "namespace", "", "Temporal namespace (overrides TEMPORAL_NAMESPACE)")
	fs.DurationVar(&c.Workflows.ReleaseBackoff, "release-backoff", d.ReleaseBackoff, "first wait after a failed vGPU release round; doubles each round")
	fs.DurationVar(&c.Workflows.ReleaseBackoffMax, "release-backoff-max", d.ReleaseBackoffMax, "longest wait between vGPU release rounds")
	fs.DurationVar(&c.Workflows.ScheduleToStartTimeout, "host-pickup-timeout", d.ScheduleToStartTimeout, "a host activity not picked up within this marks the host unreachable")
	fs.DurationVar(&c.Workflows.UnreachableBackoff, "unreachable-backoff", d.UnreachableBackoff, "first wait after a host was found unreachable; doubles")
	fs.DurationVar(&c.Workflows.UnreachableBackoffMax, "unreachable-backoff-max", d.UnreachableBackoffMax, "longest wait between tries of an unreachable host")
	fs.DurationVar(&c.Workflows.SpawnHostWait, "spawn-host-wait", d.SpawnHostWait, "how long a spawn waits for an unreachable host before it fails")
	fs.DurationVar(&c.Workflows.DeleteStuckAfter, "delete-stuck-after", d.DeleteStuckAfter, "a delete stage that has not advanced for this long shows needs-attention with its last error (default of DeleteRequest.stuck_after_seconds; recorded when a delete starts)")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", service.StopTimeout, "on SIGTERM, stop polling and let running tasks finish this long before cancelling them; keep it under the unit's TimeoutStopSec")
	fs.BoolVar(&c.Version, "version", false, "print the build's version and revision, and exit")
	fs.DurationVar(&c.Workflows.ActivityTimeoutCap, "activity-timeout-cap", 0, "cap every host activity's StartToClose and heartbeat timeout (tests that kill the agent; 0: off)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if c.Version {
		return c, nil
	}
	if c.StopTimeout < 0 {
		return c, fmt.Errorf("--stop-timeout %s is negative", c.StopTimeout)
	}
	if c.TaskQueue == "" {
		return c, errors.New("--task-queue must not be empty")
	}
	for name, v := range map[string]time.Duration{
		"release-backoff": c.Workflows.ReleaseBackoff, "release-backoff-max": c.Workflows.ReleaseBackoffMax,
		"host-pickup-timeout": c.Workflows.ScheduleToStartTimeout, "unreachable-backoff": c.Workflows.UnreachableBackoff,
		"unreachable-backoff-max": c.Workflows.UnreachableBackoffMax, "spawn-host-wait": c.Workflows.SpawnHostWait,
		"delete-stuck-after": c.Workflows.DeleteStuckAfter,
	} {
		if v <= 0 {
			return c, fmt.Errorf("--%s must be positive, got %s", name, v)
		}
	}
	if c.Workflows.DeleteStuckAfter < time.Second {
		// Recorded in whole seconds (stuck_after_seconds).
		return c, fmt.Errorf("--delete-stuck-after %s is below one second", c.Workflows.DeleteStuckAfter)
	}
	if c.Workflows.ReleaseBackoffMax < c.Workflows.ReleaseBackoff {
		return c, fmt.Errorf("--release-backoff-max %s is below --release-backoff %s", c.Workflows.ReleaseBackoffMax, c.Workflows.ReleaseBackoff)
	}
	return c, nil
}
