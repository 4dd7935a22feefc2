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
	"time"

	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.uber.org/zap"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/gpu"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/metrics"
	"vmflow/hostagent/network"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/vmm"
	"vmflow/internal/contract"
	"vmflow/internal/crashpoint"
	"vmflow/internal/heartbeat"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// GPUs is the vGPU side of the host: claims recorded write-ahead in the
// instance records, released only once the VM is gone.
type GPUs interface {
	// Profiles lists the profile names the host offers.
	Profiles(ctx context.Context) ([]string, error)
	// Claim gives the instance count vGPUs of profile, all or none: for
	// each the intent, the device, the lease active. Idempotent for the
	// same instance, profile and count.
	Claim(ctx context.Context, instanceID, profile string, count int) ([]*vmflowv1.Lease, error)
	// Release releases every vGPU the instance holds; released is false
	// when it held none or one failed, devices names those released now.
	// It refuses while the VM may live or a device is held.
	Release(ctx context.Context, instanceID string) (released bool, devices []string, err error)
	// LeaseDriver is the lease engine's driver of vGPU leases.
	LeaseDriver() lease.Driver
	// Reconcile runs one reconcile round over the host.
	Reconcile(ctx context.Context) (*vmflowv1.ReconcileVGPUResult, error)
}

// Activities holds the host agent's packages. Register it with
// worker.RegisterActivity(&Activities{...}); its method names are the
// activity names in package workflows.
type Activities struct {
	Store      *store.Store
	Supervisor *supervise.Supervisor
	Host       admission.Host
	// GPUs is nil on a host without vGPUs.
	GPUs GPUs
	// Whole is nil on a host handing out no whole GPUs (--gpu-passthrough).
	Whole WholeGPUs
	// Network is nil on a host without a network (no --net-subnet).
	Network *network.Net
	// Capacity is the host's capacity ledger: a new record is created
	// holding its share of the host, or refused NoHostCapacity. nil: no
	// ledger (tests of other things).
	Capacity *lease.Capacity
	// Offers, with Capacity, checks a new record's GPUs at its grant:
	// refused (NoVGPUCapacity) when the host's free devices, less what
	// other granted spawns have yet to claim, fall short. nil: no check.
	Offers *lease.Offers
	// Changed, if set, is told after an activity changed what the host
	// offers the fleet (a grant, a claim, a launch, a release): the
	// agent's fleet view republishes, debounced.
	Changed func()
	// LeaseConfig configures the lease engine the release stage runs
	// over the drivers above (its quarantine, its uninspectable pids).
	LeaseConfig lease.EngineConfig
	// AttachVGPU adds the claimed device to QEMU's command line. Only the
	// vgpu-sim simulator turns it off: QEMU cannot open simulated devices.
	AttachVGPU bool
	// DefaultGraceful is the stop ladder's graceful timeout when a delete
	// asks for none.
	DefaultGraceful time.Duration
	Logger          *zap.Logger
	Metrics         *metrics.Agent // nil: no metrics
}

var _ workflows.HostActivities = (*Activities)(nil)

// begin checks the instance id and returns the activity's logger. No lock of
// its own: an overlapping retried attempt is kept apart by supervise's slot
// and the store's lock (fast Busy for StopVM, else Busy at its deadline).
func (a *Activities) begin(ctx context.Context, id string) (*zap.Logger, error) {
	info := activity.GetInfo(ctx)
	log := a.log().With(zap.String("instance_id", id), zap.String("activity", info.ActivityType.Name),
		zap.String("workflow_id", info.WorkflowExecution.ID))
	if err := store.ValidateID(id); err != nil {
		return log, classify(err)
	}
	return log, nil
}

func (a *Activities) log() *zap.Logger {
	if a.Logger == nil {
		return zap.NewNop()
	}
	return a.Logger
}

// gracefulTimeout is the stop ladder's wait after system_powerdown: def for 0,
// capped at contract.MaxGracefulTimeout, since refusing would fail the delete
// after the manual-stop marker.
func gracefulTimeout(seconds uint32, def time.Duration) time.Duration {
	if seconds == 0 {
		return def
	}
	return min(time.Duration(seconds)*time.Second, contract.MaxGracefulTimeout)
}

// ValidateSpawn admits the request on this host, creating nothing; an early
// check only, as CreateRecord admits again.
func (a *Activities) ValidateSpawn(ctx context.Context, req *vmflowv1.SpawnRequest) error {
	return a.admitSpawn(ctx, req)
}

// admitSpawn admits a spawn request against this host's policy; a refusal is
// a non-retryable InvalidInput.
func (a *Activities) admitSpawn(ctx context.Context, req *vmflowv1.SpawnRequest) error {
	if err := a.Host.Validate(ctx, req); err != nil {
		return classify(err)
	}
	return nil
}

// CreateRecord admits the request and creates the record (Creating), its
// creator taken from the activity's own info so no caller can claim another
// spawn's record. The same spec again returns the record and whether this
// spawn created it (invariant 9); another spec or a deleting record is refused.
func (a *Activities) CreateRecord(ctx context.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	log, err := a.begin(ctx, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	if err := a.admitSpawn(ctx, req); err != nil {
		return nil, err
	}
	wf := activity.GetInfo(ctx).WorkflowExecution
	// The record keeps each image's root and its path below it: what every
	// launch opens.
	recSpec, err := a.Host.RecordSpec(req)
	if err != nil {
		return nil, classify(fmt.Errorf("create record: %w", err))
	}
	_, getErr := a.Store.Get(req.GetInstanceId())
	existed := getErr == nil
	var reserve []store.CreateOption
	if g := a.grant(req.GetInstanceId(), recSpec, req.GetPlacementGrant()); g != nil {
		reserve = append(reserve, store.Reserving(g))
	}
	rec, err := a.Store.Create(ctx, &vmflowv1.InstanceRecord{
		Id:                        req.GetInstanceId(),
		Spec:                      recSpec,
		RestartPolicy:             req.GetRestartPolicy(),
		RestartMaxAttempts:        req.GetRestartMaxAttempts(),
		RestartStableAfterSeconds: req.GetRestartStableAfterSeconds(),
		CreatedByWorkflowId:       wf.ID,
		CreatedByRunId:            wf.RunID,
	}, reserve...)
	if err != nil {
		return nil, classify(fmt.Errorf("create record: %w", err))
	}
	crashpoint.Hit(crashpoint.ActivityCreateRecordDone)
	if !existed {
		a.changed()
	}
	own := store.CreatedBy(rec, wf.ID, wf.RunID)
	creator := ""
	if rec.GetCreatedByWorkflowId() != "" {
		creator = store.CreatorOf(rec)
	}
	log.Info("record created", zap.Bool("already_existed", existed), zap.Bool("created_by_this_spawn", own),
		zap.String("created_by", store.CreatorOf(rec)))
	return &vmflowv1.CreateRecordResult{
		InstanceUuid: rec.GetSpec().GetUuid(), AlreadyExisted: existed,
		CreatedByThisSpawn: own, CreatedBy: creator,
	}, nil
}

// grant is the reservation a new record of spec is created with, under
// the host's admission lock: its share of the capacity ledger (refused
// while the host drains, or NoHostCapacity), then, for a placement's
// grant, its GPUs against what the host offers (NoVGPUCapacity). A
// refusal writes nothing. nil without a ledger. A named spawn's GPUs are
// the claim's to place (all or none, rolled back when short), as before
// placement.
func (a *Activities) grant(id string, spec *vmflowv1.VMSpec, placement bool) store.Reserve {
	if a.Capacity == nil {
		return nil
	}
	reserve := a.Capacity.Reserve(id, spec)
	return func(ctx context.Context) (*vmflowv1.Lease, error) {
		l, err := reserve(ctx)
		if err != nil || a.Offers == nil || !placement {
			return l, err
		}
		if err := a.Offers.Check(ctx, id, spec); err != nil {
			return nil, err
		}
		return l, nil
	}
}

// changed tells the fleet view the host's offer may have changed.
func (a *Activities) changed() {
	if a.Changed != nil {
		a.Changed()
	}
}

// ClaimVGPU is ClaimDevices under the name histories recorded before the
// lease engine: a workflow that scheduled it still finds it.
func (a *Activities) ClaimVGPU(ctx context.Context, req *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	return a.ClaimDevices(ctx, req)
}

// ClaimDevices gives the instance the GPUs it asks for: vgpu_count vGPUs
// of its profile, or gpu_passthrough_count whole GPUs, all or none.
func (a *Activities) ClaimDevices(ctx context.Context, req *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	log, err := a.begin(ctx, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	want, err := a.admittedClaim(req)
	if err != nil {
		return nil, classify(fmt.Errorf("claim GPUs: %w", err))
	}
	if want.passthrough > 0 {
		return a.claimWhole(ctx, log, req.GetInstanceId(), want)
	}
	if a.GPUs == nil {
		return nil, classify(fmt.Errorf("vgpu_profile %q: %w: this host has no vGPUs", want.profile, admission.ErrInvalid))
	}
	leases, err := a.GPUs.Claim(ctx, req.GetInstanceId(), want.profile, want.vgpus)
	if err != nil {
		return nil, classify(fmt.Errorf("claim vGPU: %w", err))
	}
	crashpoint.Hit(crashpoint.ActivityClaimDevicesDone)
	a.changed()
	res := &vmflowv1.ClaimVGPUResult{}
	for _, lease := range leases {
		res.DeviceIds = append(res.DeviceIds, store.ClaimDevice(lease.GetVgpu()))
	}
	first := leases[0].GetVgpu()
	res.DeviceId, res.Parent, res.Profile, res.VgpuUuid = store.ClaimDevice(first), first.GetParent(), first.GetProfile(), mdevUUID(first)
	log.Info("vGPU claimed", zap.Strings("device_ids", res.DeviceIds), zap.String("profile", first.GetProfile()))
	return res, nil
}

// deviceClaim is what one instance's claim asks for: vgpus of profile, or
// passthrough whole GPUs of model ("" any).
type deviceClaim struct {
	profile     string
	vgpus       int
	passthrough int
	model       string
}

func claimOf(profile string, vgpuCount, passthrough uint32, model string) deviceClaim {
	return deviceClaim{profile: profile, vgpus: store.VGPUCount(profile, vgpuCount), passthrough: int(passthrough), model: model}
}

// admittedClaim is the claim the instance's admitted record names: the
// host serves that kind, model and count and nothing else. A request that
// asks for anything else (a caller's mistake or a forgery; a spawn always
// sends what it recorded) is refused before anything is held.
func (a *Activities) admittedClaim(req *vmflowv1.ClaimVGPURequest) (deviceClaim, error) {
	rec, err := a.Store.Get(req.GetInstanceId())
	if err != nil {
		return deviceClaim{}, err
	}
	spec := rec.GetSpec()
	want := claimOf(spec.GetVgpuProfile(), spec.GetVgpuCount(), spec.GetGpuPassthroughCount(), spec.GetGpuPassthroughModel())
	got := claimOf(req.GetVgpuProfile(), req.GetVgpuCount(), req.GetGpuPassthroughCount(), req.GetGpuPassthroughModel())
	if got != want {
		return deviceClaim{}, fmt.Errorf("instance %s: %w: the request asks for %s, its admitted record for %s", req.GetInstanceId(), admission.ErrInvalid, got, want)
	}
	if want.vgpus == 0 && want.passthrough == 0 {
		return deviceClaim{}, fmt.Errorf("instance %s: %w: its record asks for no GPU", req.GetInstanceId(), admission.ErrInvalid)
	}
	return want, nil
}

func (c deviceClaim) String() string {
	switch {
	case c.passthrough > 0:
		return fmt.Sprintf("%d whole GPU(s) of model %q", c.passthrough, c.model)
	case c.vgpus > 0:
		return fmt.Sprintf("%d vGPU(s) of profile %q", c.vgpus, c.profile)
	}
	return "no GPU"
}

// mdevUUID is the claim's mdev UUID; empty for a vendor VF, whose UUID
// (QEMU's -uuid) sysfs never holds.
func mdevUUID(c *vmflowv1.VgpuLease) string {
	if c.GetDriver() == string(gpu.KindVendor) {
		return ""
	}
	return c.GetUuid()
}

// LaunchVM starts the instance's QEMU (with its vGPU) and returns once QMP says
// running; a running VM is returned as is, a refused admission is a
// non-retryable AdmissionRefused. With existing_only it starts nothing and
// anything but "runs as asked" is a non-retryable InstanceExists (invariant 9).
func (a *Activities) LaunchVM(ctx context.Context, req *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	log, err := a.begin(ctx, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	id := req.GetInstanceId()
	if req.GetExistingOnly() {
		res, err := a.existing(ctx, id)
		if err != nil {
			return nil, temporal.NewApplicationErrorWithOptions(err.Error(), workflows.ErrTypeInstanceExists,
				temporal.ApplicationErrorOptions{NonRetryable: true})
		}
		log.Info("instance exists and runs as asked", zap.Int32("pid", res.GetPid()))
		return res, nil
	}
	stop := heartbeat.Every(ctx, heartbeat.Interval, func() string { return "launching QEMU, waiting for QMP running" })
	res, err := a.Supervisor.Launch(ctx, id)
	stop()
	if err != nil {
		return nil, classify(fmt.Errorf("launch: %w", err))
	}
	if d := res.Timeline.ForkToRunning(); a.Metrics != nil && d > 0 {
		a.Metrics.LaunchDuration.Observe(d.Seconds())
	}
	crashpoint.Hit(crashpoint.ActivityLaunchVMDone)
	if !res.AlreadyRunning {
		a.changed()
	}
	fields := []zap.Field{zap.Int("pid", res.Identity.PID), zap.Bool("already_running", res.AlreadyRunning), zap.Duration("took", res.Duration)}
	if len(res.Timeline) > 0 {
		fields = append(fields, zap.Object("timeline_ms", res.Timeline))
	}
	log.Info("VM running", fields...)
	rec, err := a.Store.Get(id)
	if err != nil {
		return nil, classify(fmt.Errorf("launch: read the record back: %w", err))
	}
	return a.launchResult(rec, res.Identity.PID, res.AlreadyRunning), nil
}

// existing reports the instance's QEMU when it runs as asked, else an error
// naming its creator and what is there; it touches nothing (supervise.Existing).
func (a *Activities) existing(ctx context.Context, id string) (*vmflowv1.LaunchVMResult, error) {
	rec, err := a.Store.Get(id)
	if err != nil {
		return nil, fmt.Errorf("instance %s exists but its record cannot be read: %w", id, err)
	}
	res, err := a.Supervisor.Existing(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("instance %s, created by %s: %w: left as it is", id, store.CreatorOf(rec), err)
	}
	return a.launchResult(rec, res.Identity.PID, true), nil
}

// launchResult is LaunchVM's answer for rec's QEMU pid.
func (a *Activities) launchResult(rec *vmflowv1.InstanceRecord, pid int, already bool) *vmflowv1.LaunchVMResult {
	paths, _ := a.Store.Paths(rec.GetId())
	res := &vmflowv1.LaunchVMResult{Pid: int32(pid), QmpSocket: paths.Socket, AlreadyRunning: already, InstanceUuid: rec.GetSpec().GetUuid()}
	for i, lease := range store.HeldVGPUs(rec) {
		c := lease.GetVgpu()
		if i == 0 {
			res.VgpuUuid, res.VgpuDeviceId = mdevUUID(c), store.ClaimDevice(c)
		}
		res.GpuDeviceIds = append(res.GpuDeviceIds, store.ClaimDevice(c))
	}
	for _, lease := range store.HeldPassthrough(rec) {
		res.GpuDeviceIds = append(res.GpuDeviceIds, store.PassthroughDevices(lease)...)
	}
	if l := store.Capacity(rec); store.LeaseHeld(l) {
		res.NumaNodes, res.Cpus = l.GetCapacity().GetNumaNodes(), l.GetCapacity().GetCpus()
	}
	if l := store.Network(rec); store.LeaseHeld(l) {
		res.Ip, res.Mac = l.GetNetwork().GetAddress(), l.GetNetwork().GetMac()
	}
	return res
}

// BeginDelete writes the manual-stop marker, then Deleting (a clean-up only of
// its own spawn's record, invariant 9): another spawn's record is not_owned, a
// missing one "already absent", an unreadable one RecordUnreadable for a clean-up.
func (a *Activities) BeginDelete(ctx context.Context, req *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	log, err := a.begin(ctx, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	for _, f := range []struct{ field, v string }{
		{"only_if_created_by_workflow_id", req.GetOnlyIfCreatedByWorkflowId()},
		{"only_if_created_by_run_id", req.GetOnlyIfCreatedByRunId()},
	} {
		if err := admission.CheckBound(f.field, f.v); err != nil {
			return nil, classify(fmt.Errorf("begin delete: %w", err))
		}
	}
	l, err := a.Store.Lock(ctx, req.GetInstanceId())
	if err != nil {
		return nil, classify(fmt.Errorf("begin delete: %w", err))
	}
	defer func() { _ = l.Unlock() }()
	by := store.Spawn{WorkflowID: req.GetOnlyIfCreatedByWorkflowId(), RunID: req.GetOnlyIfCreatedByRunId()}
	begun, err := l.BeginDelete(by)
	switch {
	case err != nil:
		return nil, classify(err)
	case begun.Absent:
		log.Info("nothing to delete")
		return &vmflowv1.BeginDeleteResult{AlreadyAbsent: true}, nil
	case begun.NotOwned:
		log.Info("not deleted: another spawn created it", zap.String("created_by", begun.CreatedBy),
			zap.String("cleanup_for", by.WorkflowID+" (run "+by.RunID+")"))
		return &vmflowv1.BeginDeleteResult{NotOwned: true, CreatedBy: begun.CreatedBy}, nil
	}
	rec := begun.Record
	crashpoint.Hit(crashpoint.BeginDeleteRecorded)
	log.Info("delete begun", zap.String("state", store.StateName(rec.GetState())), zap.Bool("has_claim", store.ClaimHeld(rec)))
	return &vmflowv1.BeginDeleteResult{HasClaim: store.ClaimHeld(rec)}, nil
}

// StopVM runs the stop ladder (resuming where the record says it was).
func (a *Activities) StopVM(ctx context.Context, req *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	log, err := a.begin(ctx, req.GetInstanceId())
	if err != nil {
		return nil, err
	}
	graceful := gracefulTimeout(req.GetGracefulTimeoutSeconds(), a.DefaultGraceful)
	if uint64(req.GetGracefulTimeoutSeconds()) > uint64(contract.MaxGracefulTimeout/time.Second) {
		log.Warn("graceful timeout capped", zap.Uint32("requested_seconds", req.GetGracefulTimeoutSeconds()),
			zap.Duration("graceful", graceful))
	}
	started := time.Now()
	stop := heartbeat.Every(ctx, heartbeat.Interval, func() string {
		return fmt.Sprintf("stop ladder running for %s (graceful timeout %s)", time.Since(started).Round(time.Second), graceful)
	})
	res, err := a.Supervisor.Stop(ctx, req.GetInstanceId(), graceful)
	stop()
	if err != nil {
		return nil, classify(fmt.Errorf("stop: %w", err))
	}
	step := stepNeeded(res.StopResult)
	if a.Metrics != nil && !res.AlreadyGone {
		a.Metrics.StopDuration.WithLabelValues(step).Observe(res.Total.Seconds())
	}
	crashpoint.Hit(crashpoint.ActivityStopVMDone)
	log.Info("VM stopped", zap.String("step_reached", step), zap.Bool("already_gone", res.AlreadyGone),
		zap.Duration("took", res.Total), zap.Bool("child", res.Child))
	return &vmflowv1.StopVMResult{StepReached: step, DurationMs: uint32(min(res.Total.Milliseconds(), 1<<31))}, nil
}

// stepNeeded names the last ladder step taken before the group was gone
// ("powerdown", "quit", "kill"; "none" when nothing ran).
func stepNeeded(res vmm.StopResult) string {
	if res.AlreadyGone {
		return "none"
	}
	last := "none"
	for _, st := range res.Steps {
		if n, ok := supervise.StepReached(st.Step); ok && st.Via != "skipped" {
			last = n
		}
	}
	return last
}

// WaitVMExit returns once the VM's whole thread group is gone, heartbeating
// what it still sees ("2 tasks of pid 4242 still running").
func (a *Activities) WaitVMExit(ctx context.Context, ref *vmflowv1.InstanceRef) error {
	log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return err
	}
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

// ReleaseLeases releases every lease the instance holds through the lease
// engine (lease.Engine: one may-release rule, each kind by its driver, the
// network's address last), which refuses while the VM may live
// (invariants 2 and 1: a failure keeps lease and record, and the workflow
// retries).
func (a *Activities) ReleaseLeases(ctx context.Context, ref *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return nil, err
	}
	stop := heartbeat.Every(ctx, heartbeat.Interval, func() string { return "releasing the leases of " + ref.GetInstanceId() })
	out, err := LeaseEngine(a).Release(ctx, ref.GetInstanceId())
	stop()
	res := &vmflowv1.ReleaseVGPUResult{}
	if vg := out.Of(store.KindVGPU); len(vg) > 0 {
		for _, l := range vg {
			res.DeviceIds = append(res.DeviceIds, store.ClaimDevice(l.GetVgpu()))
		}
		res.DeviceId, res.Released = res.DeviceIds[0], err == nil
		log.Info("vGPU released", zap.Strings("device_ids", res.DeviceIds))
	}
	if err != nil {
		if a.Metrics != nil {
			a.Metrics.ReleaseFailures.WithLabelValues(errnoName(err)).Inc()
		}
		// The leases and the record are kept; the error goes back to the
		// workflow, which retries (logged by the SDK, not here).
		ce := classify(fmt.Errorf("release leases of %s: %w", ref.GetInstanceId(), err))
		if errors.Is(err, lease.ErrKindNotServed) {
			return nil, ce
		}
		return nil, retype(ce, workflows.ErrTypeReleaseFailed)
	}
	crashpoint.Hit(crashpoint.ActivityReleaseLeasesDone)
	a.changed()
	log.Info("leases released", zap.Int("released", len(out.Released)))
	return res, nil
}

// ReleaseVGPU is ReleaseLeases under the name histories recorded before
// the lease engine: a workflow that scheduled it still finds it.
func (a *Activities) ReleaseVGPU(ctx context.Context, ref *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	return a.ReleaseLeases(ctx, ref)
}

// LeaseEngine is the engine of the drivers a's fields serve (made per
// call: a few small structs, and fields set after a is made count). A
// function, not a method: every exported method of Activities is
// registered as an activity.
func LeaseEngine(a *Activities) *lease.Engine {
	cfg := a.LeaseConfig
	if cfg.Store == nil {
		cfg.Store = a.Store
	}
	if cfg.Logger == nil {
		cfg.Logger = a.Logger
	}
	if cfg.ReleaseTook == nil && a.Metrics != nil {
		cfg.ReleaseTook = a.Metrics.ObserveRelease
	}
	return NewLeaseEngine(cfg, a.GPUs, a.Whole, a.Network)
}

// NewLeaseEngine is the host's lease engine over the drivers it serves
// (a nil one is a kind the host has not): vGPUs, whole GPUs, then the
// network, whose address is released only after every device.
func NewLeaseEngine(cfg lease.EngineConfig, gpus GPUs, whole WholeGPUs, nw *network.Net) *lease.Engine {
	var devices []lease.Driver
	if gpus != nil {
		devices = append(devices, gpus.LeaseDriver())
	}
	if whole != nil {
		devices = append(devices, whole.LeaseDriver())
	}
	var net lease.Driver
	if nw != nil {
		net = nw.LeaseDriver()
	}
	return lease.NewHostEngine(cfg, devices, net)
}

// TearDown removes the VM's QMP socket and pidfile, refusing while any QEMU of
// the instance may live, recorded or not (supervise.TearDown).
func (a *Activities) TearDown(ctx context.Context, ref *vmflowv1.InstanceRef) error {
	log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return err
	}
	if err := a.Supervisor.TearDown(ctx, ref.GetInstanceId()); err != nil {
		return classify(fmt.Errorf("tear down: %w", err))
	}
	log.Info("runtime files removed")
	return nil
}

// DeleteRecord removes the instance record. The store refuses while it holds
// any lease (invariant 1); a record already gone is success.
func (a *Activities) DeleteRecord(ctx context.Context, ref *vmflowv1.InstanceRef) error {
	log, err := a.begin(ctx, ref.GetInstanceId())
	if err != nil {
		return err
	}
	err = a.Store.Delete(ctx, ref.GetInstanceId())
	if errors.Is(err, store.ErrNotFound) {
		return nil
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
	if err := store.ValidateID(req.GetHostId()); err != nil {
		return nil, classify(fmt.Errorf("reconcile: host_id: %w", err))
	}
	stop := heartbeat.Every(ctx, 10*time.Second, func() string { return "reconciling GPUs of " + req.GetHostId() })
	res, err := a.reconcileGPUs(ctx)
	stop()
	if err != nil {
		return nil, classify(fmt.Errorf("reconcile: %w", err))
	}
	a.log().Info("reconciled", zap.Uint32("claims_released", res.GetClaimsReleased()), zap.Uint32("orphans_removed", res.GetOrphansRemoved()),
		zap.Uint32("failed", res.GetFailed()), zap.String("host_id", req.GetHostId()))
	return res, nil
}
