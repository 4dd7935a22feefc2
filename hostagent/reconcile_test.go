package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
	"go.uber.org/zap"

	"vmflow/hostagent/cli"
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
