package workflows

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"vmflow/platform"
	"vmflow/testsupport/devserver"
	"vmflow/testsupport/otlptest"
)

// Header keys tracing writes: the SDK's tracing interceptor's (the same in
// every SDK) and vmflow's stage (platform).
const (
	tracerHeader = "_tracer-data"
	stageHeader  = "vmflow-stage"
)

// TestTracingAddsNoActions: the tracing interceptor adds headers to what
// the workflows already send, never an action. A spawn with a vGPU and its
// clean delete cost the same billed actions, counted from the histories and
// on the server's own counter, with tracing on as without; what tracing
// adds is a header on the start and on every activity scheduled.
func TestTracingAddsNoActions(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{Metrics: true})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := Config{ReleaseBackoff: time.Hour, ReleaseBackoffMax: time.Hour}

	plain := srv.Client(t)
	untraced := spawnDeleteCost(ctx, t, srv, plain, startStack(t, plain, "vmflow-untraced", cfg, "h1", &scriptedHost{}), "vm1", "h1")

	otlptest.ClearEnv(t)
	sink := otlptest.Start(t)
	t.Setenv(platform.EnvOTLPEndpoint, sink.URL())
	tr, err := platform.StartTracing(ctx, platform.TracingOptions{Service: "vmflow-test"})
	require.NoError(t, err)
	require.NotNil(t, tr)
	o := srv.TClientOptions()
	o.Tracing = tr
	c, err := platform.Dial(ctx, o)
	require.NoError(t, err)
	t.Cleanup(c.Close) // after the workers startStack stops
	traced := spawnDeleteCost(ctx, t, srv, c, startStack(t, c, "vmflow-traced", cfg, "h2", &scriptedHost{}), "vm2", "h2")
	require.NoError(t, tr.Shutdown(ctx))

	t.Logf("spawn (vGPU) + clean delete: untraced %v (server %v), traced %v (server %v)",
		untraced.history, untraced.server, traced.history, traced.server)
	assert.Equal(t, untraced.history, traced.history, "billed actions counted from the histories")
	assert.Equal(t, untraced.server, traced.server, "the server's action counter")

	var scheduled, headerBytes int
	for _, id := range []string{SpawnWorkflowID("vm2"), DeleteWorkflowID("vm2")} {
		events, err := devserver.History(ctx, c, id, "")
		require.NoError(t, err)
		for _, e := range events {
			if a := e.GetWorkflowExecutionStartedEventAttributes(); a != nil {
				f := a.GetHeader().GetFields()
				assert.Contains(t, f, tracerHeader, "%s: the start carries the platform API's span", id)
				headerBytes += proto.Size(a.GetHeader())
			}
			if a := e.GetActivityTaskScheduledEventAttributes(); a != nil {
				scheduled++
				f := a.GetHeader().GetFields()
				assert.Contains(t, f, tracerHeader, "%s: %s carries its call's span", id, a.GetActivityType().GetName())
				assert.Contains(t, f, stageHeader, "%s: %s carries its stage", id, a.GetActivityType().GetName())
				headerBytes += proto.Size(a.GetHeader())
			}
		}
	}
	t.Logf("tracing added %d bytes of headers to the pair's histories (a start each, %d activities scheduled)", headerBytes, scheduled)
	var names []string
	for _, s := range sink.Spans() {
		names = append(names, s.Name)
	}
	assert.Contains(t, names, "RunActivity:LaunchVM", "the spans reached the collector")
	assert.Contains(t, names, "RunActivity:"+ActivityStopInstance)
}
