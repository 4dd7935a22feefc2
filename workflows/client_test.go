package workflows

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/temporal"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
)

// scriptedHost answers the host activities like a healthy host, except that
// ReleaseVGPU fails while failRelease is set. It stands in for the agent at
// the host-queue boundary: this test is about the client and the workflows
// on a real server, not the host.
type scriptedHost struct {
	stubHost
	failRelease atomic.Bool
	launches    atomic.Int32
}

func (h *scriptedHost) CreateRecord(context.Context, *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	return &vmflowv1.CreateRecordResult{InstanceUuid: "u", CreatedByThisSpawn: true}, nil
}

func (h *scriptedHost) LaunchVM(ctx context.Context, _ *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	h.launches.Add(1)
	select { // long enough for a second start to find the first running
	case <-time.After(500 * time.Millisecond):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return &vmflowv1.LaunchVMResult{Pid: 42}, nil
}

func (h *scriptedHost) BeginDelete(context.Context, *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	return &vmflowv1.BeginDeleteResult{HasClaim: true}, nil
}

func (h *scriptedHost) StopVM(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	return &vmflowv1.StopVMResult{StepReached: "quit"}, nil
}

func (h *scriptedHost) ReleaseLeases(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	if h.failRelease.Load() {
		return nil, temporal.NewApplicationError("write remove: device or resource busy", ErrTypeReleaseFailed)
	}
	return &vmflowv1.ReleaseVGPUResult{Released: true}, nil
}

func TestClientAgainstDevServer(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	const queue = "vmflow-client-test"
	host := &scriptedHost{}
	// Backoff of an hour: only the retry can finish the delete in this
	// test's time.
	vc := startStack(t, c, queue, Config{ReleaseBackoff: time.Hour, ReleaseBackoffMax: time.Hour}, "h1", host)

	_, err := vc.StartSpawn(ctx, &vmflowv1.SpawnRequest{InstanceId: "../x", HostId: "h1"})
	require.ErrorIs(t, err, ErrInvalidID)

	req := &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 1, MemoryMib: 64, Machine: "none"}
	run1, err := vc.StartSpawn(ctx, req)
	require.NoError(t, err)
	run2, err := vc.StartSpawn(ctx, req)
	require.NoError(t, err)
	assert.Equal(t, run1.GetRunID(), run2.GetRunID(), "a second start joins the running spawn")
	var res vmflowv1.SpawnResult
	require.NoError(t, run1.Get(ctx, &res))
	assert.EqualValues(t, 42, res.GetPid())
	assert.EqualValues(t, 1, host.launches.Load())

	host.failRelease.Store(true)
	del, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1"})
	require.NoError(t, err)
	var st *vmflowv1.WorkflowStatus
	require.Eventually(t, func() bool {
		st, err = vc.Status(ctx, DeleteWorkflowID("vm1"))
		return err == nil && st.GetStage() == StageReleaseFailed
	}, time.Minute, 100*time.Millisecond, "delete never reached release-failed")
	assert.True(t, st.GetNeedsAttention())
	assert.True(t, st.GetMetadataRetained())
	assert.Contains(t, st.GetLastError(), "device or resource busy")

	_, err = vc.Abandon(ctx, "vm1", "")
	require.Error(t, err, "abandon needs a reason")
	_, err = vc.Abandon(ctx, "vm1", "test: host is fine")
	var refusal *temporal.ApplicationError
	require.ErrorAs(t, err, &refusal, "abandon while the host answers is refused, synchronously")
	assert.Equal(t, ErrTypeRefused, refusal.Type())
	assert.Contains(t, refusal.Error(), "host h1 is reachable")
	host.failRelease.Store(false)
	after, err := vc.Retry(ctx, DeleteWorkflowID("vm1"), "test: fault cleared")
	require.NoError(t, err)
	assert.NotEqual(t, StageReleaseFailed, after.GetStage(), "the update answers once the workflow acted")
	done, cancelDone := context.WithTimeout(ctx, 30*time.Second)
	defer cancelDone()
	var dres vmflowv1.DeleteResult
	require.NoError(t, del.Get(done, &dres), "the retry signal finishes the delete without waiting out the hour")
	st, err = vc.Status(ctx, DeleteWorkflowID("vm1"))
	require.NoError(t, err)
	assert.Equal(t, StageDeleted, st.GetStage())
	assert.False(t, st.GetNeedsAttention())

	_, err = vc.Retry(ctx, DeleteWorkflowID("vm1"), "")
	assert.Error(t, err, "a finished delete has nothing to retry")
	_, err = vc.Retry(ctx, DeleteWorkflowID("nope"), "")
	assert.Error(t, err, "no such workflow")
}
