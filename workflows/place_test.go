package workflows

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/mock"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

func placedReq() *vmflowv1.SpawnRequest {
	r := spawnReq()
	r.HostId = ""
	return r
}

func candidates(hosts ...string) *vmflowv1.ChooseHostsResult {
	res := &vmflowv1.ChooseHostsResult{Ask: "1 vCPUs and 128 MiB", HostsSeen: uint32(len(hosts)), HostsFit: uint32(len(hosts))}
	for _, h := range hosts {
		res.Candidates = append(res.Candidates, &vmflowv1.HostCandidate{HostId: h, Fits: true, Live: true})
	}
	return res
}

// hostOf is the host whose queue an activity attempt ran on.
func hostOf(ctx context.Context) string {
	return strings.TrimPrefix(activity.GetInfo(ctx).TaskQueue, HostTaskQueue(""))
}

// grants answers CreateRecord per host: an error, or the grant.
func (e *env) grants(answers map[string]error, asked *[]string) {
	e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(
		func(ctx context.Context, r *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
			host := hostOf(ctx)
			*asked = append(*asked, host)
			if err := answers[host]; err != nil {
				return nil, err
			}
			return &vmflowv1.CreateRecordResult{InstanceUuid: "u-" + host, CreatedByThisSpawn: true}, nil
		})
}

func (e *env) launchesOn(launched *string) {
	e.OnActivity(h.LaunchVM, mock.Anything, mock.Anything).Return(
		func(ctx context.Context, _ *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
			*launched = hostOf(ctx)
			return &vmflowv1.LaunchVMResult{Pid: 7}, nil
		})
}

// TestPlacedSpawnMovesOnAndRunsWhereGranted: a spawn without a host asks
// the candidates in order; a refusal, a draining host and a host that
// does not pick up send it on at once, and it runs where it was granted:
// the result and the status name the host, VmHostId is set by one upsert,
// the hosts asked and why are listed, and no ValidateSpawn runs.
func TestPlacedSpawnMovesOnAndRunsWhereGranted(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(LocalActivityChooseHosts, mock.Anything, mock.Anything).Return(candidates("h2", "h3", "h4", "h1"), nil).Once()
	var asked []string
	e.grants(map[string]error{
		"h2": appErr(ErrTypeNoHostCapacity, false),
		"h3": appErr(ErrTypeHostDraining, false),
		"h4": temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil),
	}, &asked)
	var launched string
	e.launchesOn(&launched)
	e.counted("ValidateSpawn")
	e.ExecuteWorkflow(SpawnWorkflow, placedReq())
	require.True(t, e.IsWorkflowCompleted())
	require.NoError(t, e.GetWorkflowError())
	var res vmflowv1.SpawnResult
	require.NoError(t, e.GetWorkflowResult(&res))
	assert.Equal(t, "h1", res.GetHostId())
	assert.Equal(t, "h1", launched, "the rest of the spawn runs on the granting host")
	assert.Equal(t, []string{"h2", "h3", "h4", "h1"}, asked)
	e.AssertActivityNumberOfCalls(t, "ValidateSpawn", 0)
	st := e.status()
	assert.Equal(t, "h1", st.GetHostId())
	require.Len(t, st.GetHostsTried(), 3)
	assert.Contains(t, st.GetHostsTried()[0], "h2: NoHostCapacity")
	assert.Contains(t, st.GetHostsTried()[1], "h3: HostDraining")
	assert.Contains(t, st.GetHostsTried()[2], "h4: did not pick up within 5s")
	hostUpserts := 0
	for _, u := range e.upserts {
		if v, ok := u["VmHostId"]; ok {
			hostUpserts++
			assert.Equal(t, "h1", v)
			assert.Equal(t, StagePlacing, u["VmStage"], "set with the stage it was placed in")
		}
	}
	assert.Equal(t, 1, hostUpserts, "VmHostId is set once, when placed")
	assert.Equal(t, StageRunning, e.lastSeen["VmStage"])
}

// TestPlacedSpawnReadsTheViewAgainThenFailsNoFleetCapacity: when every
// candidate refuses, the view is read again without the hosts asked, up
// to three reads; then NoFleetCapacity (not retryable) names the ask, the
// fleet's best and every host asked, and nothing is cleaned up (nothing
// was written).
func TestPlacedSpawnReadsTheViewAgainThenFailsNoFleetCapacity(t *testing.T) {
	e := newEnv(t)
	var excludes [][]string
	e.OnActivity(LocalActivityChooseHosts, mock.Anything, mock.Anything).Return(
		func(_ context.Context, r *vmflowv1.ChooseHostsRequest) (*vmflowv1.ChooseHostsResult, error) {
			excludes = append(excludes, r.GetExclude())
			switch len(excludes) {
			case 1:
				return candidates("h1", "h2"), nil
			case 2:
				return candidates("h3"), nil
			}
			res := candidates()
			res.HostsSeen, res.FleetBest = 3, "h2 has 1 vCPUs and 100 MiB free"
			return res, nil
		})
	var asked []string
	e.grants(map[string]error{"h1": appErr(ErrTypeNoHostCapacity, false), "h2": appErr(ErrTypeNoCapacity, false), "h3": appErr(ErrTypeNoHostCapacity, false)}, &asked)
	e.ExecuteWorkflow(SpawnWorkflow, placedReq())
	require.True(t, e.IsWorkflowCompleted())
	var ae *temporal.ApplicationError
	require.ErrorAs(t, e.GetWorkflowError(), &ae)
	assert.Equal(t, ErrTypeNoFleetCapacity, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, ae.Message(), "1 vCPUs and 128 MiB: no host has them; h2 has 1 vCPUs and 100 MiB free")
	assert.Contains(t, ae.Message(), "h3: NoHostCapacity")
	assert.Equal(t, [][]string{nil, {"h1", "h2"}, {"h1", "h2", "h3"}}, excludes)
	assert.Equal(t, []string{"h1", "h2", "h3"}, asked)
	st := e.status()
	assert.Equal(t, StageSpawnFailed, st.GetStage())
	assert.False(t, st.GetMetadataRetained())
	assert.Empty(t, st.GetHostId())
}

// TestPlacedSpawnLostGrantIsCleanedUpThere: a host that took the grant
// and timed out may have written the record: a delete of only this
// spawn's record starts on that host (its own workflow id, apart from
// the instance's delete), and the spawn goes on to the next host.
func TestPlacedSpawnLostGrantIsCleanedUpThere(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(LocalActivityChooseHosts, mock.Anything, mock.Anything).Return(candidates("h2", "h1"), nil).Once()
	var asked []string
	e.grants(map[string]error{"h2": temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_START_TO_CLOSE, nil)}, &asked)
	var launched string
	e.launchesOn(&launched)
	var cleanup *vmflowv1.DeleteRequest
	var cleanupID string
	e.OnWorkflow(DeleteWorkflow, mock.Anything, mock.Anything).Return(
		func(ctx workflow.Context, r *vmflowv1.DeleteRequest) (*vmflowv1.DeleteResult, error) {
			cleanup, cleanupID = r, workflow.GetInfo(ctx).WorkflowExecution.ID
			return &vmflowv1.DeleteResult{AlreadyAbsent: true}, nil
		}).Once()
	e.ExecuteWorkflow(SpawnWorkflow, placedReq())
	require.NoError(t, e.GetWorkflowError())
	assert.Equal(t, "h1", launched)
	require.NotNil(t, cleanup)
	assert.Equal(t, "h2", cleanup.GetHostId())
	assert.NotEmpty(t, cleanup.GetOnlyIfCreatedByWorkflowId(), "only this spawn's record")
	assert.NotEmpty(t, cleanup.GetOnlyIfCreatedByRunId(), "only this run's record")
	assert.Equal(t, LostGrantDeleteWorkflowID("vm1", "h2"), cleanupID)
	assert.Contains(t, e.status().GetHostsTried()[0], "h2: took the grant and was not heard from")
}

// TestPlacedSpawnGoesWhereAnEarlierSpawnWas: when the view names a host an
// earlier spawn of the instance was placed on, the spawn runs there as if
// named (ValidateSpawn, CreateRecord finding the record), asking no other.
func TestPlacedSpawnGoesWhereAnEarlierSpawnWas(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(LocalActivityChooseHosts, mock.Anything, mock.Anything).Return(&vmflowv1.ChooseHostsResult{PreviousHost: "h7",
		Candidates: []*vmflowv1.HostCandidate{{HostId: "h7"}}}, nil).Once()
	var validated string
	e.OnActivity(h.ValidateSpawn, mock.Anything, mock.Anything).Return(func(ctx context.Context, _ *vmflowv1.SpawnRequest) error {
		validated = hostOf(ctx)
		return nil
	}).Once()
	var asked []string
	e.grants(nil, &asked)
	var launched string
	e.launchesOn(&launched)
	e.ExecuteWorkflow(SpawnWorkflow, placedReq())
	require.NoError(t, e.GetWorkflowError())
	assert.Equal(t, "h7", validated)
	assert.Equal(t, []string{"h7"}, asked)
	assert.Equal(t, "h7", launched)
}

// TestPlacedSpawnRefusedEverywhereAsInvalid: when every host asked says
// the request itself is invalid, that is the answer, not NoFleetCapacity.
func TestPlacedSpawnRefusedEverywhereAsInvalid(t *testing.T) {
	e := newEnv(t)
	e.OnActivity(LocalActivityChooseHosts, mock.Anything, mock.Anything).Return(candidates("h1"), nil).Once()
	e.OnActivity(LocalActivityChooseHosts, mock.Anything, mock.Anything).Return(candidates(), nil)
	var asked []string
	e.grants(map[string]error{"h1": appErr(ErrTypeInvalidInput, true)}, &asked)
	e.ExecuteWorkflow(SpawnWorkflow, placedReq())
	var ae *temporal.ApplicationError
	require.ErrorAs(t, e.GetWorkflowError(), &ae)
	assert.Equal(t, ErrTypeInvalidInput, ae.Type())
}

// TestDeleteWithoutHostFindsIt: a delete without a host asks where the
// instance's latest spawn was placed, works on that host and sets
// VmHostId; with no spawn naming a host it is already absent, touching
// no host.
func TestDeleteWithoutHostFindsIt(t *testing.T) {
	t.Run("found", func(t *testing.T) {
		e := newEnv(t)
		e.OnActivity(LocalActivityFindInstanceHost, mock.Anything, mock.Anything).Return(&vmflowv1.FindInstanceHostResult{HostId: "h5"}, nil).Once()
		var hosts []string
		e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(func(ctx context.Context, _ *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
			hosts = append(hosts, hostOf(ctx))
			return &vmflowv1.BeginDeleteResult{}, nil
		}).Once()
		e.OnActivity(h.StopVM, mock.Anything, mock.Anything).Return(&vmflowv1.StopVMResult{}, nil).Once()
		e.OnActivity(h.WaitVMExit, mock.Anything, mock.Anything).Return(nil).Once()
		e.OnActivity(h.ReleaseLeases, mock.Anything, mock.Anything).Return(&vmflowv1.ReleaseVGPUResult{}, nil).Once()
		e.OnActivity(h.TearDown, mock.Anything, mock.Anything).Return(nil).Once()
		e.OnActivity(h.DeleteRecord, mock.Anything, mock.Anything).Return(nil).Once()
		e.ExecuteWorkflow(DeleteWorkflow, &vmflowv1.DeleteRequest{InstanceId: "vm1"})
		require.NoError(t, e.GetWorkflowError())
		assert.Equal(t, []string{"h5"}, hosts)
		assert.Equal(t, "h5", e.lastSeen["VmHostId"])
		assert.Equal(t, StageDeleted, e.status().GetStage())
		assert.Equal(t, "h5", e.status().GetHostId())
	})
	t.Run("none", func(t *testing.T) {
		e := newEnv(t)
		e.OnActivity(LocalActivityFindInstanceHost, mock.Anything, mock.Anything).Return(&vmflowv1.FindInstanceHostResult{}, nil).Once()
		e.counted("StopVM")
		e.ExecuteWorkflow(DeleteWorkflow, &vmflowv1.DeleteRequest{InstanceId: "vm1"})
		require.NoError(t, e.GetWorkflowError())
		var res vmflowv1.DeleteResult
		require.NoError(t, e.GetWorkflowResult(&res))
		assert.True(t, res.GetAlreadyAbsent())
		e.AssertActivityNumberOfCalls(t, "StopVM", 0)
	})
	t.Run("never absent while the spawn still places", func(t *testing.T) {
		e := newEnv(t)
		e.OnActivity(LocalActivityFindInstanceHost, mock.Anything, mock.Anything).Return(&vmflowv1.FindInstanceHostResult{Placing: true}, nil)
		e.counted("StopVM")
		e.ExecuteWorkflow(DeleteWorkflow, &vmflowv1.DeleteRequest{InstanceId: "vm1"})
		var ae *temporal.ApplicationError
		require.ErrorAs(t, e.GetWorkflowError(), &ae)
		assert.Equal(t, ErrTypeBusy, ae.Type())
		assert.Contains(t, ae.Message(), "placing")
		e.AssertActivityNumberOfCalls(t, "StopVM", 0)
	})
	t.Run("waits while the spawn places", func(t *testing.T) {
		e := newEnv(t)
		e.OnActivity(LocalActivityFindInstanceHost, mock.Anything, mock.Anything).Return(&vmflowv1.FindInstanceHostResult{Placing: true}, nil).Times(2)
		e.OnActivity(LocalActivityFindInstanceHost, mock.Anything, mock.Anything).Return(&vmflowv1.FindInstanceHostResult{HostId: "h2"}, nil).Once()
		e.OnActivity(h.BeginDelete, mock.Anything, mock.Anything).Return(&vmflowv1.BeginDeleteResult{AlreadyAbsent: true}, nil).Once()
		e.ExecuteWorkflow(DeleteWorkflow, &vmflowv1.DeleteRequest{InstanceId: "vm1"})
		require.NoError(t, e.GetWorkflowError())
		assert.Equal(t, "h2", e.status().GetHostId())
		e.AssertExpectations(t)
	})
}
