package workflows

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// stubHost registers the host activities under their real names; every
// test mocks the calls it expects with env.OnActivity(h.Method, ...).
type stubHost struct{}

var _ HostActivities = (*stubHost)(nil)

func (*stubHost) ValidateSpawn(context.Context, *vmflowv1.SpawnRequest) error { return nil }
func (*stubHost) CreateRecord(context.Context, *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	return nil, nil
}
func (*stubHost) ClaimDevices(context.Context, *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	return nil, nil
}
func (*stubHost) LaunchVM(context.Context, *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	return nil, nil
}
func (*stubHost) BeginDelete(context.Context, *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	return nil, nil
}
func (*stubHost) StopVM(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	return nil, nil
}
func (*stubHost) WaitVMExit(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (*stubHost) ReleaseLeases(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	return nil, nil
}
func (*stubHost) TearDown(context.Context, *vmflowv1.InstanceRef) error     { return nil }
func (*stubHost) DeleteRecord(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (*stubHost) ReconcileHost(context.Context, *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	return nil, nil
}

var h *stubHost // method references for OnActivity, as samples-go does

// stubFleet stands for platform/fleet's Placer: the local activities are
// registered under their names and mocked by name in each test.
type stubFleet struct{}

func (stubFleet) ChooseHosts(context.Context, *vmflowv1.ChooseHostsRequest) (*vmflowv1.ChooseHostsResult, error) {
	return &vmflowv1.ChooseHostsResult{}, nil
}
func (stubFleet) FindInstanceHost(context.Context, *vmflowv1.FindInstanceHostRequest) (*vmflowv1.FindInstanceHostResult, error) {
	return &vmflowv1.FindInstanceHostResult{}, nil
}

type env struct {
	*testsuite.TestWorkflowEnvironment
	t        *testing.T
	upserts  []map[string]any // every search-attribute upsert, in order
	lastSeen map[string]any
}

// newEnv is a test environment for the path of spawn and delete runs
// recorded before the combined activities (spawn version 3, delete version
// 4: one host activity per step), which replay and go on on this worker:
// its tests mock each step. newCombinedEnv's run the combined path.
func newEnv(t *testing.T) *env { return newEnvWith(t, Config{}) }

// newEnvWith is newEnv with a worker configuration of the test's own.
func newEnvWith(t *testing.T, cfg Config) *env {
	e := newCombinedEnvWith(t, cfg)
	e.OnGetVersion(changeLazySA, workflow.DefaultVersion, spawnVersionCombined).Return(spawnVersionCombined - 1).Maybe()
	e.OnGetVersion(changeLazySA, workflow.DefaultVersion, 1).Return(workflow.Version(1)).Maybe() // a reconcile's, as unmocked
	e.OnGetVersion(versionStuckBound, workflow.DefaultVersion, deleteVersionCombined).Return(deleteVersionCombined - 1).Maybe()
	return e
}

// newCombinedEnv is a test environment for new runs: spawns through
// PrepareSpawn, deletes through StopInstance and RemoveInstance.
func newCombinedEnv(t *testing.T) *env { return newCombinedEnvWith(t, Config{}) }

func newCombinedEnvWith(t *testing.T, cfg Config) *env {
	var s testsuite.WorkflowTestSuite
	e := &env{TestWorkflowEnvironment: s.NewTestWorkflowEnvironment(), t: t, lastSeen: map[string]any{}}
	New(cfg).Register(e)
	RegisterHostActivities(e, &stubHost{})
	e.RegisterActivityWithOptions(stubFleet{}.ChooseHosts, activity.RegisterOptions{Name: LocalActivityChooseHosts})
	e.RegisterActivityWithOptions(stubFleet{}.FindInstanceHost, activity.RegisterOptions{Name: LocalActivityFindInstanceHost})
	e.OnUpsertTypedSearchAttributes(mock.Anything).Run(func(args mock.Arguments) {
		sa := args.Get(0).(temporal.SearchAttributes)
		m := map[string]any{}
		for k, v := range sa.GetUntypedValues() {
			m[k.GetName()] = v
			e.lastSeen[k.GetName()] = v
		}
		e.upserts = append(e.upserts, m)
	}).Return(nil).Maybe()
	return e
}

// counted makes calls to the named activities visible to
// AssertActivityNumberOfCalls: an unmocked activity runs the stub unseen.
func (e *env) counted(names ...string) {
	for _, n := range names {
		switch n {
		case "CreateRecord":
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(&vmflowv1.CreateRecordResult{CreatedByThisSpawn: true}, nil).Maybe()
		case "ValidateSpawn":
			e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(nil).Maybe()
		case "StopVM":
			e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{}, nil).Maybe()
		case "TearDown":
			e.OnActivity(h.TearDown, mock.Anything, mock.Anything).Return(nil).Maybe()
		case "DeleteRecord":
			e.OnActivity(h.DeleteRecord, mock.Anything, mock.Anything).Return(nil).Maybe()
		case "ReleaseLeases":
			e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{}, nil).Maybe()
		default:
			e.t.Fatalf("counted: add %s", n)
		}
	}
}

// visibleStages is the VmStage values the upserts set, in order, each
// change once: what a visibility query saw.
func (e *env) visibleStages() []string {
	var stages []string
	for _, u := range e.upserts {
		if s, ok := u["VmStage"].(string); ok && (len(stages) == 0 || stages[len(stages)-1] != s) {
			stages = append(stages, s)
		}
	}
	return stages
}

// cleanupStarted mocks the clean-up delete a failed spawn starts as a
// child; the returned func gives its request (nil: none started).
func (e *env) cleanupStarted() func() *vmflowv1.DeleteRequest {
	var childReq *vmflowv1.DeleteRequest
	e.OnWorkflow(DeleteWorkflow, mock.Anything, mock.Anything).Return(
		func(_ workflow.Context, r *vmflowv1.DeleteRequest) (*vmflowv1.DeleteResult, error) {
			childReq = r
			return &vmflowv1.DeleteResult{}, nil
		}).Maybe()
	return func() *vmflowv1.DeleteRequest { return childReq }
}

func (e *env) status() *vmflowv1.WorkflowStatus {
	e.t.Helper()
	v, err := e.QueryWorkflow(StatusQuery)
	require.NoError(e.t, err)
	var st vmflowv1.WorkflowStatus
	require.NoError(e.t, v.Get(&st))
	return &st
}

func spawnReq() *vmflowv1.SpawnRequest {
	return &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 1, MemoryMib: 128, Machine: "none"}
}

func deleteReq() *vmflowv1.DeleteRequest {
	return &vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1"}
}

func appErr(typ string, nonRetryable bool) error {
	return temporal.NewApplicationErrorWithOptions("boom: "+typ, typ, temporal.ApplicationErrorOptions{NonRetryable: nonRetryable})
}

var releaseErr = temporal.NewApplicationError("release vGPU 1234: write remove: device or resource busy (EBUSY)", ErrTypeReleaseFailed)

func (e *env) happyDelete() {
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil).Once()
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{StepReached: "quit"}, nil).Once()
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.TearDown, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.DeleteRecord, mock.Anything, mock.Anything).Return(nil).Once()
}

func TestSpawnHappy(t *testing.T) {
	e := newEnv(t)
	req := spawnReq()
	req.VgpuProfile = "GRID A100-4C"
	e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(&vmflowv1.CreateRecordResult{InstanceUuid: "u-1", CreatedByThisSpawn: true}, nil).Once()
	e.OnActivity(h.ClaimDevices, mock.Anything, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: "GRID A100-4C"}).
		Return(&vmflowv1.ClaimVGPUResult{DeviceId: "0000:3b:00.4", VgpuUuid: "", DeviceIds: []string{"0000:3b:00.4"}}, nil).Once()
	e.OnActivity(h.LaunchVM, mock.Anything, mock.Anything).
		Return(&vmflowv1.LaunchVMResult{Pid: 42, QmpSocket: "/s", Ip: "10.88.0.2/24", Mac: "52:54:00:12:34:56"}, nil).Once()

	e.ExecuteWorkflow(SpawnWorkflow, req)
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.SpawnResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.EqualValues(t, 42, res.GetPid())
	assert.Equal(t, "0000:3b:00.4", res.GetVgpuDeviceId())
	assert.Empty(t, res.GetVgpuUuid(), "a vendor VF has no mdev UUID; the device id is not one")
	assert.Equal(t, "u-1", res.GetInstanceUuid())
	st := e.status()
	assert.Equal(t, StageRunning, st.GetStage())
	assert.True(t, st.GetMetadataRetained())
	assert.Equal(t, []string{"0000:3b:00.4"}, st.GetGpuDeviceIds(), "the status query names what the VM was given")
	assert.Equal(t, "10.88.0.2/24", st.GetIp())
	assert.Equal(t, "52:54:00:12:34:56", st.GetMac())
	assert.Equal(t, "vm1", e.lastSeen["VmInstanceId"])
	assert.Equal(t, "h1", e.lastSeen["VmHostId"])
	assert.Equal(t, StageRunning, e.lastSeen["VmStage"])
	e.AssertExpectations(t)
}

func TestSpawnRejectsInvalidInputAndCreatesNothing(t *testing.T) {
	bad := map[string]func(*vmflowv1.SpawnRequest){
		"instance id with slash": func(r *vmflowv1.SpawnRequest) { r.InstanceId = "../etc" },
		"empty instance id":      func(r *vmflowv1.SpawnRequest) { r.InstanceId = "" },
		"upper-case host id":     func(r *vmflowv1.SpawnRequest) { r.HostId = "H1" },
		"long host id":           func(r *vmflowv1.SpawnRequest) { r.HostId = string(make([]byte, 64)) },
	}
	for name, mutate := range bad {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			req := spawnReq()
			mutate(req)
			e.counted("ValidateSpawn", "CreateRecord")
			e.ExecuteWorkflow(SpawnWorkflow, req)
			require.True(t, e.IsWorkflowCompleted())
			var ae *temporal.ApplicationError
			require.ErrorAs(t, e.GetWorkflowError(), &ae)
			assert.Equal(t, ErrTypeInvalidInput, ae.Type())
			assert.True(t, ae.NonRetryable())
			e.AssertActivityNumberOfCalls(t, "CreateRecord", 0)
			e.AssertActivityNumberOfCalls(t, "ValidateSpawn", 0)
		})
	}
	// Host-side validation (image roots, profiles, size) rejects too: the
	// message names the field, and nothing is created.
	t.Run("host rejects", func(t *testing.T) {
		e := newEnv(t)
		e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).
			Return(temporal.NewNonRetryableApplicationError("vgpu_profile \"GRID X\": not offered by host h1", ErrTypeInvalidInput, nil)).Once()
		e.ExecuteWorkflow(SpawnWorkflow, spawnReq())
		require.Error(t, e.GetWorkflowError())
		assert.Contains(t, e.GetWorkflowError().Error(), "vgpu_profile")
		assert.Equal(t, StageSpawnFailed, e.status().GetStage())
		e.AssertExpectations(t)
	})
}

// TestSpawnFailureStartsDeletePath: a failure after the record exists starts
// DeleteInstance as a child and fails with the original error; a failure
// before it (or a record that is not this spawn's) starts nothing.
func TestSpawnFailureStartsDeletePath(t *testing.T) {
	steps := []struct {
		name       string
		setup      func(e *env)
		wantDelete bool
		wantType   string
	}{
		{"create record fails", func(e *env) {
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(nil, appErr("Disk", false))
		}, true, "Disk"},
		{"conflicting record", func(e *env) {
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(nil, appErr(ErrTypeConflict, true))
		}, false, ErrTypeConflict},
		{"instance being deleted", func(e *env) {
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(nil, appErr(ErrTypeInstanceDeleting, true))
		}, false, ErrTypeInstanceDeleting},
		{"unreadable record", func(e *env) {
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(nil, appErr(ErrTypeRecordUnreadable, true))
		}, false, ErrTypeRecordUnreadable},
		{"another spawn's instance is not running", func(e *env) {
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(&vmflowv1.CreateRecordResult{AlreadyExisted: true}, nil)
			e.OnActivity(h.LaunchVM, mock.Anything, &vmflowv1.LaunchVMRequest{InstanceId: "vm1", ExistingOnly: true}).
				Return(nil, appErr(ErrTypeInstanceExists, true))
		}, false, ErrTypeInstanceExists},
		{"busy on create", func(e *env) {
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(nil, appErr(ErrTypeBusy, false))
		}, true, ErrTypeBusy},
		{"claim fails", func(e *env) {
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(&vmflowv1.CreateRecordResult{CreatedByThisSpawn: true}, nil)
			e.OnActivity(h.ClaimDevices, mock.Anything, mock.Anything).Return(nil, appErr("NoCapacity", true))
		}, true, "NoCapacity"},
		{"launch fails", func(e *env) {
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(&vmflowv1.CreateRecordResult{CreatedByThisSpawn: true}, nil)
			e.OnActivity(h.ClaimDevices, mock.Anything, mock.Anything).Return(&vmflowv1.ClaimVGPUResult{DeviceId: "d"}, nil)
			e.OnActivity(h.LaunchVM, mock.Anything, mock.Anything).Return(nil, appErr("LaunchExited", true))
		}, true, "LaunchExited"},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			e := newEnv(t)
			e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(nil)
			s.setup(e)
			cleanup := e.cleanupStarted()
			req := spawnReq()
			req.VgpuProfile = "GRID A100-4C"
			e.ExecuteWorkflow(SpawnWorkflow, req)
			childReq := cleanup()
			require.True(t, e.IsWorkflowCompleted())
			var ae *temporal.ApplicationError
			require.ErrorAs(t, e.GetWorkflowError(), &ae)
			assert.Equal(t, s.wantType, ae.Type(), "the spawn fails with the original error")
			if s.wantDelete {
				require.NotNil(t, childReq, "delete path not started")
				assert.Equal(t, "vm1", childReq.GetInstanceId())
				assert.Equal(t, "h1", childReq.GetHostId())
				// The host deletes only what this very spawn created.
				assert.Equal(t, "default-test-workflow-id", childReq.GetOnlyIfCreatedByWorkflowId())
				assert.Equal(t, "default-test-run-id", childReq.GetOnlyIfCreatedByRunId())
			} else {
				assert.Nil(t, childReq, "a record that is not this spawn's must not be deleted")
			}
			assert.Equal(t, StageSpawnFailed, e.status().GetStage())
		})
	}
}

func TestDeleteHappy(t *testing.T) {
	e := newEnv(t)
	e.happyDelete()
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{Released: true}, nil).Once()
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.False(t, res.GetAlreadyAbsent())
	st := e.status()
	assert.Equal(t, StageDeleted, st.GetStage())
	assert.False(t, st.GetMetadataRetained())
	assert.False(t, st.GetNeedsAttention())
	assert.Equal(t, false, e.lastSeen["VmNeedsAttention"])
	// The stages a visibility query sees, in order: the first and the
	// last (stage progress in between goes to Current Details only, which
	// is not billed; see tracker.lazy).
	stages := e.visibleStages()
	assert.Equal(t, []string{StageMarkingStopped, StageDeleted}, stages)
	e.AssertExpectations(t)
	e.AssertActivityNumberOfCalls(t, "DeleteRecord", 1)
}

func TestDeleteAlreadyAbsent(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{AlreadyAbsent: true}, nil).Once()
	e.counted("StopVM")
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.True(t, res.GetAlreadyAbsent())
	e.AssertActivityNumberOfCalls(t, "StopVM", 0)
}

func TestDeleteReleaseFailsThenSucceeds(t *testing.T) {
	e := newEnv(t)
	e.happyDelete()
	const failures = 3
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(nil, releaseErr).Times(failures * int(retryFew.MaximumAttempts))
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{Released: true}, nil).Once()
	start := e.Now()
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	// Three rounds: 30 s, 60 s and 120 s of backoff between them (plus the
	// SDK's own retries inside each round).
	assert.GreaterOrEqual(t, e.Now().Sub(start), 210*time.Second)
	assert.Equal(t, StageDeleted, e.status().GetStage())
	assert.False(t, e.status().GetNeedsAttention())
	e.AssertExpectations(t)
}

// TestDeleteReleaseFailingForGood: the delete keeps running, flags itself for
// attention, says why in status, and never deletes the record.
func TestDeleteReleaseFailingForGood(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{}, nil)
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil)
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(nil, releaseErr)
	e.counted("TearDown", "DeleteRecord")
	var st *vmflowv1.WorkflowStatus
	e.RegisterDelayedCallback(func() {
		st = e.status()
		e.CancelWorkflow()
	}, 6*time.Hour)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NotNil(t, st)
	assert.Equal(t, StageReleaseFailed, st.GetStage())
	assert.True(t, st.GetNeedsAttention())
	assert.True(t, st.GetMetadataRetained())
	assert.Contains(t, st.GetLastError(), "EBUSY")
	assert.Greater(t, st.GetAttempt(), uint32(5))
	assert.NotEmpty(t, st.GetNextRetryTime())
	assert.Equal(t, true, e.lastSeen["VmNeedsAttention"])
	assert.Equal(t, StageReleaseFailed, e.lastSeen["VmStage"])
	e.AssertActivityNumberOfCalls(t, "DeleteRecord", 0)
	e.AssertActivityNumberOfCalls(t, "TearDown", 0)
	var ce *temporal.CanceledError
	assert.ErrorAs(t, e.GetWorkflowError(), &ce, "only a cancel ends it")
}

// TestRetrySignalCutsBackoffShort: after the backoff has grown to 15
// minutes, a retry signal makes the next round happen at once.
func TestRetrySignalCutsBackoffShort(t *testing.T) {
	e := newEnv(t)
	e.happyDelete()
	failing := true
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
			if failing {
				return nil, releaseErr
			}
			return &vmflowv1.ReleaseVGPUResult{Released: true}, nil
		})
	var signalledAt time.Time
	var before *vmflowv1.WorkflowStatus
	// Rounds at 0, 30s, 1m30, 3m30, 7m30, 15m30, 30m30: by 40 min the wait
	// is the full 15 minutes.
	e.RegisterDelayedCallback(func() {
		before = e.status()
		failing = false
		signalledAt = e.Now()
		e.SignalWorkflow(RetrySignal, &vmflowv1.RetrySignal{Reason: "GPU freed by hand"})
	}, 40*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, &vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1"})
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, before)
	assert.Equal(t, StageReleaseFailed, before.GetStage())
	next, err := time.Parse(time.RFC3339, before.GetNextRetryTime())
	require.NoError(t, err)
	assert.Greater(t, next.Sub(signalledAt), 4*time.Minute, "a long backoff was pending")
	assert.Less(t, e.Now().Sub(signalledAt), time.Minute, "the retry signal cut it short")
	assert.Equal(t, StageDeleted, e.status().GetStage())
}

// TestContinueAsNewKeepsCountsAndRetry: when the SDK suggests it, the
// release loop continues as new with its counts; a retry already delivered
// is folded in, not lost (the new run tries at once).
func TestContinueAsNewKeepsCountsAndRetry(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{}, nil)
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil)
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(nil, releaseErr)
	e.RegisterDelayedCallback(func() {
		e.SetContinueAsNewSuggested(true)
		e.SignalWorkflow(RetrySignal, &vmflowv1.RetrySignal{Reason: "just before continue-as-new"})
	}, 2*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	var can *workflow.ContinueAsNewError
	require.ErrorAs(t, e.GetWorkflowError(), &can)
	assert.Equal(t, DeleteWorkflow, can.WorkflowType.Name)
	var next vmflowv1.DeleteRequest
	require.NoError(t, converterFor(t).FromPayloads(can.Input, &next))
	assert.Equal(t, "vm1", next.GetInstanceId())
	assert.GreaterOrEqual(t, next.GetCarriedAttempts(), uint32(2), "attempts carried")
	assert.NotEmpty(t, next.GetCarriedFirstFailureTime())

	// The continued run starts counting where the last one stopped.
	e2 := newEnv(t)
	e2.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil)
	e2.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{StepReached: "none"}, nil)
	e2.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil)
	e2.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(nil, releaseErr)
	var st *vmflowv1.WorkflowStatus
	e2.RegisterDelayedCallback(func() { st = e2.status(); e2.CancelWorkflow() }, time.Second)
	e2.ExecuteWorkflow(DeleteWorkflow, &next)
	require.NotNil(t, st)
	assert.Equal(t, next.GetCarriedAttempts()+1, st.GetAttempt())
}

func TestHostUnreachableThenBack(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil).Once()
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.TearDown, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.DeleteRecord, mock.Anything, mock.Anything).Return(nil).Once()
	// The first StopVMs are never picked up (agent down); the next one is.
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, scheduleToStart()).Twice()
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{}, nil).Once()
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{}, nil)
	var during *vmflowv1.WorkflowStatus
	e.RegisterDelayedCallback(func() { during = e.status() }, 10*time.Second)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError(), "a delete never fails because its host is away")
	require.NotNil(t, during)
	assert.Equal(t, StageHostUnreachable, during.GetStage())
	assert.True(t, during.GetNeedsAttention())
	assert.Contains(t, during.GetLastError(), "h1")
	assert.Equal(t, StageDeleted, e.status().GetStage())
	assert.False(t, e.status().GetNeedsAttention())
}

func scheduleToStart() error {
	return temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)
}

func TestAbandonOnlyWhileHostUnreachable(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, scheduleToStart())
	e.counted("ReleaseLeases")
	// An abandon without a reason is refused; one with a reason ends it.
	e.RegisterDelayedCallback(func() {
		e.SignalWorkflow(AbandonSignal, &vmflowv1.AbandonSignal{})
	}, 5*time.Second)
	e.RegisterDelayedCallback(func() {
		e.SignalWorkflow(AbandonSignal, &vmflowv1.AbandonSignal{Reason: "host h1 decommissioned"})
	}, 10*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.True(t, res.GetAbandoned())
	assert.Equal(t, "host h1 decommissioned", res.GetAbandonReason())
	assert.Equal(t, StageAbandoned, e.lastSeen["VmStage"])
	e.AssertActivityNumberOfCalls(t, "ReleaseLeases", 0)
}

func TestAbandonRefusedWhileHostAnswers(t *testing.T) {
	e := newEnv(t)
	e.happyDelete()
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(nil, releaseErr).Times(int(retryFew.MaximumAttempts))
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{}, nil)
	e.RegisterDelayedCallback(func() {
		e.SignalWorkflow(AbandonSignal, &vmflowv1.AbandonSignal{Reason: "too early"})
	}, 10*time.Second)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.False(t, res.GetAbandoned(), "abandon is accepted only while the host is unreachable")
	assert.Equal(t, StageDeleted, e.status().GetStage())
}

func TestSpawnGivesUpOnUnreachableHost(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(scheduleToStart())
	e.counted("CreateRecord")
	start := e.Now()
	e.ExecuteWorkflow(SpawnWorkflow, spawnReq())
	var ae *temporal.ApplicationError
	require.ErrorAs(t, e.GetWorkflowError(), &ae)
	assert.Equal(t, ErrTypeHostUnreachable, ae.Type())
	assert.Contains(t, ae.Error(), "nothing was created")
	elapsed := e.Now().Sub(start)
	assert.GreaterOrEqual(t, elapsed, Config{}.WithDefaults().SpawnHostWait)
	assert.Less(t, elapsed, Config{}.WithDefaults().SpawnHostWait+5*time.Minute)
	e.AssertActivityNumberOfCalls(t, "CreateRecord", 0)
}

func TestReconcileSignalsDeletes(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.ReconcileHost, mock.Anything, &vmflowv1.ReconcileVGPURequest{HostId: "h1"}).Return(
		&vmflowv1.ReconcileVGPUResult{ClaimsReleased: 2, RetriedDeletes: []string{"vm1", "vm2"}}, nil).Once()
	var signalled []string
	e.OnSignalExternalWorkflow(mock.Anything, mock.Anything, "", RetrySignal, mock.Anything).Return(
		func(_ string, id, _, _ string, _ interface{}) error {
			signalled = append(signalled, id)
			if id == DeleteWorkflowID("vm2") {
				return errors.New("workflow not found") // finished already: not an error
			}
			return nil
		})
	e.ExecuteWorkflow(ReconcileWorkflow, &vmflowv1.ReconcileVGPURequest{HostId: "h1"})
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.ReconcileVGPUResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.EqualValues(t, 2, res.GetClaimsReleased())
	assert.Equal(t, []string{"delete/vm1", "delete/vm2"}, signalled)
}

func TestBackoff(t *testing.T) {
	for _, tc := range []struct {
		attempt uint32
		want    time.Duration
	}{{0, 30 * time.Second}, {1, 30 * time.Second}, {2, time.Minute}, {5, 8 * time.Minute}, {6, 15 * time.Minute}, {60, 15 * time.Minute}} {
		assert.Equal(t, tc.want, backoff(30*time.Second, 15*time.Minute, tc.attempt), "attempt %d", tc.attempt)
	}
}

// TestReconcileRoundOutlastsTenMinutes: a round's own retries allow more
// than the 10 minutes older agents gave the Schedule's runs: here two
// ReconcileHost attempts time out (5 min each) and the third releases a
// claim, past 10 minutes, and the round still wakes the delete. The agent's
// Schedule therefore sets no execution timeout (hostagent's
// TestReconcileScheduleIsThisBuilds).
func TestReconcileRoundOutlastsTenMinutes(t *testing.T) {
	e := newEnv(t)
	start := time.Date(2026, 12, 1, 20, 0, 0, 0, time.UTC)
	e.SetStartTime(start)
	// The test environment does not time mocks out: they say so themselves.
	limit := New(Config{}).calls()[ActivityReconcileHost].timeout
	e.OnActivity(h.ReconcileHost, mock.Anything, mock.Anything).After(limit).Return(nil,
		temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_START_TO_CLOSE, nil)).Times(2)
	e.OnActivity(h.ReconcileHost, mock.Anything, mock.Anything).Return(&vmflowv1.ReconcileVGPUResult{ClaimsReleased: 1, RetriedDeletes: []string{"vm1"}}, nil).Once()
	var signalledAt time.Time
	e.OnSignalExternalWorkflow(mock.Anything, DeleteWorkflowID("vm1"), "", RetrySignal, mock.Anything).Return(
		func(string, string, string, string, interface{}) error { signalledAt = e.Now(); return nil }).Once()
	e.ExecuteWorkflow(ReconcileWorkflow, &vmflowv1.ReconcileVGPURequest{HostId: "h1"})
	require.NoError(t, e.GetWorkflowError())
	require.False(t, signalledAt.IsZero(), "the delete was woken")
	assert.Greater(t, signalledAt.Sub(start), 10*time.Minute)
}
