package workflows

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/client"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
)

// continuingHost fails every release (so the delete loops until the server
// suggests continue-as-new) and holds every BeginDelete after the first
// open: the continued run then stays in its first workflow task.
type continuingHost struct {
	scriptedHost
	begun atomic.Int32
}

func (h *continuingHost) BeginDelete(ctx context.Context, req *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	if h.begun.Add(1) > 1 {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return h.scriptedHost.BeginDelete(ctx, req)
}

// TestContinuedDeleteShowsInstanceAndHost: the StaticSummary the client
// sets is not carried to a continued run (neither the SDK nor the server
// carries user metadata), so a continued delete names its instance and
// host in Current Details, set in the run's first workflow task.
func TestContinuedDeleteShowsInstanceAndHost(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{ExtraArgs: []string{
		// Suggest continue-as-new after a few release rounds.
		"--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=40",
	}})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const queue = "vmflow-continued"
	host := &continuingHost{}
	host.failRelease.Store(true)
	vc := startStack(t, c, queue, Config{ReleaseBackoff: 50 * time.Millisecond, ReleaseBackoffMax: 50 * time.Millisecond}, "h7", host)

	run, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: "vm7", HostId: "h7"})
	require.NoError(t, err)
	first := run.GetRunID()
	var latest string
	require.Eventually(t, func() bool {
		d, err := c.DescribeWorkflow(ctx, run.GetID(), "")
		if err != nil {
			return false
		}
		latest = d.RawResponse.GetWorkflowExecutionInfo().GetExecution().GetRunId()
		return latest != first
	}, time.Minute, 100*time.Millisecond, "the delete never continued as new")
	// Wait for the continued run's first workflow task to complete.
	require.Eventually(t, func() bool { return completedTasks(ctx, t, c, run.GetID(), latest) >= 1 }, 30*time.Second, 50*time.Millisecond)

	d, err := c.DescribeWorkflow(ctx, run.GetID(), latest)
	require.NoError(t, err)
	summary, err := d.GetStaticSummary()
	require.NoError(t, err)
	assert.Empty(t, summary, "the server does not carry StaticSummary (if it ever does, this test can go)")
	// What an operator reads (the UI's User Metadata tab shows the same).
	out, err := srv.CLI(ctx, "workflow", "metadata", "--workflow-id", run.GetID(), "--run-id", latest)
	require.NoError(t, err)
	assert.Contains(t, string(out), "`vm7`", "Current Details names the instance:\n%s", out)
	assert.Contains(t, string(out), "host `h7`", "and the host:\n%s", out)
	assert.Equal(t, 1, completedTasks(ctx, t, c, run.GetID(), latest), "set in the first workflow task")
	require.NoError(t, c.TerminateWorkflow(ctx, run.GetID(), "", "test done"))
}

// completedTasks counts the run's WorkflowTaskCompleted events.
func completedTasks(ctx context.Context, t *testing.T, c client.Client, id, runID string) int {
	t.Helper()
	it := c.GetWorkflowHistory(ctx, id, runID, false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	n := 0
	for it.HasNext() {
		ev, err := it.Next()
		require.NoError(t, err)
		if ev.GetEventType() == enumspb.EVENT_TYPE_WORKFLOW_TASK_COMPLETED {
			n++
		}
	}
	return n
}
