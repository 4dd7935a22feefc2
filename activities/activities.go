// Package activities adapts the host agent's packages to Temporal: one
// method per host activity the workflows schedule on vmflow-host-<host_id>.
// The methods are thin: they call hostagent/... and classify the errors
// (classify, in errors.go). Every activity is idempotent, and those that
// wait heartbeat with what they wait for.
package activities

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"go.temporal.io/sdk/activity"
	"go.uber.org/zap"

	"vmflow/hostagent/metrics"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/spec"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/vmm"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// GPUs is the vGPU side of the host: claims recorded write-ahead in the
// instance records, released only once the VM is gone.
type GPUs interface {
	// Profiles lists the profile names the host offers.
	Profiles(ctx context.Context) ([]string, error)
	// Claim records the intent, creates the device and marks the claim
	// active. Idempotent for the same instance and profile.
	Claim(ctx context.Context, instanceID, profile string) (*vmflowv1.GpuClaim, error)
	// Release releases the instance's claim; released is false when there
	// was none. It refuses while the VM may live or the device is held.
	Release(ctx context.Context, instanceID string) (released bool, deviceID string, err error)
	// Reconcile runs one reconcile round over the host.
	Reconcile(ctx context.Context) (*vmflowv1.ReconcileVGPUResult, error)
	// DevicePath is the sysfs path QEMU's vfio-pci device opens.
	DevicePath(claim *vmflowv1.GpuClaim) string
}

// Activities holds the host agent's packages. Register it with
// worker.RegisterActivity(&Activities{...}); its method names are the
// activity names in package workflows.
type Activities struct {
	Store      *store.Store
	Supervisor *supervise.Supervisor
	Host       spec.Host
	// GPUs is nil on a host without vGPUs.
	GPUs GPUs
	// AttachVGPU adds the claimed device to QEMU's command line. Only the
	// vgpu-sim simulator turns it off: QEMU cannot open simulated devices.
	AttachVGPU bool
	// DefaultGraceful is the stop ladder's graceful timeout when a delete
	// asks for none.
	DefaultGraceful time.Duration
	Logger          *zap.Logger
	Metrics         *metrics.Agent // nil: no metrics

	mu       sync.Mutex
	inflight map[string]string // instance id -> activity running on it
}

var _ workflows.HostActivities = (*Activities)(nil)

// errBusy: another attempt of an activity still works on the instance.
var errBusy = errors.New("instance busy")

// begin marks the instance as worked on by activity name, so an attempt that
// overlaps a previous attempt still running (its heartbeat timed out, the
// server retried) gets a retryable busy rather than a second concurrent run.
func (a *Activities) begin(ctx context.Context, id string) (context.Context, func(), *zap.Logger, error) {
	info := activity.GetInfo(ctx)
	ctx, done, log, err := a.beginNamed(ctx, id, info.ActivityType.Name)
	return ctx, done, log.With(zap.String("workflow_id", info.WorkflowExecution.ID)), err
}

func (a *Activities) beginNamed(ctx context.Context, id, name string) (context.Context, func(), *zap.Logger, error) {
	log := a.log().With(zap.String("instance_id", id), zap.String("activity", name))
	if err := store.ValidateID(id); err != nil {
		return ctx, func() {}, log, classify(err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inflight == nil {
		a.inflight = map[string]string{}
	}
	if other, ok := a.inflight[id]; ok {
		return ctx, func() {}, log, classify(fmt.Errorf("%w: %s on %s is still running", errBusy, other, id))
	}
	a.inflight[id] = name
	return ctx, func() {
		a.mu.Lock()
		delete(a.inflight, id)
		a.mu.Unlock()
	}, log, nil
}

func (a *Activities) log() *zap.Logger {
	if a.Logger == nil {
		return zap.NewNop()
	}
	return a.Logger
}

// heartbeat records detail() every interval until the returned stop is
// called, so a long wait shows in the Web UI's pending-activity card.
func heartbeat(ctx context.Context, every time.Duration, detail func() string) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			activity.RecordHeartbeat(ctx, detail())
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}

const heartbeatEvery = 2 * time.Second

// MaxGracefulTimeout caps a delete's graceful_timeout_seconds: the field is
// a uint32 from outside, and 2^32 s (136 years) would park the stop ladder
// before quit/SIGKILL for good, its vGPU never released. Capped rather than
// refused: refusing would fail the delete after the manual-stop marker.
const MaxGracefulTimeout = time.Hour

// gracefulTimeout is the stop ladder's wait after system_powerdown for a
// requested number of seconds: def for 0, at most MaxGracefulTimeout.
func gracefulTimeout(seconds uint32, def time.Duration) time.Duration {
	if seconds == 0 {
		return def
	}
	return min(time.Duration(seconds)*time.Second, MaxGracefulTimeout)
}

// ValidateSpawn admits the request on this host; nothing is created.
func (a *Activities) ValidateSpawn(ctx context.Context, req *vmflowv1.SpawnRequest) error {
	if err := a.Host.Validate(ctx, req); err != nil {
		a.log().Info("spawn rejected", zap.String("instance_id", req.GetInstanceId()), zap.Error(err))
		return classify(err)
	}
	return nil
}

// CreateRecord creates the instance record (Creating). The same spec again
// returns the existing record; another spec, or a record being deleted, is
// refused.
func (a *Activities) CreateRecord(ctx context.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	ctx, done, log, err := a.begin(ctx, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	defer done()
	_, getErr := a.Store.Get(req.GetInstanceId())
	existed := getErr == nil
	rec, err := a.Store.Create(ctx, &vmflowv1.InstanceRecord{
		Id:                        req.GetInstanceId(),
		Spec:                      spec.RecordSpec(req),
		RestartPolicy:             req.GetRestartPolicy(),
		RestartMaxAttempts:        req.GetRestartMaxAttempts(),
		RestartStableAfterSeconds: req.GetRestartStableAfterSeconds(),
	})
	if err != nil {
		return nil, classify(fmt.Errorf("create record: %w", err))
	}
	crashpoint.Hit(crashpoint.ActivityCreateRecordDone)
	log.Info("record created", zap.Bool("already_existed", existed))
	return &vmflowv1.CreateRecordResult{InstanceUuid: rec.GetSpec().GetUuid(), AlreadyExisted: existed}, nil
}

// ClaimVGPU claims a vGPU of the requested profile for the instance.
func (a *Activities) ClaimVGPU(ctx context.Context, req *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	ctx, done, log, err := a.begin(ctx, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	defer done()
	if a.GPUs == nil {
		return nil, classify(fmt.Errorf("vgpu_profile %q: %w: this host has no vGPUs", req.GetVgpuProfile(), spec.ErrInvalid))
	}
	claim, err := a.GPUs.Claim(ctx, req.GetInstanceId(), req.GetVgpuProfile())
	if err != nil {
		return nil, classify(fmt.Errorf("claim vGPU: %w", err))
	}
	crashpoint.Hit(crashpoint.ActivityClaimVGPUDone)
	log.Info("vGPU claimed", zap.String("device_id", claimDevice(claim)), zap.String("profile", claim.GetProfile()))
	return &vmflowv1.ClaimVGPUResult{DeviceId: claimDevice(claim), Parent: claim.GetParent(), Profile: claim.GetProfile()}, nil
}

func claimDevice(c *vmflowv1.GpuClaim) string {
	if c.GetDeviceId() != "" {
		return c.GetDeviceId()
	}
	return c.GetUuid()
}

// LaunchVM starts the instance's QEMU (with its vGPU, when claimed) and
// returns once QMP says running. A VM already running for the instance is
// returned as it is.
func (a *Activities) LaunchVM(ctx context.Context, ref *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	ctx, done, log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return nil, err
	}
	defer done()
	rec, err := a.Store.Get(ref.GetInstanceId())
	if err != nil {
		return nil, classify(fmt.Errorf("launch: %w", err))
	}
	vmSpec, err := a.SpecFor(rec)
	if err != nil {
		return nil, classify(err)
	}
	stop := heartbeat(ctx, heartbeatEvery, func() string { return "launching QEMU, waiting for QMP running" })
	res, err := a.Supervisor.Launch(ctx, ref.GetInstanceId(), vmSpec)
	stop()
	if err != nil {
		return nil, classify(fmt.Errorf("launch: %w", err))
	}
	if a.Metrics != nil && !res.AlreadyRunning {
		a.Metrics.LaunchDuration.Observe(res.Duration.Seconds())
	}
	crashpoint.Hit(crashpoint.ActivityLaunchVMDone)
	paths, _ := a.Store.Paths(ref.GetInstanceId())
	log.Info("VM running", zap.Int("pid", res.Identity.PID), zap.Bool("already_running", res.AlreadyRunning), zap.Duration("took", res.Duration))
	return &vmflowv1.LaunchVMResult{Pid: int32(res.Identity.PID), QmpSocket: paths.Socket, AlreadyRunning: res.AlreadyRunning}, nil
}

// SpecFor is QEMU's spec for a record, with its vGPU attached when the
// agent attaches vGPUs. The supervisor uses it for restarts too.
func (a *Activities) SpecFor(rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
	vfio := ""
	if a.AttachVGPU && a.GPUs != nil && store.ClaimHeld(rec) {
		vfio = a.GPUs.DevicePath(rec.GetGpuClaim())
	}
	return spec.ToVMSpec(rec.GetId(), rec.GetSpec(), vfio), nil
}

// BeginDelete writes the manual-stop marker, then moves the record to
// Deleting: from here on neither the restart policy nor a spawn can bring
// the VM back (invariant 6). A missing record is "already absent".
func (a *Activities) BeginDelete(ctx context.Context, ref *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	ctx, done, log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return nil, err
	}
	defer done()
	id := ref.GetInstanceId()
	if _, err := a.Store.Get(id); errors.Is(err, store.ErrNotFound) {
		log.Info("nothing to delete")
		return &vmflowv1.BeginDeleteResult{AlreadyAbsent: true}, nil
	}
	if err := a.Store.MarkManualStop(ctx, id); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return &vmflowv1.BeginDeleteResult{AlreadyAbsent: true}, nil
		}
		return nil, classify(fmt.Errorf("write manual-stop marker: %w", err))
	}
	rec, err := a.Store.Update(ctx, id, func(r *vmflowv1.InstanceRecord) error {
		switch r.GetState() {
		case vmflowv1.InstanceState_INSTANCE_STATE_DELETING, vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED:
		default:
			r.State = vmflowv1.InstanceState_INSTANCE_STATE_DELETING
		}
		return nil
	})
	if err != nil {
		return nil, classify(fmt.Errorf("begin delete: %w", err))
	}
	crashpoint.Hit(crashpoint.BeginDeleteRecorded)
	log.Info("delete begun", zap.String("state", store.StateName(rec.GetState())), zap.Bool("has_claim", store.ClaimHeld(rec)))
	return &vmflowv1.BeginDeleteResult{HasClaim: store.ClaimHeld(rec)}, nil
}

// StopVM runs the stop ladder (resuming where the record says it was).
func (a *Activities) StopVM(ctx context.Context, req *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	ctx, done, log, err := a.begin(ctx, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	defer done()
	graceful := gracefulTimeout(req.GetGracefulTimeoutSeconds(), a.DefaultGraceful)
	if uint64(req.GetGracefulTimeoutSeconds()) > uint64(MaxGracefulTimeout/time.Second) {
		log.Warn("graceful timeout capped", zap.Uint32("requested_seconds", req.GetGracefulTimeoutSeconds()),
			zap.Duration("graceful", graceful))
	}
	started := time.Now()
	stop := heartbeat(ctx, heartbeatEvery, func() string {
		return fmt.Sprintf("stop ladder running for %s (graceful timeout %s)", time.Since(started).Round(time.Second), graceful)
	})
	res, err := a.Supervisor.Stop(ctx, req.GetInstanceId(), graceful)
	stop()
	if err != nil {
		return nil, classify(fmt.Errorf("stop: %w", err))
	}
	if a.Metrics != nil && !res.AlreadyGone {
		a.Metrics.StopDuration.Observe(res.Total.Seconds())
	}
	crashpoint.Hit(crashpoint.ActivityStopVMDone)
	step := stepNeeded(res.StopResult)
	log.Info("VM stopped", zap.String("step_reached", step), zap.Bool("already_gone", res.AlreadyGone),
		zap.Duration("took", res.Total), zap.Bool("child", res.Child))
	return &vmflowv1.StopVMResult{StepReached: step, DurationMs: uint32(min(res.Total.Milliseconds(), 1<<31))}, nil
}

// stepNeeded names the last step of the ladder that was taken before the
// group was gone: "powerdown" for a guest that powered off by itself,
// "quit" or "kill" when it had to be forced, "none" when nothing ran.
func stepNeeded(res vmm.StopResult) string {
	if res.AlreadyGone {
		return "none"
	}
	names := map[vmm.StopStep]string{vmm.StepPowerdownSent: "powerdown", vmm.StepQuitSent: "quit", vmm.StepKillSent: "kill"}
	last := "none"
	for _, st := range res.Steps {
		if n, ok := names[st.Step]; ok && st.Via != "skipped" {
			last = n
		}
	}
	return last
}

// WaitVMExit returns once the VM's whole thread group is gone, heartbeating
// what it still sees ("2 tasks of pid 4242 still running").
func (a *Activities) WaitVMExit(ctx context.Context, ref *vmflowv1.InstanceRef) error {
	ctx, done, log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return err
	}
	defer done()
	err = a.Supervisor.WaitExit(ctx, ref.GetInstanceId(), func(st proc.Status) {
		activity.RecordHeartbeat(ctx, fmt.Sprintf("%d tasks of pid %d still running (%s)", st.Tasks, st.PID, st.State))
	})
	if err != nil {
		return classify(fmt.Errorf("wait for exit: %w", err))
	}
	crashpoint.Hit(crashpoint.ActivityWaitVMExitDone)
	log.Info("thread group gone")
	return nil
}

// ReleaseVGPU releases the instance's vGPU once its VM is confirmed gone.
// A failure keeps the claim and the record (invariant 1); the workflow
// retries.
func (a *Activities) ReleaseVGPU(ctx context.Context, ref *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	ctx, done, log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return nil, err
	}
	defer done()
	if a.GPUs == nil {
		return &vmflowv1.ReleaseVGPUResult{}, nil
	}
	stop := heartbeat(ctx, heartbeatEvery, func() string { return "releasing vGPU of " + ref.GetInstanceId() })
	released, dev, err := a.GPUs.Release(ctx, ref.GetInstanceId())
	stop()
	if err != nil {
		if a.Metrics != nil {
			a.Metrics.ReleaseFailures.WithLabelValues(errnoName(err)).Inc()
		}
		log.Warn("vGPU release failed; claim and record kept", zap.Error(err))
		ce := classify(fmt.Errorf("release vGPU of %s: %w", ref.GetInstanceId(), err))
		return nil, retype(ce, ErrTypeReleaseFailed)
	}
	crashpoint.Hit(crashpoint.ActivityReleaseVGPUDone)
	if released {
		log.Info("vGPU released", zap.String("device_id", dev))
	}
	return &vmflowv1.ReleaseVGPUResult{Released: released, DeviceId: dev}, nil
}

// TearDown removes what the VM left on the host besides its record: the
// QMP socket and the pidfile. It refuses while the VM may still live.
func (a *Activities) TearDown(ctx context.Context, ref *vmflowv1.InstanceRef) error {
	ctx, done, log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return err
	}
	defer done()
	_ = ctx
	rec, err := a.Store.Get(ref.GetInstanceId())
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		return classify(fmt.Errorf("tear down: %w", err))
	}
	if p := rec.GetProcess(); p != nil {
		id := store.IdentityOf(p)
		if st := proc.Inspect(id); st.Alive {
			return classify(fmt.Errorf("tear down: VM %v still %s: %w", id, st.State, errStillRunning))
		}
	}
	paths, err := a.Store.Paths(ref.GetInstanceId())
	if err != nil {
		return classify(err)
	}
	for _, p := range []string{paths.Socket, paths.PID} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return classify(fmt.Errorf("tear down: %w", err))
		}
	}
	crashpoint.Hit(crashpoint.TearDownSocketRemoved)
	log.Info("runtime files removed")
	return nil
}

var errStillRunning = errors.New("VM still running")

// DeleteRecord removes the instance record. The store refuses while it holds
// a GPU claim (invariant 1); a record already gone is success.
func (a *Activities) DeleteRecord(ctx context.Context, ref *vmflowv1.InstanceRef) error {
	ctx, done, log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return err
	}
	defer done()
	err = a.Store.Delete(ctx, ref.GetInstanceId())
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if errors.Is(err, store.ErrIllegalTransition) {
		// ReleaseFailed goes back to Deleting before it can be deleted.
		if _, terr := a.Store.Transition(ctx, ref.GetInstanceId(), vmflowv1.InstanceState_INSTANCE_STATE_DELETING); terr == nil {
			err = a.Store.Delete(ctx, ref.GetInstanceId())
		}
	}
	if err != nil {
		return classify(fmt.Errorf("delete record: %w", err))
	}
	crashpoint.Hit(crashpoint.ActivityDeleteRecordDone)
	log.Info("record deleted")
	return nil
}

// ReconcileHost runs one vGPU reconcile round over this host.
func (a *Activities) ReconcileHost(ctx context.Context, req *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	if a.GPUs == nil {
		return &vmflowv1.ReconcileVGPUResult{}, nil
	}
	stop := heartbeat(ctx, 10*time.Second, func() string { return "reconciling vGPUs of " + req.GetHostId() })
	res, err := a.GPUs.Reconcile(ctx)
	stop()
	if err != nil {
		return nil, classify(fmt.Errorf("reconcile: %w", err))
	}
	a.log().Info("reconciled", zap.Uint32("claims_released", res.GetClaimsReleased()), zap.Uint32("orphans_removed", res.GetOrphansRemoved()),
		zap.Uint32("failed", res.GetFailed()), zap.String("host_id", req.GetHostId()))
	return res, nil
}
