package workflows

import (
	"time"

	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	"vmflow/internal/contract"
)

// Config holds the worker-side knobs of the workflows. The worker sets them
// from flags, and workers of one queue may run with different values (a
// rollout, a hand-edited unit): a replay must not depend on them. Most
// shape only durations (timers, activity timeouts, retry intervals),
// which replay does not compare. The three that decide which commands
// follow are read once per run and recorded (recorded, a SideEffect):
// DeleteStuckAfter when a delete starts (carried across continue-as-new in
// stuck_after_seconds), SpawnHostWait and, for a reconcile, the
// ScheduleToStartTimeout as its give-up limit, the first time the host is
// unreachable. TestReplayIgnoresWorkerFlags and TestReplayRecordedHistories
// replay with other values.
type Config struct {
	// ReleaseBackoff is the first wait after a failed vGPU release round;
	// it doubles up to ReleaseBackoffMax.
	ReleaseBackoff    time.Duration
	ReleaseBackoffMax time.Duration
	// ScheduleToStartTimeout: how long a host activity may wait for the
	// host's agent to pick it up before the host counts as unreachable.
	ScheduleToStartTimeout time.Duration
	// UnreachableBackoff is the first wait after the host was found
	// unreachable; it doubles up to UnreachableBackoffMax.
	UnreachableBackoff    time.Duration
	UnreachableBackoffMax time.Duration
	// SpawnHostWait: how long a spawn waits for an unreachable host before
	// it fails.
	SpawnHostWait time.Duration
	// GracefulTimeout and GroupExitCap are the agent's stop ladder
	// defaults (contract's, unless the agent's flags change them); the
	// stop activity's timeout is sized from them.
	GracefulTimeout time.Duration
	GroupExitCap    time.Duration
	// ActivityTimeoutCap, when set, caps every host activity's
	// StartToClose (the heartbeat timeout is capped to it too). A killed
	// agent is noticed only when an attempt times out, so the crash tests
	// run with a few seconds here; production leaves it 0.
	ActivityTimeoutCap time.Duration
	// DeleteStuckAfter is the default bound after which a delete stage
	// that has not advanced (BeginDelete, StopVM, WaitVMExit, TearDown,
	// DeleteRecord) shows needs-attention with its last error. A delete
	// records the value once when it starts (its stuck_after_seconds, or
	// this), so changing it affects only deletes started afterwards.
	DeleteStuckAfter time.Duration
	// PlacementScheduleToStart is a placing spawn's grant's own
	// ScheduleToStart: a candidate host whose agent does not pick the
	// grant up this fast is passed over for the next at once (a named
	// host gets ScheduleToStartTimeout and the SpawnHostWait instead).
	PlacementScheduleToStart time.Duration
	// PlacementCandidates is K: how many hosts one read of the fleet
	// view offers (best first) before the view is read again.
	PlacementCandidates int
}

// Workflows holds the three workflows; register it with Register.
type Workflows struct {
	cfg Config
}

// WithDefaults is c with every zero field that has a default set to it:
// Config{}.WithDefaults() is the production configuration.
func (c Config) WithDefaults() Config {
	set := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
	}
	set(&c.ReleaseBackoff, 30*time.Second)
	set(&c.ReleaseBackoffMax, 15*time.Minute)
	set(&c.ScheduleToStartTimeout, time.Minute)
	set(&c.UnreachableBackoff, 30*time.Second)
	set(&c.UnreachableBackoffMax, 5*time.Minute)
	set(&c.SpawnHostWait, 10*time.Minute)
	set(&c.GracefulTimeout, contract.DefaultGracefulTimeout)
	set(&c.GroupExitCap, contract.DefaultGroupExitCap)
	// A QEMU in D state after SIGKILL during a VFIO reset can take
	// minutes to leave; longer than that is worth a look.
	set(&c.DeleteStuckAfter, 5*time.Minute)
	set(&c.PlacementScheduleToStart, 5*time.Second)
	if c.PlacementCandidates <= 0 {
		c.PlacementCandidates = 3
	}
	return c
}

// New returns the workflows with cfg, zero fields taking their defaults.
func New(cfg Config) *Workflows {
	return &Workflows{cfg: cfg.WithDefaults()}
}

// Registry is the part of a worker that registers workflows.
type Registry interface {
	RegisterWorkflowWithOptions(w interface{}, options workflow.RegisterOptions)
}

// Register registers the three workflows under their public names, each with
// the Worker Versioning behaviour a deployment-joined worker uses.
func (w *Workflows) Register(r Registry) {
	// Pinned: a spawn finishes on the build it started on. Unversioned workers
	// still replay old spawns, so keep GetVersion until every one runs --versioning.
	r.RegisterWorkflowWithOptions(w.SpawnInstance, workflow.RegisterOptions{Name: SpawnWorkflow, VersioningBehavior: workflow.VersioningBehaviorPinned})
	// AutoUpgrade: a delete may wait for days and must move to the current
	// build (server 1.29.1 cannot upgrade a pinned run at continue-as-new), so
	// its changes go behind GetVersion (deploy/UPGRADES.md).
	r.RegisterWorkflowWithOptions(w.DeleteInstance, workflow.RegisterOptions{Name: DeleteWorkflow, VersioningBehavior: workflow.VersioningBehaviorAutoUpgrade})
	r.RegisterWorkflowWithOptions(w.ReconcileVGPU, workflow.RegisterOptions{Name: ReconcileWorkflow, VersioningBehavior: workflow.VersioningBehaviorAutoUpgrade})
	// AutoUpgrade: a host's view may stand for months between publishes.
	r.RegisterWorkflowWithOptions(w.FleetHost, workflow.RegisterOptions{Name: FleetHostWorkflow, VersioningBehavior: workflow.VersioningBehaviorAutoUpgrade})
}

// Retry policies. "Unlimited" ones back off to a minute: the pending
// activity card in the Web UI shows the attempt and the last failure. Both
// refuse the same types, the non-retryable classes': whether a retry can
// change an answer is what the error means, whichever stage met it.
var (
	retryFew = &temporal.RetryPolicy{
		InitialInterval: time.Second, BackoffCoefficient: 2, MaximumInterval: 10 * time.Second, MaximumAttempts: 3,
		NonRetryableErrorTypes: nonRetryableTypes(),
	}
	retryForever = &temporal.RetryPolicy{
		InitialInterval: time.Second, BackoffCoefficient: 2, MaximumInterval: time.Minute,
		NonRetryableErrorTypes: nonRetryableTypes(),
	}
)

// slowStart is p with its first retry at p's longest interval, or half the
// stuck bound if shorter: a re-run stage has backed off already, and a first
// interval past the bound would busy-loop rounds of one attempt.
func slowStart(p *temporal.RetryPolicy, bound time.Duration) *temporal.RetryPolicy {
	q := *p
	q.InitialInterval = max(p.InitialInterval, min(p.MaximumInterval, bound/2))
	return &q
}

func (w *Workflows) calls() map[string]hostCall {
	calls := w.uncappedCalls()
	if limit := w.cfg.ActivityTimeoutCap; limit > 0 {
		// By the name list, not over the map: workflowcheck flags map
		// iteration in workflow code (harmless here, but the lint gate).
		for _, name := range HostActivityNames {
			c := calls[name]
			c.timeout = min(c.timeout, limit)
			if c.heartbeat > 0 {
				c.heartbeat = min(c.heartbeat, limit)
			}
			calls[name] = c
		}
	}
	return calls
}

func (w *Workflows) uncappedCalls() map[string]hostCall {
	stopTimeout := w.cfg.GracefulTimeout + w.cfg.GroupExitCap + 30*time.Second
	return map[string]hostCall{
		ActivityValidateSpawn: {name: ActivityValidateSpawn, summary: "validate", timeout: 30 * time.Second, retry: retryFew},
		ActivityCreateRecord:  {name: ActivityCreateRecord, summary: "create record", timeout: 30 * time.Second, retry: retryFew},
		ActivityClaimDevices:  {name: ActivityClaimDevices, summary: "claim GPUs", timeout: time.Minute, retry: retryFew},
		ActivityClaimVGPU:     {name: ActivityClaimVGPU, summary: "claim vGPU", timeout: time.Minute, retry: retryFew},
		ActivityLaunchVM:      {name: ActivityLaunchVM, summary: "launch", timeout: 2 * time.Minute, heartbeat: 10 * time.Second, retry: retryFew},
		ActivityBeginDelete:   {name: ActivityBeginDelete, summary: "mark stopped", timeout: 30 * time.Second, retry: retryForever},
		ActivityStopVM:        {name: ActivityStopVM, summary: "stop", timeout: stopTimeout, heartbeat: 10 * time.Second, retry: retryForever},
		ActivityWaitVMExit:    {name: ActivityWaitVMExit, summary: "wait for exit", timeout: w.cfg.GroupExitCap + 30*time.Second, heartbeat: 10 * time.Second, retry: retryForever},
		// Releases retry a few times within seconds; after that the
		// workflow's own loop takes over, with needs-attention set.
		ActivityReleaseLeases: {name: ActivityReleaseLeases, summary: "release leases", timeout: time.Minute, heartbeat: 10 * time.Second, retry: retryFew},
		ActivityReleaseVGPU:   {name: ActivityReleaseVGPU, summary: "release vGPU", timeout: time.Minute, heartbeat: 10 * time.Second, retry: retryFew},
		ActivityTearDown:      {name: ActivityTearDown, summary: "tear down", timeout: 30 * time.Second, retry: retryForever},
		ActivityDeleteRecord:  {name: ActivityDeleteRecord, summary: "delete record", timeout: 30 * time.Second, retry: retryForever},
		// The combined activities: the sum of their parts' attempts, the
		// parts' retry policy (a stop is retried without limit, a spawn's
		// steps a few times).
		ActivityPrepareSpawn:   {name: ActivityPrepareSpawn, summary: "create record and claim GPUs", timeout: 30*time.Second + time.Minute, retry: retryFew},
		ActivityStopInstance:   {name: ActivityStopInstance, summary: "stop", timeout: 30*time.Second + stopTimeout + w.cfg.GroupExitCap + 30*time.Second, heartbeat: 10 * time.Second, retry: retryForever},
		ActivityRemoveInstance: {name: ActivityRemoveInstance, summary: "remove", timeout: time.Minute, retry: retryForever},
		ActivityReconcileHost:  {name: ActivityReconcileHost, summary: "reconcile vGPUs", timeout: 5 * time.Minute, heartbeat: 30 * time.Second, retry: retryFew},
	}
}
