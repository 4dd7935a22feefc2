package workflows

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

var combined *CombinedActivities // method references for OnActivity

// fineSteps are the one-step activities a new run never schedules on its
// own (a failed spawn's clean-up still runs BeginDelete as one).
func (e *env) neverFineSteps(names ...string) {
	for _, n := range names {
		switch n {
		case ActivityValidateSpawn:
			e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(nil).Never()
		case ActivityCreateRecord:
			e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(nil, nil).Never()
		case ActivityClaimDevices:
			e.OnActivity(h.ClaimDevices, mock.Anything, mock.Anything).Return(nil, nil).Never()
		case ActivityBeginDelete:
			e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(nil, nil).Never()
		case ActivityStopVM:
			e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, nil).Never()
		case ActivityWaitVMExit:
			e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil).Never()
		case ActivityTearDown:
			e.OnActivity(h.TearDown, mock.Anything, mock.Anything).Return(nil).Never()
		case ActivityDeleteRecord:
			e.OnActivity(h.DeleteRecord, mock.Anything, mock.Anything).Return(nil).Never()
		default:
			e.t.Fatalf("neverFineSteps: add %s", n)
		}
	}
}

// A new spawn with a vGPU: one activity creates the record and claims
// (PrepareSpawn), one launches; no ValidateSpawn (CreateRecord admits), no
// claim of its own, and the claim's devices reach the result.
func TestCombinedSpawnTwoActivities(t *testing.T) {
	e := newCombinedEnv(t)
	req := spawnReq()
	req.VgpuProfile = "GRID A100-4C"
	e.neverFineSteps(ActivityValidateSpawn, ActivityCreateRecord, ActivityClaimDevices)
	e.OnActivity(combined.PrepareSpawn, mock.Anything, req).Return(&vmflowv1.CreateRecordResult{
		InstanceUuid: "u-1", CreatedByThisSpawn: true,
		Claim: &vmflowv1.ClaimVGPUResult{DeviceId: "0000:3b:00.4", DeviceIds: []string{"0000:3b:00.4"}},
	}, nil).Once()
	e.OnActivity(h.LaunchVM, mock.Anything, mock.Anything).Return(&vmflowv1.LaunchVMResult{Pid: 42}, nil).Once()
	e.ExecuteWorkflow(SpawnWorkflow, req)
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.SpawnResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.Equal(t, []string{"0000:3b:00.4"}, res.GetGpuDeviceIds())
	assert.Equal(t, "0000:3b:00.4", res.GetVgpuDeviceId())
	assert.Equal(t, "u-1", res.GetInstanceUuid())
	assert.Equal(t, StageRunning, e.status().GetStage())
	e.AssertExpectations(t)
}

// A PrepareSpawn failure that may follow this spawn's write (its claim's,
// or a retried attempt's) starts the guarded clean-up whatever its type;
// the same type without the mark creates nothing and starts none, as a
// CreateRecord failure of it always did.
func TestCombinedSpawnFailureAfterTheRecordCleansUp(t *testing.T) {
	for _, c := range []struct {
		name       string
		err        error
		wantDelete bool
	}{
		{"claim refused as invalid after the record", mayHaveCreated(appErr(ErrTypeInvalidInput, true)), true},
		{"record unreadable on a retried attempt", mayHaveCreated(appErr(ErrTypeRecordUnreadable, true)), true},
		{"record unreadable on the first attempt", appErr(ErrTypeRecordUnreadable, true), false},
		{"conflicting record", appErr(ErrTypeConflict, true), false},
		{"host error", appErr("Disk", false), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newCombinedEnv(t)
			e.OnActivity(combined.PrepareSpawn, mock.Anything, mock.Anything).Return(nil, c.err)
			cleanup := e.cleanupStarted()
			req := spawnReq()
			req.VgpuProfile = "GRID A100-4C"
			e.ExecuteWorkflow(SpawnWorkflow, req)
			childReq := cleanup()
			require.True(t, e.IsWorkflowCompleted())
			var ae *temporal.ApplicationError
			require.ErrorAs(t, e.GetWorkflowError(), &ae)
			var want *temporal.ApplicationError
			require.ErrorAs(t, c.err, &want)
			assert.Equal(t, want.Type(), ae.Type(), "the spawn fails with the original error type")
			if c.wantDelete {
				require.NotNil(t, childReq, "no clean-up of a record this spawn may have written")
				assert.NotEmpty(t, childReq.GetOnlyIfCreatedByWorkflowId(), "the clean-up is guarded (invariant 9)")
			} else {
				assert.Nil(t, childReq, "a clean-up of a record this spawn did not write")
			}
		})
	}
}

// A new delete: StopInstance, ReleaseLeases, RemoveInstance, and nothing
// else; a visibility query sees the first stage and the last only.
func TestCombinedDeleteThreeActivities(t *testing.T) {
	e := newCombinedEnv(t)
	e.neverFineSteps(ActivityBeginDelete, ActivityStopVM, ActivityWaitVMExit, ActivityTearDown, ActivityDeleteRecord)
	e.OnActivity(combined.StopInstance, mock.Anything, &vmflowv1.StopInstanceRequest{InstanceId: "vm1", GracefulTimeoutSeconds: 7}).
		Return(&vmflowv1.StopInstanceResult{Begin: &vmflowv1.BeginDeleteResult{HasClaim: true}, Stop: &vmflowv1.StopVMResult{StepReached: "quit"}}, nil).Once()
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{Released: true}, nil).Once()
	e.OnActivity(combined.RemoveInstance, mock.Anything, &vmflowv1.InstanceRef{InstanceId: "vm1"}).Return(nil).Once()
	req := deleteReq()
	req.GracefulTimeoutSeconds = 7
	e.ExecuteWorkflow(DeleteWorkflow, req)
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	st := e.status()
	assert.Equal(t, StageDeleted, st.GetStage())
	assert.False(t, st.GetMetadataRetained())
	stages := e.visibleStages()
	assert.Equal(t, []string{StageMarkingStopped, StageDeleted}, stages)
	e.AssertExpectations(t)
}

// The combined delete's answers from BeginDelete decide as before: absent
// ends "already absent" with nothing released.
func TestCombinedDeleteAlreadyAbsent(t *testing.T) {
	e := newCombinedEnv(t)
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(nil, nil).Never()
	e.OnActivity(combined.RemoveInstance, mock.Anything, mock.Anything).Return(nil).Never()
	var during *vmflowv1.WorkflowStatus
	e.OnActivity(combined.StopInstance, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.StopInstanceRequest) (*vmflowv1.StopInstanceResult, error) {
			during = e.status()
			return &vmflowv1.StopInstanceResult{Begin: &vmflowv1.BeginDeleteResult{AlreadyAbsent: true}}, nil
		}).Once()
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.True(t, e.IsWorkflowCompleted())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.True(t, res.GetAlreadyAbsent())
	// While StopInstance runs the delete may have begun on the host (an
	// abandon of a lost host says the record stays there); absent, not.
	require.NotNil(t, during)
	assert.True(t, during.GetMetadataRetained(), "metadata retained while the stop runs")
	assert.False(t, e.status().GetMetadataRetained(), "nothing retained when absent")
	e.AssertExpectations(t)
}

// A stop that keeps failing inside StopInstance shows needs-attention at
// stage stopping once the bound is out, and clears when it goes through.
func TestCombinedDeleteStuckStopShowsAttention(t *testing.T) {
	e := newCombinedEnv(t)
	failing := true
	e.OnActivity(combined.StopInstance, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.StopInstanceRequest) (*vmflowv1.StopInstanceResult, error) {
			if failing {
				return nil, stuckErr
			}
			return &vmflowv1.StopInstanceResult{Begin: &vmflowv1.BeginDeleteResult{}, Stop: &vmflowv1.StopVMResult{StepReached: "kill"}}, nil
		})
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{}, nil).Once()
	e.OnActivity(combined.RemoveInstance, mock.Anything, mock.Anything).Return(nil).Once()
	var stuck *vmflowv1.WorkflowStatus
	var stuckSA map[string]any
	e.RegisterDelayedCallback(func() {
		stuck = e.status()
		stuckSA = map[string]any{"VmStage": e.lastSeen["VmStage"], "VmNeedsAttention": e.lastSeen["VmNeedsAttention"]}
		failing = false
	}, 6*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, stuck, "the delete ended before the bound")
	assert.Equal(t, StageStopping, stuck.GetStage())
	assert.True(t, stuck.GetNeedsAttention())
	assert.Contains(t, stuck.GetLastError(), "task state D")
	assert.Equal(t, map[string]any{"VmStage": StageStopping, "VmNeedsAttention": true}, stuckSA)
	assert.False(t, e.status().GetNeedsAttention())
}

// A failed spawn's clean-up keeps BeginDelete a step of its own on the
// combined path: told "not owned" after it began as the owner, it parks
// (needs attention) instead of ending with the record left in Deleting.
func TestCombinedCleanupKeepsBeginDeleteItsOwnStep(t *testing.T) {
	e := newCombinedEnv(t)
	e.OnActivity(combined.StopInstance, mock.Anything, mock.Anything).Return(nil, nil).Never()
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{}, nil).Once()
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{StepReached: "quit"}, nil).Once()
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{}, nil).Once()
	e.OnActivity(combined.RemoveInstance, mock.Anything, mock.Anything).Return(nil).Once()
	req := deleteReq()
	req.OnlyIfCreatedByWorkflowId, req.OnlyIfCreatedByRunId = SpawnWorkflowID("vm1"), "run-1"
	e.ExecuteWorkflow(DeleteWorkflow, req)
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	e.AssertExpectations(t)
}

// The combined activities call the host's own, in order, and stop at the
// first failure: the marker before any stop action (invariant 6), no stop
// of a record absent or not this delete's, the claim only of a record this
// spawn created, a claim's failure marked as following the record's write.
func TestCombinedActivitiesCallTheHostsInOrder(t *testing.T) {
	ctx := context.Background()
	host := &orderHost{}
	c := &CombinedActivities{Host: host}

	res, err := c.StopInstance(ctx, &vmflowv1.StopInstanceRequest{InstanceId: "vm1", GracefulTimeoutSeconds: 3})
	require.NoError(t, err)
	assert.Equal(t, []string{"BeginDelete", "StopVM 3", "WaitVMExit"}, host.calls)
	assert.Equal(t, "quit", res.GetStop().GetStepReached())

	host.calls, host.begin = nil, &vmflowv1.BeginDeleteResult{AlreadyAbsent: true}
	_, err = c.StopInstance(ctx, &vmflowv1.StopInstanceRequest{InstanceId: "vm1"})
	require.NoError(t, err)
	assert.Equal(t, []string{"BeginDelete"}, host.calls, "nothing stopped for an absent record")

	host.calls, host.begin, host.stopErr = nil, &vmflowv1.BeginDeleteResult{}, errors.New("qmp: broken pipe")
	_, err = c.StopInstance(ctx, &vmflowv1.StopInstanceRequest{InstanceId: "vm1"})
	require.Error(t, err)
	assert.Equal(t, []string{"BeginDelete", "StopVM 0"}, host.calls, "no wait after a failed stop")

	host.calls, host.tearErr = nil, errors.New("socket busy")
	require.Error(t, c.RemoveInstance(ctx, &vmflowv1.InstanceRef{InstanceId: "vm1"}))
	assert.Equal(t, []string{"TearDown"}, host.calls, "no record delete after a failed tear-down")

	req := spawnReq()
	host.calls, host.created = nil, &vmflowv1.CreateRecordResult{CreatedByThisSpawn: true}
	got, err := c.PrepareSpawn(ctx, req)
	require.NoError(t, err)
	assert.Equal(t, []string{"CreateRecord"}, host.calls, "no claim for a spawn that asks for no GPU")
	assert.Nil(t, got.GetClaim())

	req.VgpuProfile = "p"
	host.calls, host.created = nil, &vmflowv1.CreateRecordResult{CreatedByThisSpawn: false}
	_, err = c.PrepareSpawn(ctx, req)
	require.NoError(t, err)
	assert.Equal(t, []string{"CreateRecord"}, host.calls, "no claim for another spawn's record")

	host.calls, host.created = nil, &vmflowv1.CreateRecordResult{CreatedByThisSpawn: true}
	got, err = c.PrepareSpawn(ctx, req)
	require.NoError(t, err)
	assert.Equal(t, []string{"CreateRecord", "ClaimDevices p"}, host.calls)
	assert.NotNil(t, got.GetClaim())

	host.calls, host.claimErr = nil, temporal.NewNonRetryableApplicationError("no such profile", ErrTypeInvalidInput, nil)
	_, err = c.PrepareSpawn(ctx, req)
	var ae *temporal.ApplicationError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, ErrTypeInvalidInput, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.True(t, MayHaveCreatedRecord(err), "a claim's failure follows the record's write")
	assert.False(t, MayHaveCreatedRecord(appErr(ErrTypeInvalidInput, true)))

	// A test host without a step's method: refused without retry, named.
	_, err = (&CombinedActivities{Host: struct{}{}}).StopInstance(ctx, &vmflowv1.StopInstanceRequest{InstanceId: "vm1"})
	require.ErrorAs(t, err, &ae)
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, ae.Message(), "BeginDelete")
}

// orderHost records the host activities called, in order.
type orderHost struct {
	calls            []string
	begin            *vmflowv1.BeginDeleteResult
	created          *vmflowv1.CreateRecordResult
	stopErr, tearErr error
	claimErr         error
}

func (o *orderHost) CreateRecord(context.Context, *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	o.calls = append(o.calls, "CreateRecord")
	return o.created, nil
}

func (o *orderHost) ClaimDevices(_ context.Context, r *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	o.calls = append(o.calls, "ClaimDevices "+r.GetVgpuProfile())
	if o.claimErr != nil {
		return nil, o.claimErr
	}
	return &vmflowv1.ClaimVGPUResult{DeviceId: "d"}, nil
}

func (o *orderHost) BeginDelete(context.Context, *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	o.calls = append(o.calls, "BeginDelete")
	if o.begin == nil {
		return &vmflowv1.BeginDeleteResult{}, nil
	}
	return o.begin, nil
}

func (o *orderHost) StopVM(_ context.Context, r *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	o.calls = append(o.calls, "StopVM "+itoa(r.GetGracefulTimeoutSeconds()))
	if o.stopErr != nil {
		return nil, o.stopErr
	}
	return &vmflowv1.StopVMResult{StepReached: "quit"}, nil
}

func (o *orderHost) WaitVMExit(context.Context, *vmflowv1.InstanceRef) error {
	o.calls = append(o.calls, "WaitVMExit")
	return nil
}

func (o *orderHost) TearDown(context.Context, *vmflowv1.InstanceRef) error {
	o.calls = append(o.calls, "TearDown")
	return o.tearErr
}

func (o *orderHost) DeleteRecord(context.Context, *vmflowv1.InstanceRef) error {
	o.calls = append(o.calls, "DeleteRecord")
	return nil
}

func itoa(n uint32) string { return strconv.FormatUint(uint64(n), 10) }
