package worker

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"go.temporal.io/sdk/worker"

	"vmflow/daemon"
	"vmflow/internal/service"
	"vmflow/workflows"
)

// Config is everything the worker reads from its command line.
type Config struct {
	daemon.Flags
	TaskQueue string
	Workflows workflows.Config
	// Deployment is the worker deployment version this worker joins when
	// Versioning is set (deploy/UPGRADES.md, "Rolling the worker").
	Versioning bool
	Deployment worker.WorkerDeploymentVersion
}

// DefaultDeploymentName is the worker deployment vmflow-worker joins with
// --versioning.
const DefaultDeploymentName = "vmflow"

// unstampedVersion is what service.Info reports for a plain `go build`:
// every such binary would share it, so it cannot tell two builds apart.
const unstampedVersion = "dev"

// ParseFlags parses vmflow-worker's command line.
func ParseFlags(args []string, stderr io.Writer) (Config, error) {
	d := workflows.Config{}.WithDefaults()
	var c Config
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
	c.Register(fs, daemon.Help{Metrics: " (SDK metrics)", Work: "tasks", Refused: "the worker exits with the reason", Version: true})
	fs.StringVar(&c.TaskQueue, "task-queue", workflows.DefaultTaskQueue, "task queue the workflows run on")
	fs.DurationVar(&c.Workflows.ReleaseBackoff, "release-backoff", d.ReleaseBackoff, "first wait after a failed vGPU release round; doubles each round")
	fs.DurationVar(&c.Workflows.ReleaseBackoffMax, "release-backoff-max", d.ReleaseBackoffMax, "longest wait between vGPU release rounds")
	fs.DurationVar(&c.Workflows.ScheduleToStartTimeout, "host-pickup-timeout", d.ScheduleToStartTimeout, "a host activity not picked up within this marks the host unreachable")
	fs.DurationVar(&c.Workflows.UnreachableBackoff, "unreachable-backoff", d.UnreachableBackoff, "first wait after a host was found unreachable; doubles")
	fs.DurationVar(&c.Workflows.UnreachableBackoffMax, "unreachable-backoff-max", d.UnreachableBackoffMax, "longest wait between tries of an unreachable host")
	fs.DurationVar(&c.Workflows.SpawnHostWait, "spawn-host-wait", d.SpawnHostWait, "how long a spawn waits for an unreachable host before it fails")
	fs.DurationVar(&c.Workflows.DeleteStuckAfter, "delete-stuck-after", d.DeleteStuckAfter, "a delete stage that has not advanced for this long shows needs-attention with its last error (default of DeleteRequest.stuck_after_seconds; recorded when a delete starts)")
	fs.DurationVar(&c.Workflows.PlacementScheduleToStart, "placement-pickup-timeout", d.PlacementScheduleToStart, "a spawn without a host passes a candidate over when its agent does not pick the grant up within this")
	fs.IntVar(&c.Workflows.PlacementCandidates, "placement-candidates", d.PlacementCandidates, "K: hosts one read of the fleet view offers a spawn without a host, best first")
	fs.BoolVar(&c.Versioning, "versioning", false, "join the worker deployment --deployment-name as build --build-id (Worker Versioning): this build gets workflow tasks only once it is the deployment's current version; off: poll unversioned")
	fs.StringVar(&c.Deployment.DeploymentName, "deployment-name", DefaultDeploymentName, "worker deployment to join with --versioning")
	fs.StringVar(&c.Deployment.BuildID, "build-id", service.Info().Version, "build id within the deployment with --versioning (default: the version `make build` stamped)")
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
	if c.Versioning {
		if err := checkDeployment(c.Deployment); err != nil {
			return c, err
		}
	}
	if err := c.Check(); err != nil {
		return c, err
	}
	if c.TaskQueue == "" {
		return c, errors.New("--task-queue must not be empty")
	}
	for name, v := range map[string]time.Duration{
		"release-backoff": c.Workflows.ReleaseBackoff, "release-backoff-max": c.Workflows.ReleaseBackoffMax,
		"host-pickup-timeout": c.Workflows.ScheduleToStartTimeout, "unreachable-backoff": c.Workflows.UnreachableBackoff,
		"unreachable-backoff-max": c.Workflows.UnreachableBackoffMax, "spawn-host-wait": c.Workflows.SpawnHostWait,
		"delete-stuck-after": c.Workflows.DeleteStuckAfter, "placement-pickup-timeout": c.Workflows.PlacementScheduleToStart,
	} {
		if v <= 0 {
			return c, fmt.Errorf("--%s must be positive, got %s", name, v)
		}
	}
	if c.Workflows.PlacementCandidates < 1 || c.Workflows.PlacementCandidates > 100 {
		return c, fmt.Errorf("--placement-candidates must be 1 to 100, got %d", c.Workflows.PlacementCandidates)
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

// checkDeployment refuses a deployment version the server would refuse, or
// one that cannot tell builds apart.
func checkDeployment(v worker.WorkerDeploymentVersion) error {
	switch {
	case v.DeploymentName == "":
		return errors.New("--deployment-name must not be empty with --versioning")
	case strings.Contains(v.DeploymentName, "."):
		return fmt.Errorf("--deployment-name %q: a deployment name cannot contain \".\"", v.DeploymentName)
	case v.BuildID == "":
		return errors.New("--build-id must not be empty with --versioning")
	case v.BuildID == unstampedVersion, strings.HasSuffix(v.BuildID, "-dirty"):
		// Two different unstamped (or uncommitted) builds would share the
		// id, and a pinned spawn could move to code that cannot replay it.
		return fmt.Errorf("--versioning: build id %q does not name one build: build a commit with `make build` (stamps the version) or pass --build-id", v.BuildID)
	}
	return nil
}
