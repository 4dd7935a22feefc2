package activities

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/worker"
	"go.uber.org/zap/zaptest"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/metrics"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

func TestMain(m *testing.M) {
	proctest.RunHelperIfRequested()
	os.Exit(m.Run())
}

// TestEveryWorkflowActivityIsRegistered: the workflows schedule activities
// by name; each name must be a method here, or the task would sit on the
// host queue forever.
func TestEveryWorkflowActivityIsRegistered(t *testing.T) {
	// What workflows.RegisterHostActivities registers: the agent's
	// methods and the combined activities made of them.
	types := []reflect.Type{reflect.TypeOf(&Activities{}), reflect.TypeOf(&workflows.CombinedActivities{})}
	for _, name := range workflows.HostActivityNames {
		n := 0
		for _, typ := range types {
			if _, ok := typ.MethodByName(name); ok {
				n++
			}
		}
		assert.Equal(t, 1, n, "activity %s: want a method on exactly one of *Activities and *workflows.CombinedActivities", name)
	}
}

type hostEnv struct {
	acts *Activities
	sim  *simtest.Sim
	st   *store.Store
	env  *testsuite.TestActivityEnvironment
}

// newHost assembles the real host-agent packages: a store in a short temp
// dir, a supervisor running real QEMU, vGPU claims over the simulator.
func newHost(t *testing.T) *hostEnv {
	t.Helper()
	return newHostPolicy(t, nil)
}

// newHostPolicy is newHost with the host's admission policy changed by
// policy (nil: the machine's own, no image roots).
func newHostPolicy(t *testing.T, policy func(*admission.Host)) *hostEnv {
	t.Helper()
	vmmtest.RequiresQEMU(t)
	h := &hostEnv{sim: simtest.Start(t, vgpusim.Options{MdevParents: 1})}
	dir := proctest.ShortDir(t, "ac")
	var err error
	h.st, err = store.New(dir)
	require.NoError(t, err)
	log := zaptest.NewLogger(t)
	gpus, err := lease.New(lease.Config{
		Driver: gpu.Config{SysfsRoot: h.sim.Root, StateDir: dir}, Store: h.st, DevRoot: t.TempDir(),
		Logger: log, IgnoreUninspectable: proctest.UninspectableInit(),
	})
	require.NoError(t, err)
	host, err := admission.SystemHost(nil, "", gpus.Profiles)
	require.NoError(t, err)
	if policy != nil {
		policy(&host)
	}
	h.acts = &Activities{Store: h.st, Host: host, GPUs: gpus, AttachVGPU: false, DefaultGraceful: time.Second, Logger: log,
		LeaseConfig: lease.EngineConfig{IgnoreUninspectable: proctest.UninspectableInit()}}
	sup, err := supervise.New(supervise.Config{Store: h.st, Logger: log, GracefulTimeout: time.Second,
		PrepareLaunch: admission.PrepareLaunch(host, gpus, false), ReadyTimeout: vmmtest.QEMUDeadline(vmm.DefaultReadyTimeout)})
	require.NoError(t, err)
	t.Cleanup(func() { sup.Close() })
	h.acts.Supervisor = sup
	var s testsuite.WorkflowTestSuite
	h.env = s.NewTestActivityEnvironment()
	workflows.RegisterHostActivities(h.env, h.acts)
	return h
}

func spawnReq(id string) *vmflowv1.SpawnRequest {
	return &vmflowv1.SpawnRequest{InstanceId: id, HostId: "h1", Vcpus: 1, MemoryMib: 64, Machine: "none",
		Accel: string(vmmtest.Accel()), VgpuProfile: "GRID A100-4C"}
}

func appError(t *testing.T, err error) *temporal.ApplicationError {
	t.Helper()
	var ae *temporal.ApplicationError
	require.ErrorAs(t, err, &ae, "%v", err)
	return ae
}

func (h *hostEnv) run(t *testing.T, fn any, in any, out any) error {
	t.Helper()
	v, err := h.env.ExecuteActivity(fn, in)
	if err == nil && out != nil {
		require.NoError(t, v.Get(out))
	}
	return err
}

// histogramCount is how many observations reg's histogram name holds in
// its series whose one label is value.
func histogramCount(t *testing.T, reg *prometheus.Registry, name, value string) uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if mf.GetName() == name && len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == value {
				return m.GetHistogram().GetSampleCount()
			}
		}
	}
	t.Fatalf("no %s series labelled %q", name, value)
	return 0
}

// TestSpawnAndDeleteThroughActivities runs every activity of both paths,
// each twice, against the real packages: the second run of each is a
// retry and must succeed without doing the work again. (ReleaseVGPU runs
// a third time: first it fails, on an injected fault.)
func TestSpawnAndDeleteThroughActivities(t *testing.T) {
	h := newHost(t)
	a := h.acts
	reg := prometheus.NewRegistry()
	am, err := metrics.New(reg, nil)
	require.NoError(t, err)
	a.Metrics = am
	req := spawnReq("vm1")
	ref := &vmflowv1.InstanceRef{InstanceId: "vm1"}

	require.NoError(t, h.run(t, a.ValidateSpawn, req, nil))
	require.NoError(t, h.run(t, a.ValidateSpawn, req, nil))
	var created vmflowv1.CreateRecordResult
	require.NoError(t, h.run(t, a.CreateRecord, req, &created))
	assert.Equal(t, admission.InstanceUUID("vm1"), created.GetInstanceUuid())
	require.NoError(t, h.run(t, a.CreateRecord, req, &created))
	assert.True(t, created.GetAlreadyExisted())

	var claim vmflowv1.ClaimVGPUResult
	cin := &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: req.GetVgpuProfile()}
	require.NoError(t, h.run(t, a.ClaimDevices, cin, &claim))
	var again vmflowv1.ClaimVGPUResult
	require.NoError(t, h.run(t, a.ClaimDevices, cin, &again))
	assert.Equal(t, claim.GetDeviceId(), again.GetDeviceId())

	var launched vmflowv1.LaunchVMResult
	require.NoError(t, h.run(t, a.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, &launched))
	require.NoError(t, h.run(t, a.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, &launched))
	assert.True(t, launched.GetAlreadyRunning(), "a retried launch returns the running VM")
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	vm := store.IdentityOf(rec.GetProcess())
	require.True(t, proc.Inspect(vm).Alive)

	// Delete.
	var begun vmflowv1.BeginDeleteResult
	require.NoError(t, h.run(t, a.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, &begun))
	assert.True(t, begun.GetHasClaim())
	marked, err := h.st.ManualStop("vm1")
	require.NoError(t, err)
	assert.True(t, marked, "the marker comes before any stop action")
	require.NoError(t, h.run(t, a.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, &begun))

	var stopped vmflowv1.StopVMResult
	require.NoError(t, h.run(t, a.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1", GracefulTimeoutSeconds: 1}, &stopped))
	assert.NotEqual(t, "none", stopped.GetStepReached())
	first := stopped.GetStepReached()
	require.NoError(t, h.run(t, a.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1"}, &stopped))
	assert.Equal(t, "none", stopped.GetStepReached(), "nothing left to stop")
	// The stop is timed under the step it needed; the retry, which found
	// the VM gone, is not a stop.
	for _, step := range metrics.StopSteps {
		want := uint64(0)
		if step == first {
			want = 1
		}
		assert.Equal(t, want, histogramCount(t, reg, "vmflow_stop_duration_seconds", step), "stops that ended at %s", step)
	}
	require.NoError(t, h.run(t, a.WaitVMExit, ref, nil))
	assert.False(t, proc.Inspect(vm).Alive)
	require.NoError(t, h.run(t, a.WaitVMExit, ref, nil))

	// A failed release: typed, retryable, record and claim kept, and the
	// record cannot be deleted.
	h.sim.Set(t, vgpusim.CtlFailRelease, "EBUSY")
	err = h.run(t, a.ReleaseLeases, ref, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeReleaseFailed, ae.Type())
	assert.False(t, ae.NonRetryable())
	assert.Contains(t, err.Error(), "device or resource busy")
	err = h.run(t, a.DeleteRecord, ref, nil)
	assert.Equal(t, workflows.ErrTypeClaimHeld, appError(t, err).Type())
	rec, err = h.st.Get("vm1")
	require.NoError(t, err)
	assert.True(t, store.ClaimHeld(rec))

	h.sim.Clear(t, vgpusim.CtlFailRelease)
	var rel vmflowv1.ReleaseVGPUResult
	require.NoError(t, h.run(t, a.ReleaseLeases, ref, &rel))
	assert.True(t, rel.GetReleased())
	require.NoError(t, h.run(t, a.ReleaseLeases, ref, &rel))
	assert.False(t, rel.GetReleased(), "nothing left to release")
	// Both releases the driver carried out are timed, the failed one too,
	// and the failure is counted by its errno.
	assert.Equal(t, uint64(2), histogramCount(t, reg, "vmflow_lease_release_duration_seconds", store.KindVGPU))
	assert.Equal(t, uint64(0), histogramCount(t, reg, "vmflow_lease_release_duration_seconds", store.KindNetwork))
	assert.Equal(t, 1.0, testutil.ToFloat64(am.ReleaseFailures.WithLabelValues("EBUSY")))

	require.NoError(t, h.run(t, a.TearDown, ref, nil))
	require.NoError(t, h.run(t, a.TearDown, ref, nil))
	require.NoError(t, h.run(t, a.DeleteRecord, ref, nil))
	require.NoError(t, h.run(t, a.DeleteRecord, ref, nil))
	_, err = h.st.Get("vm1")
	assert.ErrorIs(t, err, store.ErrNotFound)
	require.NoError(t, h.run(t, a.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, &begun))
	assert.True(t, begun.GetAlreadyAbsent())
}

func TestValidationErrorsAreNonRetryable(t *testing.T) {
	h := newHost(t)
	req := spawnReq("vm1")
	req.VgpuProfile = "GRID Z9-1Q"
	err := h.run(t, h.acts.ValidateSpawn, req, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeInvalidInput, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, err.Error(), "vgpu_profile")
	entries, err := os.ReadDir(filepath.Join(h.st.StateDir(), "instances"))
	require.NoError(t, err, "store.New made the instances folder")
	assert.Empty(t, entries, "nothing created for a rejected request")

	// An id that would be a path never reaches one.
	err = h.run(t, h.acts.CreateRecord, spawnReq("../etc"), nil)
	assert.Equal(t, workflows.ErrTypeInvalidInput, appError(t, err).Type())
}

// TestReconcileHostReleasesParkedDelete runs ReconcileHost, the activity
// behind the host's reconcile Schedule, over a delete parked on a failed
// release: while the fault lasts it releases nothing and keeps the claim;
// once it is gone the round releases the claim (the device goes) and names
// the delete to wake; a second round (a retry) releases nothing more.
func TestReconcileHostReleasesParkedDelete(t *testing.T) {
	h := newHost(t)
	a, req, ref := h.acts, spawnReq("vm1"), &vmflowv1.InstanceRef{InstanceId: "vm1"}
	require.NoError(t, h.run(t, a.CreateRecord, req, nil))
	require.NoError(t, h.run(t, a.ClaimDevices, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: req.GetVgpuProfile()}, nil))
	devices := func() []os.DirEntry {
		t.Helper()
		entries, err := os.ReadDir(h.sim.Path("bus", "mdev", "devices"))
		require.NoError(t, err)
		return entries
	}
	require.Len(t, devices(), 1)
	// A delete of an instance that never launched: the ladder has nothing
	// to stop and says gone, which lets a release go ahead.
	require.NoError(t, h.run(t, a.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, nil))
	_, err := h.st.ManualStop("vm1")
	require.NoError(t, err)
	require.NoError(t, h.run(t, a.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1"}, nil))
	h.sim.Set(t, vgpusim.CtlFailRelease, "EIO")
	require.Error(t, h.run(t, a.ReleaseLeases, ref, nil))

	host := &vmflowv1.ReconcileVGPURequest{HostId: "h1"}
	var res vmflowv1.ReconcileVGPUResult
	require.NoError(t, h.run(t, a.ReconcileHost, host, &res))
	assert.Equal(t, uint32(1), res.GetFailed(), "the release still fails")
	assert.Zero(t, res.GetClaimsReleased())
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.True(t, store.ClaimHeld(rec), "claim kept while the release fails")
	assert.Len(t, devices(), 1)

	h.sim.Clear(t, vgpusim.CtlFailRelease)
	res = vmflowv1.ReconcileVGPUResult{}
	require.NoError(t, h.run(t, a.ReconcileHost, host, &res))
	assert.Equal(t, uint32(1), res.GetClaimsReleased())
	assert.Equal(t, []string{"vm1"}, res.GetRetriedDeletes(), "the parked delete is named, to be woken")
	rec, err = h.st.Get("vm1")
	require.NoError(t, err)
	assert.False(t, store.ClaimHeld(rec), "claim released")
	assert.Empty(t, devices(), "device removed")

	res = vmflowv1.ReconcileVGPUResult{}
	require.NoError(t, h.run(t, a.ReconcileHost, host, &res))
	assert.Zero(t, res.GetClaimsReleased(), "nothing left to release")
	assert.Zero(t, res.GetFailed())
	var rel vmflowv1.ReleaseVGPUResult
	require.NoError(t, h.run(t, a.ReleaseLeases, ref, &rel))
	assert.False(t, rel.GetReleased(), "the delete's own release finds it done")
}

func TestConflictingCreateAndSpawnWhileDeleting(t *testing.T) {
	h := newHost(t)
	req := spawnReq("vm1")
	require.NoError(t, h.run(t, h.acts.CreateRecord, req, nil))
	other := spawnReq("vm1")
	other.MemoryMib = 128
	err := h.run(t, h.acts.CreateRecord, other, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeConflict, ae.Type())
	assert.True(t, ae.NonRetryable())

	require.NoError(t, h.run(t, h.acts.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, nil))
	err = h.run(t, h.acts.CreateRecord, req, nil)
	assert.Equal(t, workflows.ErrTypeInstanceDeleting, appError(t, err).Type())
}

// TestOverlappingStopIsBusy: a StopVM attempt that overlaps a previous
// attempt still running its ladder (the heartbeat timed out, the server
// retried) fails fast with a retryable Busy instead of running a second
// ladder; the first goes on to the end.
func TestOverlappingStopIsBusy(t *testing.T) {
	h := newHost(t)
	req := spawnReq("vm1")
	req.VgpuProfile = ""
	require.NoError(t, h.run(t, h.acts.CreateRecord, req, nil))
	require.NoError(t, h.run(t, h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, nil))
	require.NoError(t, h.run(t, h.acts.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, nil))

	// machine none ignores the power button: the first ladder sits in its
	// graceful wait while the second attempt arrives.
	first := newActivityEnv(t, h.acts, 30*time.Second)
	done := make(chan error, 1)
	go func() {
		_, err := first.ExecuteActivity(h.acts.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1", GracefulTimeoutSeconds: 5})
		done <- err
	}()
	require.Eventually(t, func() bool {
		rec, err := h.st.Get("vm1")
		return err == nil && rec.GetStopStep() == vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT
	}, 10*time.Second, 5*time.Millisecond)
	_, err := newActivityEnv(t, h.acts, 30*time.Second).ExecuteActivity(h.acts.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1"})
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeBusy, ae.Type())
	assert.False(t, ae.NonRetryable())
	select {
	case err := <-done:
		t.Fatalf("the second attempt waited for the first (which returned %v) instead of failing fast", err)
	default:
	}
	require.NoError(t, <-done)
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.StopStep_STOP_STEP_GONE, rec.GetStopStep())
}

// newActivityEnv is an activity test environment of its own for acts (one
// per concurrent call), whose activities' contexts end after timeout (the
// test environment's own StartToClose is ten minutes).
func newActivityEnv(t *testing.T, acts *Activities, timeout time.Duration) *testsuite.TestActivityEnvironment {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	var s testsuite.WorkflowTestSuite
	env := s.NewTestActivityEnvironment()
	env.SetWorkerOptions(worker.Options{BackgroundActivityContext: ctx})
	workflows.RegisterHostActivities(env, acts)
	return env
}

func TestClassify(t *testing.T) {
	tests := []struct {
		err          error
		typ          string
		nonRetryable bool
	}{
		{&admission.FieldError{Field: "kernel", Reason: "outside"}, workflows.ErrTypeInvalidInput, true},
		{store.ErrInvalidID, workflows.ErrTypeInvalidInput, true},
		{store.ErrConflict, workflows.ErrTypeConflict, true},
		{supervise.ErrManualStop, workflows.ErrTypeInstanceDeleting, true},
		{fmt.Errorf("launch instance vm1: %w (state deleting)", store.ErrDeleting), workflows.ErrTypeInstanceDeleting, true},
		{fmt.Errorf("stop instance vm1: %w", store.ErrManualStopMissing), workflows.ErrTypeManualStopMissing, true},
		{fmt.Errorf("launch: instance vm1: %w: it has a vGPU", supervise.ErrNoSpec), workflows.ErrTypeHostMisconfigured, true},
		{proc.ErrIncompleteIdentity, workflows.ErrTypeIdentityMismatch, true},
		{store.ErrBusy, workflows.ErrTypeBusy, false},
		{store.ErrClaimHeld, workflows.ErrTypeClaimHeld, false},
		{gpu.ErrNoCapacity, workflows.ErrTypeNoCapacity, false},
		{store.ErrInvalidRecord, workflows.ErrTypeRecordUnreadable, true},
		{lease.ErrKindNotServed, workflows.ErrTypeVGPUUnavailable, true},
		{gpu.ErrClaimedByOther, workflows.ErrTypeDeviceClaimedTwice, true},
		{supervise.ErrUnrecordedAmbiguous, workflows.ErrTypeAmbiguousQEMU, true},
		{supervise.ErrStillRunning, workflows.ErrTypeStillAlive, false},
		{lease.ErrClaimDeviceMissing, workflows.ErrTypeClaimDeviceMissing, false},
		{gpu.ErrRecordsUnreadable, workflows.ErrTypeUnavailable, false},
		{fmt.Errorf("%w: %w", admission.ErrAdmissionRefused, &admission.FieldError{Field: "disk", Reason: "gone"}), workflows.ErrTypeAdmissionRefused, true},
		{fmt.Errorf("instance vm1: %w: record unreadable: %w", supervise.ErrNotRunningAsAsked, store.ErrInvalidRecord), workflows.ErrTypeInstanceExists, true},
		{fmt.Errorf("release: %w", lease.ErrVMAlive), workflows.ErrTypeStillAlive, false},
		{fmt.Errorf("release: %w", gpu.ErrInvalid), workflows.ErrTypeInternal, false},
		{&store.TransitionError{}, workflows.ErrTypeInternal, false},
		{fmt.Errorf("stop: %w", vmm.ErrMonitorClosed), workflows.ErrTypeUnavailable, false},
		{fmt.Errorf("stop: %w", proc.ErrNotFound), workflows.ErrTypeNotFound, false},
		// A hook names the step; its cause gives the class, or none.
		{fmt.Errorf("launch: OnStarted: %w: %w", vmm.ErrHook, store.ErrDiskFull), workflows.ErrTypeAdmissionRefused, true},
		{fmt.Errorf("launch: OnStarted: %w: %w", vmm.ErrHook, syscall.EIO), workflows.ErrTypeHost, false},
		{fmt.Errorf("launch: %w", &vmm.KVMAccessError{Path: "/dev/kvm", Mode: 0o600}), workflows.ErrTypeHostMisconfigured, true},
		{vmm.ErrNoQEMUUID, workflows.ErrTypeHostMisconfigured, true},
		{fmt.Errorf("launch: %w", store.ErrNoFreeUID), workflows.ErrTypeNoQEMUUID, false},
		{fmt.Errorf("launch: %w: /etc/subuid line 1", store.ErrUIDRangeTaken), workflows.ErrTypeHostMisconfigured, true},
		{fmt.Errorf("launch: %w: needs 1088 MiB", vmm.ErrMemlockLimit), workflows.ErrTypeHostMisconfigured, true},
		{fmt.Errorf("create vm1: %w: 1024 bytes free", store.ErrDiskFull), workflows.ErrTypeAdmissionRefused, true},
		{fmt.Errorf("delete vm1: %w", store.ErrProcessMayLive), workflows.ErrTypeStillAlive, false},
		{syscall.EIO, workflows.ErrTypeHost, false},
		{errors.New("anything else"), workflows.ErrTypeHost, false},
	}
	for _, tt := range tests {
		ae := appError(t, classify(tt.err))
		assert.Equal(t, tt.typ, ae.Type(), "%v", tt.err)
		assert.Equal(t, tt.nonRetryable, ae.NonRetryable(), "%v", tt.err)
		assert.Equal(t, tt.err.Error(), ae.Message(), "the message is the host error's text, once")
		assert.NoError(t, errors.Unwrap(ae), "no chain of causes to repeat it")
	}
	assert.NoError(t, classify(nil))
	assert.Equal(t, "EBUSY", errnoName(syscall.EBUSY))
	assert.Equal(t, "vm_alive", errnoName(lease.ErrVMAlive))
	assert.Equal(t, workflows.ErrTypeReleaseFailed, appError(t, retype(classify(syscall.EBUSY), workflows.ErrTypeReleaseFailed)).Type(),
		"an error from outside becomes the release's own type")
	assert.Equal(t, workflows.ErrTypeBusy, appError(t, retype(classify(store.ErrBusy), workflows.ErrTypeReleaseFailed)).Type(),
		"a classified one keeps its class's")
}

func TestStepNeeded(t *testing.T) {
	step := func(s vmm.StopStep, via string) vmm.StepResult { return vmm.StepResult{Step: s, Via: via} }
	tests := []struct {
		res  vmm.StopResult
		want string
	}{
		{vmm.StopResult{AlreadyGone: true}, "none"},
		{vmm.StopResult{Steps: []vmm.StepResult{step(vmm.StepPowerdownSent, "qmp"), step(vmm.StepGone, "")}}, "powerdown"},
		{vmm.StopResult{Steps: []vmm.StepResult{step(vmm.StepPowerdownSent, "qmp"), step(vmm.StepQuitSent, "qmp"), step(vmm.StepGone, "")}}, "quit"},
		{vmm.StopResult{Steps: []vmm.StepResult{step(vmm.StepPowerdownSent, "skipped"), step(vmm.StepQuitSent, "sigterm"), step(vmm.StepKillSent, "sigkill")}}, "kill"},
		{vmm.StopResult{Steps: []vmm.StepResult{step(vmm.StepPowerdownSent, "skipped"), step(vmm.StepGone, "")}}, "none"},
	}
	for _, tt := range tests {
		assert.Equal(t, tt.want, stepNeeded(tt.res), "%+v", tt.res.Steps)
	}
}
