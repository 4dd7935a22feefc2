package workflows

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

func cleanupReq() *vmflowv1.DeleteRequest {
	req := deleteReq()
	req.OnlyIfCreatedByWorkflowId, req.OnlyIfCreatedByRunId = "spawn/vm1", "run-1"
	return req
}

// continuedCleanup runs a failed spawn's clean-up whose first BeginDelete
// finds the record the spawn created, until its release loop continues as
// new, and returns the next run's input as the server would start it.
func continuedCleanup(t *testing.T) *vmflowv1.DeleteRequest {
	t.Helper()
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil).Once()
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{}, nil)
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil)
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(nil, releaseErr)
	e.RegisterDelayedCallback(func() { e.SetContinueAsNewSuggested(true) }, 2*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, cleanupReq())
	var can *workflow.ContinueAsNewError
	require.ErrorAs(t, e.GetWorkflowError(), &can)
	var next vmflowv1.DeleteRequest
	require.NoError(t, converterFor(t).FromPayloads(can.Input, &next))
	return &next
}

// TestCleanupDeleteOwnershipDecidedOnce: a failed spawn's clean-up owns
// the record once its first BeginDelete found the spawn's own record, and
// carries that across continue-as-new. When the continued run's
// BeginDelete answers not-owned (an agent of the previous build does so
// for a record it cannot read at that moment), the delete does not end
// "not-owned" with the record and its claim left in Deleting and no
// workflow to finish them: it parks, needing attention, and goes on once
// an operator sends retry. Before, it completed not-owned with
// needs_attention=false.
func TestCleanupDeleteOwnershipDecidedOnce(t *testing.T) {
	next := continuedCleanup(t)
	assert.True(t, next.GetCarriedOwned(), "ownership carried")
	assert.Equal(t, "spawn/vm1", next.GetOnlyIfCreatedByWorkflowId(), "the guard stays: a record replaced by hand is still not touched")

	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{NotOwned: true, CreatedBy: "unknown (the record cannot be read)"}, nil).Once()
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil).Once()
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{}, nil)
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil)
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{Released: true}, nil)
	e.counted("TearDown", "DeleteRecord")
	var parked *vmflowv1.WorkflowStatus
	var retry *updateOutcome
	e.RegisterDelayedCallback(func() {
		parked = e.status()
		retry = e.update(RetryUpdate, &vmflowv1.RetrySignal{Reason: "record repaired"})
	}, time.Hour)
	e.ExecuteWorkflow(DeleteWorkflow, next)
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, parked, "still running an hour later")
	assert.Equal(t, StageMarkingStopped, parked.GetStage())
	assert.True(t, parked.GetNeedsAttention())
	assert.Contains(t, parked.GetLastError(), "unknown (the record cannot be read)")
	assert.Contains(t, parked.GetLastError(), "spawn/vm1")
	require.NotNil(t, retry)
	require.NoError(t, retry.err)
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.False(t, res.GetNotOwned(), "a delete that owned the record never ends not-owned")
	assert.Equal(t, StageDeleted, e.status().GetStage())
	assert.False(t, e.status().GetNeedsAttention())
	e.AssertActivityNumberOfCalls(t, "DeleteRecord", 1)
}

// TestCleanupDeleteNotOwnedAtFirst: a clean-up whose first BeginDelete
// finds another spawn's record ends not-owned at once, as before; nothing
// is carried (there is no next run).
func TestCleanupDeleteNotOwnedAtFirst(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{NotOwned: true, CreatedBy: "spawn/vm1 (run run-0)"}, nil).Once()
	e.counted("StopVM", "DeleteRecord")
	e.ExecuteWorkflow(DeleteWorkflow, cleanupReq())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.True(t, res.GetNotOwned())
	assert.Equal(t, StageNotOwned, e.status().GetStage())
	assert.False(t, e.status().GetNeedsAttention())
	e.AssertActivityNumberOfCalls(t, "StopVM", 0)
}
