package workflows

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Tests of the retry and abandon updates: they answer synchronously, so an
// abandon without a reason, or while the host answers, is refused to its
// sender rather than dropped with a log line (as a signal would be).

// updateOutcome is what an update's caller sees.
type updateOutcome struct {
	accepted bool
	rejected error // the validator's refusal
	status   *vmflowv1.WorkflowStatus
	err      error // the handler's error after it was accepted
	done     bool
	at       time.Time // the workflow clock when the answer came
}

// update sends an update now and records its outcome.
func (e *env) update(name string, arg any) *updateOutcome {
	o := &updateOutcome{}
	e.UpdateWorkflow(name, "", &testsuite.TestUpdateCallback{
		OnAccept: func() { o.accepted = true },
		OnReject: func(err error) { o.rejected = err; o.done = true; o.at = e.Now() },
		OnComplete: func(v any, err error) {
			o.done, o.err, o.at = true, err, e.Now()
			if st, ok := v.(*vmflowv1.WorkflowStatus); ok {
				o.status = st
			}
		},
	}, arg)
	return o
}

// refusal asserts o was rejected by the validator with msg.
func refusal(t *testing.T, o *updateOutcome, msg string) {
	t.Helper()
	require.NotNil(t, o, "update never sent")
	require.True(t, o.done, "update got no answer")
	assert.False(t, o.accepted, "a refused update is not accepted (and not recorded)")
	require.Error(t, o.rejected)
	assert.Contains(t, o.rejected.Error(), msg)
	var ae *temporal.ApplicationError
	if assert.ErrorAs(t, o.rejected, &ae) {
		assert.Equal(t, ErrTypeRefused, ae.Type())
	}
}

// TestUpdatesRefusedWithReason: while a step runs (nothing waits, the host
// answers) abandon is refused with the reason an operator needs, and the
// delete goes on untouched; retry is accepted (the step retries already).
func TestUpdatesRefusedWithReason(t *testing.T) {
	e := newEnv(t)
	e.happyDelete()
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).After(time.Minute).Return(&vmflowv1.ReleaseVGPUResult{Released: true}, nil)
	var retry, abandon, noReason *updateOutcome
	e.RegisterDelayedCallback(func() {
		retry = e.update(RetryUpdate, &vmflowv1.RetrySignal{Reason: "impatient"})
		abandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: "h1 is dead"})
		noReason = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{})
	}, 10*time.Second)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, retry)
	assert.True(t, retry.accepted, "a retry while a step runs is accepted: %v", retry.rejected)
	refusal(t, abandon, "abandon refused: host h1 is reachable (stage releasing-leases)")
	refusal(t, noReason, "abandon refused: a reason is required")
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.False(t, res.GetAbandoned())
	assert.Equal(t, StageDeleted, e.status().GetStage())
}

// TestRetryUpdateDuringARound: a retry sent while a release round runs
// (the operator cleared the fault, as the README says, and the round the
// backoff started is under way) is accepted and answered at once with the
// round in progress, "already retrying: attempt N since T", without
// holding the caller for the round, which may last minutes. Before, it was
// refused as an error: "retry refused: nothing is waiting (stage
// releasing-leases)", while the delete was in fact retrying.
func TestRetryUpdateDuringARound(t *testing.T) {
	e := newEnv(t)
	e.happyDelete()
	// The first round fails (three attempts within 3 s); the second, after
	// the 30 s backoff, takes five minutes and succeeds.
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(nil, releaseErr).Times(int(retryFew.MaximumAttempts))
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).After(5*time.Minute).Return(&vmflowv1.ReleaseVGPUResult{Released: true}, nil).Once()
	start := time.Date(2026, 12, 1, 20, 0, 0, 0, time.UTC)
	e.SetStartTime(start)
	// Attempts at 0, 1 s and 3 s, then the 30 s backoff.
	roundStart := start.Add(33 * time.Second)
	var retry *updateOutcome
	var before *vmflowv1.WorkflowStatus
	var sentAt time.Time
	e.RegisterDelayedCallback(func() {
		before = e.status()
		sentAt = e.Now()
		retry = e.update(RetryUpdate, &vmflowv1.RetrySignal{Reason: "fault cleared"})
	}, 2*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, before)
	require.Equal(t, StageReleasingLeases, before.GetStage(), "sent while the second round runs")
	require.EqualValues(t, 2, before.GetAttempt())
	require.NotNil(t, retry)
	require.True(t, retry.accepted, "accepted, not refused: %v", retry.rejected)
	require.True(t, retry.done)
	require.NoError(t, retry.err)
	assert.Equal(t, sentAt, retry.at, "answered at once, not after the round")
	require.NotNil(t, retry.status)
	assert.Equal(t, StageReleasingLeases, retry.status.GetStage())
	assert.Equal(t, "already retrying: attempt 2 since "+roundStart.UTC().Format(time.RFC3339), retry.status.GetNote())
	assert.Equal(t, StageDeleted, e.status().GetStage())
	assert.Empty(t, e.status().GetNote(), "the status query carries no answer")
	e.AssertActivityNumberOfCalls(t, "ReleaseLeases", int(retryFew.MaximumAttempts)+1) // the retry started no round of its own
}

// TestRetryRefusedOnlyWhenItCannotAct: a workflow that has reached its
// last stage (it is ending, an update handler may still run) refuses a
// retry, saying so; every other stage accepts one.
func TestRetryRefusedOnlyWhenItCannotAct(t *testing.T) {
	for _, stage := range []string{StageDeleted, StageAbandoned, StageNotOwned, StageAlreadyAbsent, StageRunning, StageSpawnFailed, StageReconciled} {
		tr := &tracker{kind: "delete", status: &vmflowv1.WorkflowStatus{Stage: stage}}
		var ae *temporal.ApplicationError
		if assert.ErrorAs(t, tr.retryRefusal(), &ae, stage) {
			assert.Equal(t, ErrTypeRefused, ae.Type())
			assert.Equal(t, "retry refused: the delete has ended (stage "+stage+")", ae.Message())
		}
	}
	for _, stage := range []string{StageMarkingStopped, StageStopping, StageWaitingExit, StageReleasingLeases, StageReleaseFailed,
		StageTearingDown, StageHostUnreachable, StageValidating, StageLaunching, StageReconciling} {
		tr := &tracker{kind: "delete", status: &vmflowv1.WorkflowStatus{Stage: stage}}
		assert.NoError(t, tr.retryRefusal(), stage)
	}
}

// TestRetryUpdateStartsRoundAndAnswersWithStatus: a delete waiting out a
// release backoff starts the next round on the retry update, and the
// update answers with the status of that round (releasing-leases, the next
// attempt), not with the status before it acted. Abandon is refused in
// release-failed: the host answers, it just cannot release yet.
func TestRetryUpdateStartsRoundAndAnswersWithStatus(t *testing.T) {
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
	var before *vmflowv1.WorkflowStatus
	var abandon, retry *updateOutcome
	var sentAt time.Time
	// Rounds at 0, 30s, 1m30, 3m30, 7m30: at 10 min the wait runs to 15m30.
	e.RegisterDelayedCallback(func() {
		before = e.status()
		abandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: "h1 is dead"})
		failing = false
		sentAt = e.Now()
		retry = e.update(RetryUpdate, &vmflowv1.RetrySignal{Reason: "GPU freed by hand"})
	}, 10*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, before)
	assert.Equal(t, StageReleaseFailed, before.GetStage())
	refusal(t, abandon, "abandon refused: host h1 is reachable (stage release-failed)")

	require.True(t, retry.done)
	require.True(t, retry.accepted)
	require.NoError(t, retry.err)
	require.NotNil(t, retry.status)
	assert.Equal(t, StageReleasingLeases, retry.status.GetStage(), "answers after the round started")
	assert.Equal(t, before.GetAttempt()+1, retry.status.GetAttempt())
	assert.Empty(t, retry.status.GetNextRetryTime(), "no timer pending while the round runs")
	assert.Less(t, e.Now().Sub(sentAt), time.Minute, "the round ran at once, not after the backoff")
	assert.Equal(t, StageDeleted, e.status().GetStage())
}

// TestAbandonUpdateWhileHostUnreachable: abandon with a reason, while the
// host does not pick up work, ends the delete and answers with the
// abandoned status; the delete's result carries the reason.
func TestAbandonUpdateWhileHostUnreachable(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, scheduleToStart())
	e.counted("ReleaseLeases")
	var abandon *updateOutcome
	e.RegisterDelayedCallback(func() {
		abandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: "host h1 decommissioned"})
	}, 10*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, abandon)
	require.True(t, abandon.done, "the handler finished before the workflow closed")
	require.True(t, abandon.accepted)
	require.NoError(t, abandon.err)
	require.NotNil(t, abandon.status)
	assert.Equal(t, StageAbandoned, abandon.status.GetStage())
	assert.Contains(t, abandon.status.GetLastError(), "host h1 decommissioned")
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.True(t, res.GetAbandoned())
	assert.Equal(t, "host h1 decommissioned", res.GetAbandonReason())
	e.AssertActivityNumberOfCalls(t, "ReleaseLeases", 0)
}

// TestAbandonUpdateWhileParked: a delete parked on a failure retrying
// cannot fix accepts abandon (its host may be gone for good); retry on it
// answers with the stage running again.
func TestAbandonUpdateWhileParked(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(nil, appErr(ErrTypeIdentityMismatch, true))
	e.counted("ReleaseLeases")
	var retry, abandon *updateOutcome
	e.RegisterDelayedCallback(func() {
		retry = e.update(RetryUpdate, &vmflowv1.RetrySignal{Reason: "record fixed"})
	}, time.Hour)
	e.RegisterDelayedCallback(func() {
		abandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: "host h1 scrapped"})
	}, 2*time.Hour)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, retry)
	require.NoError(t, retry.err)
	require.NotNil(t, retry.status)
	assert.Equal(t, StageStopping, retry.status.GetStage())
	assert.EqualValues(t, 2, retry.status.GetAttempt(), "the second round runs")
	require.NotNil(t, abandon)
	require.NoError(t, abandon.err)
	assert.Equal(t, StageAbandoned, abandon.status.GetStage())
	e.AssertActivityNumberOfCalls(t, "ReleaseLeases", 0)
}

// TestAbandonUpdateRefusedOnSpawn: abandon is a delete's; a spawn says so.
// Retry on a spawn waiting for its host answers with the next attempt.
func TestUpdatesOnSpawn(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(scheduleToStart()).Once()
	e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).After(time.Minute).Return(nil)
	e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(&vmflowv1.CreateRecordResult{CreatedByThisSpawn: true}, nil)
	e.OnActivity(h.LaunchVM, mock.Anything, mock.Anything).Return(&vmflowv1.LaunchVMResult{Pid: 7}, nil)
	var abandon, retry *updateOutcome
	e.RegisterDelayedCallback(func() {
		abandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: "x"})
		retry = e.update(RetryUpdate, &vmflowv1.RetrySignal{})
	}, 5*time.Second)
	e.ExecuteWorkflow(SpawnWorkflow, spawnReq())
	require.NoError(t, e.GetWorkflowError())
	refusal(t, abandon, "abandon refused: only a delete can be abandoned (this is a spawn)")
	require.NotNil(t, retry)
	require.NoError(t, retry.err)
	require.NotNil(t, retry.status)
	assert.Equal(t, StageValidating, retry.status.GetStage(), "the validation was scheduled again")
}

// TestRetryUpdateAsTheWaitEnds: an update accepted in the same instant
// the backoff timer ends the wait is answered (the round it asked for
// runs) and is not left behind to cut the next wait short.
func TestRetryUpdateAsTheWaitEnds(t *testing.T) {
	e := newEnv(t)
	e.happyDelete()
	rounds := 0
	e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(
		func(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
			rounds++
			if rounds <= 2*int(retryFew.MaximumAttempts) {
				return nil, releaseErr
			}
			return &vmflowv1.ReleaseVGPUResult{Released: true}, nil
		})
	var retry *updateOutcome
	roundsLater := -1
	// The first round's attempts fail at 0, 1s and 3s; its 30s wait ends
	// at 33s, when the update comes.
	e.RegisterDelayedCallback(func() {
		retry = e.update(RetryUpdate, &vmflowv1.RetrySignal{Reason: "update"})
	}, 33*time.Second)
	// The second round fails at ~36s and waits a minute: a leftover retry
	// would end that wait at once and run a third round.
	e.RegisterDelayedCallback(func() { roundsLater = rounds }, 60*time.Second)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, retry)
	require.True(t, retry.done, "the update was answered")
	assert.NoError(t, retry.err)
	assert.Equal(t, 2*int(retryFew.MaximumAttempts), roundsLater, "no retry was left over for the next wait")
	assert.Equal(t, StageDeleted, e.status().GetStage())
}

// TestAbandonUpdateDuringATryOfAnUnreachableHost: once the host has missed
// a pickup, abandon is accepted also while the next try waits to be picked
// up (most of the time, with a one-minute pickup timeout): it is queued and
// taken by the next wait. Before, it was refused as "host is reachable"
// unless it landed in the short backoff between tries (the three-host e2e
// test saw 33 refusals in a row).
func TestAbandonUpdateDuringATryOfAnUnreachableHost(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{HasClaim: true}, nil)
	// Each try waits out its pickup timeout before it fails.
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).After(time.Minute).Return(nil, scheduleToStart())
	var abandon *updateOutcome
	var stageThen string
	// First try ends at 1 min, the backoff (30 s) ends at 1.5 min, the
	// second try runs until 2.5 min: send in the middle of it.
	e.RegisterDelayedCallback(func() {
		stageThen = e.status().GetStage()
		abandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: "host h1 is gone"})
	}, 2*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, abandon)
	assert.NotEqual(t, StageHostUnreachable, stageThen, "sent while a try was in flight, not in the backoff")
	require.True(t, abandon.accepted, "accepted: the host is known unreachable")
	require.NoError(t, abandon.err)
	assert.Equal(t, StageAbandoned, abandon.status.GetStage())
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.True(t, res.GetAbandoned())
}

// TestQueuedAbandonRefusedWhenHostAnswers: an abandon queued while the host
// was unreachable is refused, not carried out, when the host picks up the
// next try: the host is not gone.
func TestQueuedAbandonRefusedWhenHostAnswers(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{}, nil)
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).After(time.Minute).Return(nil, scheduleToStart()).Once()
	e.OnActivity(h.StopVM, mock.Anything, mock.Anything).After(time.Minute).Return(&vmflowv1.StopVMResult{StepReached: "quit"}, nil).Once()
	e.happyDelete()
	var abandon *updateOutcome
	e.RegisterDelayedCallback(func() {
		abandon = e.update(AbandonUpdate, &vmflowv1.AbandonSignal{Reason: "host h1 is gone"})
	}, 2*time.Minute)
	e.ExecuteWorkflow(DeleteWorkflow, deleteReq())
	require.NoError(t, e.GetWorkflowError())
	require.NotNil(t, abandon)
	require.True(t, abandon.accepted)
	require.Error(t, abandon.err)
	assert.Contains(t, abandon.err.Error(), "answered again")
	var res vmflowv1.DeleteResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.False(t, res.GetAbandoned(), "the delete went on")
}
