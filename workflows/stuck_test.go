package workflows

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	sdkpb "go.temporal.io/api/sdk/v1"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Tests of delete stages stuck outside the release loop (they show
// needs-attention; non-retryable failures park instead of failing the
// delete), of the creator guard and of reconcile's unreadable records.

// currentDetails is what the Web UI shows as Current Details.
func (e *env) currentDetails() string {
	e.t.Helper()
	v, err := e.QueryWorkflow("__temporal_workflow_metadata")
	require.NoError(e.t, err)
	var md sdkpb.WorkflowMetadata
	require.NoError(e.t, v.Get(&md))
	return md.GetCurrentDetails()
}

// stuckErr is what StopVM returns while QEMU sits in D state after SIGKILL
// (a VFIO reset that does not finish): retryable, forever. Its attempts
// come a minute apart, as real ones that wait out the exit cap do (and the
// test environment's 10-attempt cap on unlimited policies is not reached
// within a bound).
var stuckErr = temporal.NewApplicationErrorWithOptions("instance vm1: thread group 4242 still present 30s after SIGKILL (task state D)",
	"StopIncomplete", temporal.ApplicationErrorOptions{NextRetryDelay: time.Minute})

// TestDeleteStuckStopShowsAttentionThenClears: a StopVM that keeps failing
// retryably past the bound shows stopping + needs-attention + last error +
// attempt in status, search attributes and Current Details, and clears
// when it succeeds. Before the bound existed the delete showed stopping
// with needs_attention=false for as long as it hung.
func TestDeleteStuckStopShowsAttentionThenClears(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil).Once()
	failing := true
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
			if failing {
				return nil, stuckErr
			}
			return &vmflowv1.StopVMResult{StepReached: "kill"}, nil
		})
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{Released: true}, nil).Once()
	e.OnActivity(h.TearDown, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.DeleteRecord, mock.Anything, mock.Anything).Return(nil).Once()

	var early, stuck *vmflowv1.WorkflowStatus
	var stuckSA map[string]any
	var details string
	e.RegisterDelayedCallback(func() { early = e.status() }, time.Minute)
	e.RegisterDelayedCallback(func() {
		stuck = e.status()
		details = e.currentDetails()
		stuckSA = map[string]any{"VmStage": e.lastSeen["VmStage"], "VmNeedsAttention": e.lastSeen["VmNeedsAttention"]}
		failing = false // the D state ended
	}, 6*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())

	require.NotNil(t, early)
	assert.False(t, early.GetNeedsAttention(), "within the bound a slow stop is not flagged")
	require.NotNil(t, stuck, "the delete ended before the bound")
	assert.Equal(t, StageStopping, stuck.GetStage())
	assert.True(t, stuck.GetNeedsAttention())
	assert.Contains(t, stuck.GetLastError(), "task state D")
	assert.Contains(t, stuck.GetLastError(), "StopIncomplete")
	assert.GreaterOrEqual(t, stuck.GetAttempt(), uint32(2))
	assert.Equal(t, map[string]any{"VmStage": StageStopping, "VmNeedsAttention": true}, stuckSA)
	assert.Contains(t, details, "**needs attention**")
	assert.Contains(t, details, "task state D")

	st := e.status()
	assert.Equal(t, StageDeleted, st.GetStage())
	assert.False(t, st.GetNeedsAttention())
	assert.Empty(t, st.GetLastError())
	assert.Equal(t, false, e.lastSeen["VmNeedsAttention"])
	e.AssertExpectations(t)
}

// TestDeleteStuckCostsNoUpsertPerPeriod: while a stage stays stuck, a new
// period changes only the status and Current Details, not the search
// attributes: one upsert when it gets stuck, none per period after.
func TestDeleteStuckCostsNoUpsertPerPeriod(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, stuckErr)
	var at30, at60 int
	var st *vmflowv1.WorkflowStatus
	e.RegisterDelayedCallback(func() { at30 = len(e.upserts) }, 30*time.Minute)
	e.RegisterDelayedCallback(func() { at60 = len(e.upserts); st = e.status(); e.CancelWorkflow() }, time.Hour)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NotNil(t, st)
	assert.True(t, st.GetNeedsAttention())
	assert.Greater(t, st.GetAttempt(), uint32(6), "about one round per bound")
	assert.Equal(t, at30, at60, "no upsert while nothing an operator searches for changed")
}

// TestDeleteParksOnIdentityMismatch: a non-retryable IdentityMismatch from
// StopVM (an old or hand-edited record) parks the delete, running and
// flagged, with no retries; the retry signal after the repair finishes it.
// Before, the delete failed at once with the record and claim kept.
func TestDeleteParksOnIdentityMismatch(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil).Once()
	repaired := false
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
			if !repaired {
				return nil, temporal.NewNonRetryableApplicationError("pid 4242: start time 1234 != recorded 999", ErrTypeIdentityMismatch, nil)
			}
			return &vmflowv1.StopVMResult{StepReached: "powerdown"}, nil
		})
	e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{Released: true}, nil).Once()
	e.OnActivity(h.TearDown, mock.Anything, mock.Anything).Return(nil).Once()
	e.OnActivity(h.DeleteRecord, mock.Anything, mock.Anything).Return(nil).Once()

	var parked *vmflowv1.WorkflowStatus
	var running bool
	e.RegisterDelayedCallback(func() {
		parked = e.status()
		running = !e.IsWorkflowCompleted()
		e.AssertActivityNumberOfCalls(t, "StopVM", 1) // parked: no retries, no timer
		repaired = true
		e.SignalWorkflow(RetrySignal, &vmflowv1.RetrySignal{Reason: "record repaired"})
	}, 3*time.Hour)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NotNil(t, parked, "the delete ended before it could be repaired")
	assert.True(t, running)
	assert.Equal(t, StageStopping, parked.GetStage())
	assert.True(t, parked.GetNeedsAttention())
	assert.True(t, parked.GetMetadataRetained())
	assert.Contains(t, parked.GetLastError(), ErrTypeIdentityMismatch)
	assert.Contains(t, parked.GetLastError(), "signal retry")
	assert.Empty(t, parked.GetNextRetryTime(), "parked: waits for a signal, not a timer")

	require.NoError(t, e.GetWorkflowError())
	assert.Equal(t, StageDeleted, e.status().GetStage())
	assert.False(t, e.status().GetNeedsAttention())
	e.AssertActivityNumberOfCalls(t, "StopVM", 2)
	e.AssertExpectations(t)
}

// TestDeleteAbandonWhileParked: a parked delete whose host is gone for good
// ends Abandoned on abandon with a reason (one without is refused).
func TestDeleteAbandonWhileParked(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, appErr(ErrTypeIdentityMismatch, true))
	e.counted("ReleaseLeases", "DeleteRecord")
	e.RegisterDelayedCallback(func() { e.SignalWorkflow(AbandonSignal, &vmflowv1.AbandonSignal{}) }, time.Minute)
	e.RegisterDelayedCallback(func() {
		e.SignalWorkflow(AbandonSignal, &vmflowv1.AbandonSignal{Reason: "host h1 scrapped"})
	}, 2*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.True(t, res.GetAbandoned())
	assert.Equal(t, "host h1 scrapped", res.GetAbandonReason())
	st := e.status()
	assert.Equal(t, StageAbandoned, st.GetStage())
	assert.False(t, st.GetNeedsAttention())
	e.AssertActivityNumberOfCalls(t, "ReleaseLeases", 0)
	e.AssertActivityNumberOfCalls(t, "DeleteRecord", 0)
}

// TestDeleteParksOnUnreadableRecord: BeginDelete on a record the agent
// cannot read parks at marking-stopped with needs-attention, touching
// nothing further, until cancelled (or repaired and retried).
func TestDeleteParksOnUnreadableRecord(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(nil,
		temporal.NewNonRetryableApplicationError("record /var/lib/vmflow/instances/vm1/record.json: unexpected EOF", ErrTypeRecordUnreadable, nil))
	e.counted("StopVM")
	var st *vmflowv1.WorkflowStatus
	e.RegisterDelayedCallback(func() { st = e.status(); e.CancelWorkflow() }, 24*time.Hour)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NotNil(t, st, "the delete ended instead of parking")
	assert.Equal(t, StageMarkingStopped, st.GetStage())
	assert.True(t, st.GetNeedsAttention())
	assert.Contains(t, st.GetLastError(), ErrTypeRecordUnreadable)
	assert.Contains(t, st.GetLastError(), "unexpected EOF")
	assert.Equal(t, true, e.lastSeen["VmNeedsAttention"])
	assert.Equal(t, StageMarkingStopped, e.lastSeen["VmStage"])
	e.AssertActivityNumberOfCalls(t, "StopVM", 0)
	var ce *temporal.CanceledError
	assert.ErrorAs(t, e.GetWorkflowError(), &ce, "only a cancel ends it")
}

// TestDeleteStuckBoundSurvivesContinueAsNew: the bound is recorded when the
// delete starts (here the worker's 7m) and carried across continue-as-new
// with the creator guard; the continued run keeps it on a worker whose
// default is 5m.
func TestDeleteStuckBoundSurvivesContinueAsNew(t *testing.T) {
	e := newEnvWith(t, Config{DeleteStuckAfter: 7 * time.Minute})
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, stuckErr)
	e.RegisterDelayedCallback(func() { e.SetContinueAsNewSuggested(true) }, time.Minute)
	req := deleteReq()
	req.OnlyIfCreatedByWorkflowId, req.OnlyIfCreatedByRunId = "spawn/vm1", "run-1"
	e.ExecuteWorkflow(DeleteWorkflow, req)
	var can *workflow.ContinueAsNewError
	require.ErrorAs(t, e.GetWorkflowError(), &can)
	var next vmflowv1.DeleteRequest
	require.NoError(t, converterFor(t).FromPayloads(can.Input, &next))
	assert.EqualValues(t, 7*60, next.GetStuckAfterSeconds())
	assert.Equal(t, "spawn/vm1", next.GetOnlyIfCreatedByWorkflowId())
	assert.Equal(t, "run-1", next.GetOnlyIfCreatedByRunId())

	e2 := newEnv(t) // default 5m
	e2.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{}, nil)
	e2.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, stuckErr)
	var before, after *vmflowv1.WorkflowStatus
	// A 5m bound shows by 5m; the carried 7m one only past 6m (within one
	// retry interval of the bound).
	e2.RegisterDelayedCallback(func() { before = e2.status() }, 5*time.Minute+30*time.Second)
	e2.RegisterDelayedCallback(func() { after = e2.status(); e2.CancelWorkflow() }, 8*time.Minute)
	e2.ExecuteWorkflow(DeleteWorkflow, &next)
	require.NotNil(t, before)
	require.NotNil(t, after)
	assert.False(t, before.GetNeedsAttention(), "the continued run uses the carried bound, not its worker's")
	assert.True(t, after.GetNeedsAttention())
}

// TestDeleteNotOwned: a failed spawn's clean-up passes its creator guard to
// BeginDelete; a record another spawn created ends the delete at once as
// not-owned, with nothing stopped or removed.
func TestDeleteNotOwned(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, &vmflowv1.BeginDeleteRequest{
		InstanceId: "vm1", OnlyIfCreatedByWorkflowId: "spawn/vm1", OnlyIfCreatedByRunId: "run-2",
	}).Return(&vmflowv1.BeginDeleteResult{NotOwned: true, CreatedBy: "spawn/vm1 run-1"}, nil).Once()
	e.counted("StopVM", "ReleaseLeases", "TearDown", "DeleteRecord")
	req := deleteReq()
	req.OnlyIfCreatedByWorkflowId, req.OnlyIfCreatedByRunId = "spawn/vm1", "run-2"
	e.ExecuteWorkflow(DeleteWorkflow, req)
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.True(t, res.GetNotOwned())
	assert.Equal(t, "spawn/vm1 run-1", res.GetCreatedBy())
	st := e.status()
	assert.Equal(t, StageNotOwned, st.GetStage())
	assert.False(t, st.GetNeedsAttention())
	for _, n := range []string{"StopVM", "ReleaseLeases", "TearDown", "DeleteRecord"} {
		e.AssertActivityNumberOfCalls(t, n, 0)
	}
	e.AssertExpectations(t)
}

// TestReconcileUnreadableRecordsNeedsAttention: a round that found records
// it cannot read ends flagged, saying how many and that no orphan went.
func TestReconcileUnreadableRecordsNeedsAttention(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.ReconcileHost, mock.Anything, mock.Anything).Return(
		&vmflowv1.ReconcileVGPUResult{ClaimsReleased: 1, UnreadableRecords: 2}, nil).Once()
	e.ExecuteWorkflow(ReconcileWorkflow, &vmflowv1.ReconcileVGPURequest{HostId: "h1"})
	require.NoError(t, e.GetWorkflowError())
	st := e.status()
	assert.Equal(t, StageReconciled, st.GetStage())
	assert.True(t, st.GetNeedsAttention())
	assert.Contains(t, st.GetLastError(), "2 instance record(s)")
	assert.Contains(t, st.GetLastError(), "no orphan device was removed")
	assert.Equal(t, true, e.lastSeen["VmNeedsAttention"])

	clean := newEnv(t)
	clean.OnActivity(h.ReconcileHost, mock.Anything, mock.Anything).Return(&vmflowv1.ReconcileVGPUResult{OrphansRemoved: 1}, nil).Once()
	clean.ExecuteWorkflow(ReconcileWorkflow, &vmflowv1.ReconcileVGPURequest{HostId: "h1"})
	require.NoError(t, clean.GetWorkflowError())
	assert.False(t, clean.status().GetNeedsAttention())
}
