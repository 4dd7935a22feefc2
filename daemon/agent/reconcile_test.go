package agent

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/client"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/metrics"
	"vmflow/hostagent/store"
	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
	"vmflow/workflows"
)

// TestReconcileScheduleIsThisBuilds: the agent makes the host's reconcile
// Schedule the one this build wants, whatever an older build left: a
// schedule every minute (about 13,000 billed actions a day), with a
// 10-minute execution timeout (shorter than a round's own retries: a slow
// round was cut before it woke the deletes it released), other arguments
// and another task queue gets this build's interval, action, arguments
// and no timeout, and keeps an operator's pause and note. One that already
// matches is not updated. Before, only the interval was compared and set.
func TestReconcileScheduleIsThisBuilds(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := Config{HostID: "h1", TaskQueue: "vmflow", ReconcileEvery: DefaultReconcileEvery}
	id := workflows.ReconcileScheduleID("h1")
	_, err := c.ScheduleClient().Create(ctx, client.ScheduleOptions{
		ID:   id,
		Spec: client.ScheduleSpec{Intervals: []client.ScheduleIntervalSpec{{Every: time.Minute}}},
		Action: &client.ScheduleWorkflowAction{
			ID: id, Workflow: workflows.ReconcileWorkflow, TaskQueue: "vmflow-old",
			Args:                     []any{&vmflowv1.ReconcileVGPURequest{HostId: "h0"}},
			WorkflowExecutionTimeout: 10 * time.Minute,
		},
		Paused: true, Note: "paused by hand: OPS-1",
	})
	require.NoError(t, err)

	core, logs := observer.New(zap.InfoLevel)
	require.NoError(t, ensureReconcileSchedule(ctx, c, cfg, zap.New(core)))
	d, err := c.ScheduleClient().GetHandle(ctx, id).Describe(ctx)
	require.NoError(t, err)
	assertThisBuilds(t, d, cfg)
	assert.True(t, d.Schedule.State.Paused, "an operator's pause is kept")
	assert.Equal(t, "paused by hand: OPS-1", d.Schedule.State.Note)
	require.Equal(t, 1, logs.FilterMessageSnippet("reconcile schedule updated").Len())

	require.NoError(t, ensureReconcileSchedule(ctx, c, cfg, zap.New(core)))
	assert.Equal(t, 1, logs.FilterMessageSnippet("reconcile schedule updated").Len(), "one that matches is left as it is")

	// A host without one gets this build's at once.
	cfg2 := cfg
	cfg2.HostID = "h2"
	require.NoError(t, ensureReconcileSchedule(ctx, c, cfg2, zap.New(core)))
	d, err = c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID("h2")).Describe(ctx)
	require.NoError(t, err)
	assertThisBuilds(t, d, cfg2)
	require.NoError(t, ensureReconcileSchedule(ctx, c, cfg2, zap.New(core)))
	assert.Equal(t, 1, logs.FilterMessageSnippet("reconcile schedule updated").Len(), "a created one matches as the server describes it")
}

func assertThisBuilds(t *testing.T, d *client.ScheduleDescription, cfg Config) {
	t.Helper()
	var every []time.Duration
	for _, iv := range d.Schedule.Spec.Intervals {
		every = append(every, iv.Every)
	}
	assert.Equal(t, []time.Duration{cfg.ReconcileEvery}, every)
	assert.Equal(t, enumspb.SCHEDULE_OVERLAP_POLICY_SKIP, d.Schedule.Policy.Overlap)
	a, ok := d.Schedule.Action.(*client.ScheduleWorkflowAction)
	require.True(t, ok)
	assert.Equal(t, workflows.ReconcileScheduleID(cfg.HostID), a.ID)
	assert.Equal(t, workflows.ReconcileWorkflow, a.Workflow)
	assert.Equal(t, cfg.TaskQueue, a.TaskQueue)
	assert.Zero(t, a.WorkflowExecutionTimeout, "no timeout cuts a round its own retries allow")
	assert.Zero(t, a.WorkflowRunTimeout)
	require.Len(t, a.Args, 1)
	var req vmflowv1.ReconcileVGPURequest
	require.NoError(t, platform.DataConverter().FromPayload(a.Args[0].(*commonpb.Payload), &req))
	assert.Equal(t, cfg.HostID, req.GetHostId())
}

// TestScanTriggersOnlyLastingWork: the agent triggers a reconcile only for
// work two scans in a row found; work seen by one scan (a delete in
// progress passing through its release) costs nothing.
func TestScanTriggersOnlyLastingWork(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	work := lease.Work{Items: []string{"release:vm1"}}
	script := []lease.Work{{}, work, {}, work, work}
	var mu sync.Mutex
	scans, triggeredAt := 0, []int{}
	scan := func(context.Context) (lease.Work, error) {
		mu.Lock()
		defer mu.Unlock()
		scans++
		if scans <= len(script) {
			return script[scans-1], nil
		}
		return work, nil
	}
	trigger := func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		triggeredAt = append(triggeredAt, scans)
		cancel() // one trigger is what this test looks at
		return nil
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		scanForReconcile(ctx, scan, time.Millisecond, time.Hour, trigger, nil, zap.NewNop())
	}()
	<-done
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, []int{5}, triggeredAt, "the first work seen by two scans in a row is the 4th and 5th scan's")
}

// TestScanCountsEachOrphanOnce: vmflow_reconcile_orphans_found_total
// counts an orphan at the first scan that finds it, by kind, however many
// scans still see it until the reconcile releases it, and again if it
// comes back after it was gone.
func TestScanCountsEachOrphanOnce(t *testing.T) {
	reg := prometheus.NewRegistry()
	am, err := metrics.New(reg, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	vf := lease.Work{Items: []string{"orphan:0000:3b:00.4"}}
	both := lease.Work{Items: []string{"orphan-group:42", "orphan:0000:3b:00.4"}}
	script := []lease.Work{vf, vf, both, both, {}, vf}
	scans := 0
	scan := func(context.Context) (lease.Work, error) {
		if scans == len(script) {
			cancel()
			return lease.Work{}, nil
		}
		scans++
		return script[scans-1], nil
	}
	scanForReconcile(ctx, scan, time.Millisecond, time.Hour, func(context.Context) error { return nil }, am, zap.NewNop())
	assert.Equal(t, 2.0, testutil.ToFloat64(am.OrphansFound.WithLabelValues(store.KindVGPU)), "found, gone, found again")
	assert.Equal(t, 1.0, testutil.ToFloat64(am.OrphansFound.WithLabelValues(store.KindPassthrough)))
	assert.Zero(t, testutil.ToFloat64(am.OrphansFound.WithLabelValues(store.KindNetwork)))
}

// TestReconcileScanCoversWholeGPUs: a host with whole GPUs and no vGPUs
// still scans for reconcile work; a host with neither has nothing to scan.
func TestReconcileScanCoversWholeGPUs(t *testing.T) {
	assert.Nil(t, (&agentHost{}).reconcileScan())
	assert.NotNil(t, (&agentHost{whole: &lease.Whole{}}).reconcileScan())
	assert.NotNil(t, (&agentHost{vgpus: &lease.Claims{}}).reconcileScan())
}
