package workflows

import (
	"context"

	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestRespawnOfRunningInstanceSucceedsWithoutTouchingIt: a re-sent spawn
// that finds another spawn's instance running as asked succeeds with that
// VM's result, and claims, launches and deletes nothing (invariant 9).
func TestRespawnOfRunningInstanceSucceedsWithoutTouchingIt(t *testing.T) {
	e := newEnv(t)
	req := spawnReq()
	req.VgpuProfile = "GRID A100-4C"
	e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(&vmflowv1.CreateRecordResult{
		InstanceUuid: "u-1", AlreadyExisted: true, CreatedBy: "spawn/vm1 (run r0)"}, nil).Once()
	e.OnActivity(h.LaunchVM, mock.Anything, &vmflowv1.LaunchVMRequest{InstanceId: "vm1", ExistingOnly: true}).
		Return(&vmflowv1.LaunchVMResult{Pid: 42, QmpSocket: "/s", AlreadyRunning: true, VgpuUuid: "5a1", VgpuDeviceId: "5a1"}, nil).Once()
	deleted := false
	e.OnWorkflow(DeleteWorkflow, mock.Anything, mock.Anything).Return(
		func(workflow.Context, *vmflowv1.DeleteRequest) (*vmflowv1.DeleteResult, error) {
			deleted = true
			return &vmflowv1.DeleteResult{}, nil
		}).Maybe()

	e.ExecuteWorkflow(SpawnWorkflow, req)
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.SpawnResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.EqualValues(t, 42, res.GetPid())
	assert.Equal(t, "5a1", res.GetVgpuUuid())
	assert.Equal(t, "u-1", res.GetInstanceUuid())
	assert.False(t, deleted)
	assert.Equal(t, StageRunning, e.status().GetStage())
	e.AssertNotCalled(t, "ClaimDevices", mock.Anything, mock.Anything)
	e.AssertExpectations(t)
}

// TestRespawnOfStuckInstanceFailsWithoutDeleting (invariant 9): VM X runs
// but is paused/hung/its monitor held; the platform re-sends the spawn; the
// existing-only launch says so: the spawn fails with InstanceExists and
// never starts DeleteInstance for X (rather than retrying LaunchVM and then
// deleting X).
func TestRespawnOfStuckInstanceFailsWithoutDeleting(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(&vmflowv1.CreateRecordResult{AlreadyExisted: true}, nil).Once()
	launches := 0
	e.OnActivity(h.LaunchVM, mock.Anything, mock.Anything).Return(
		func(_ context.Context, in *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
			launches++
			if !in.GetExistingOnly() {
				t.Errorf("a spawn launched QEMU for an instance another spawn created")
			}
			return nil, appErr(ErrTypeInstanceExists, true)
		})
	deleted := false
	e.OnWorkflow(DeleteWorkflow, mock.Anything, mock.Anything).Return(
		func(workflow.Context, *vmflowv1.DeleteRequest) (*vmflowv1.DeleteResult, error) {
			deleted = true
			return &vmflowv1.DeleteResult{}, nil
		}).Maybe()

	e.ExecuteWorkflow(SpawnWorkflow, spawnReq())
	require.True(t, e.IsWorkflowCompleted())
	require.Error(t, e.GetWorkflowError())
	assert.Contains(t, e.GetWorkflowError().Error(), ErrTypeInstanceExists)
	assert.False(t, deleted, "a spawn must not delete an instance it did not create")
	assert.Equal(t, 1, launches, "a non-retryable answer is not retried")
	st := e.status()
	assert.Equal(t, StageSpawnFailed, st.GetStage())
	assert.False(t, st.GetMetadataRetained(), "the record is not this spawn's to report as retained")
}
