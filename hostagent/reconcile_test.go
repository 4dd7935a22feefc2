package main

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
	"go.uber.org/zap"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/vgpu/claims"
	"vmflow/internal/devserver"
	"vmflow/workflows"
)

// TestReconcileScheduleUpdatedToConfiguredInterval: every host upgraded
// from a build whose reconcile Schedule ran every minute (about 13,000
// billed actions a day) finds that schedule at start; the agent updates it
// to --reconcile-every. Before, an existing schedule was left as it was.
func TestReconcileScheduleUpdatedToConfiguredInterval(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	c := srv.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := cli.RunConfig{HostID: "h1", TaskQueue: "vmflow", ReconcileEvery: time.Minute}
	every := func() []time.Duration {
		t.Helper()
		d, err := c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID("h1")).Describe(ctx)
		require.NoError(t, err)
		var out []time.Duration
		for _, iv := range d.Schedule.Spec.Intervals {
			out = append(out, iv.Every)
		}
		return out
	}
	// Today's build: a schedule every minute.
	require.NoError(t, ensureReconcileSchedule(ctx, c, cfg, zap.NewNop()))
	require.Equal(t, []time.Duration{time.Minute}, every())

	cfg.ReconcileEvery = cli.DefaultReconcileEvery
	require.NoError(t, ensureReconcileSchedule(ctx, c, cfg, zap.NewNop()))
	assert.Equal(t, []time.Duration{cli.DefaultReconcileEvery}, every(), "the 1-minute schedule runs daily now")
	d, err := c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID("h1")).Describe(ctx)
	require.NoError(t, err)
	assert.Equal(t, cfg.TaskQueue, d.Schedule.Action.(*client.ScheduleWorkflowAction).TaskQueue, "the action is kept")

	require.NoError(t, ensureReconcileSchedule(ctx, c, cfg, zap.NewNop()), "a schedule that already runs daily is left alone")
	assert.Equal(t, []time.Duration{cli.DefaultReconcileEvery}, every())
}

// TestScanTriggersOnlyLastingWork: the agent triggers a reconcile only for
// work two scans in a row found; work seen by one scan (a delete in
// progress passing through its release) costs nothing.
func TestScanTriggersOnlyLastingWork(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	work := claims.Work{Items: []string{"release:vm1"}}
	script := []claims.Work{{}, work, {}, work, work}
	var mu sync.Mutex
	scans, triggeredAt := 0, []int{}
	scan := func(context.Context) (claims.Work, error) {
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
		scanForReconcile(ctx, scan, time.Millisecond, time.Hour, trigger, zap.NewNop())
	}()
	<-done
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, []int{5}, triggeredAt, "the first work seen by two scans in a row is the 4th and 5th scan's")
}
