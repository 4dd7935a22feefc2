package supervise

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"vmflow/hostagent/vmm"
)

// recorder is an in-memory tracer provider: what a traced StopVM activity
// puts in the ladder's context.
func recorder(t *testing.T) (*tracetest.SpanRecorder, trace.Tracer) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(ctxT(t, 5*time.Second)) })
	return rec, tp.Tracer("test")
}

func attr(s sdktrace.ReadOnlySpan, key string) (attribute.Value, bool) {
	for _, a := range s.Attributes() {
		if string(a.Key) == key {
			return a.Value, true
		}
	}
	return attribute.Value{}, false
}

// A traced stop has the ladder's steps and waits as spans under the
// caller's span, in order, with the times the ladder measured: -machine
// none ignores the power button, so the graceful wait runs out and quit
// ends it.
func TestStopLadderSpans(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "never", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))

	rec, tr := recorder(t)
	ctx, parent := tr.Start(ctxT(t, 30*time.Second), "RunActivity:StopVM")
	const graceful = 300 * time.Millisecond
	res, err := sup.Stop(ctx, "vm1", graceful)
	parent.End()
	require.NoError(t, err)
	require.Equal(t, vmm.StepGone, res.Reached)

	var names []string
	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.Name() == "RunActivity:StopVM" {
			continue
		}
		names = append(names, s.Name())
		byName[s.Name()] = s
		assert.Equal(t, parent.SpanContext().SpanID(), s.Parent().SpanID(), "%s is a child of the activity's span", s.Name())
		assert.Equal(t, parent.SpanContext().TraceID(), s.SpanContext().TraceID(), "%s is in the activity's trace", s.Name())
		assert.False(t, s.EndTime().Before(s.StartTime()), "%s ends after it starts", s.Name())
	}
	require.Equal(t, []string{"powerdown", "graceful-wait", "quit", "quit-wait"}, names)

	via, _ := attr(byName["powerdown"], "via")
	assert.Equal(t, "qmp", via.AsString())
	wait := byName["graceful-wait"]
	assert.Equal(t, byName["powerdown"].EndTime(), wait.StartTime(), "the wait starts when the button was pressed")
	assert.GreaterOrEqual(t, wait.EndTime().Sub(wait.StartTime()), graceful, "the graceful wait ran out")
	exited, _ := attr(wait, "exited")
	assert.False(t, exited.AsBool(), "-machine none ignores the power button")
	assert.False(t, byName["quit"].StartTime().Before(wait.EndTime()), "quit follows the graceful wait")
	exited, ok := attr(byName["quit-wait"], "exited")
	assert.True(t, ok && exited.AsBool(), "quit ended it")
	assert.False(t, byName["quit-wait"].EndTime().After(time.Now()))
}

// Without a recording span (tracing off) the ladder starts no span: the
// noop provider of a bare context records nothing, and a provider that
// does is never reached.
func TestStopLadderUntracedStartsNoSpan(t *testing.T) {
	rec, tr := recorder(t)
	_, ended := tr.Start(ctxT(t, time.Second), "ended")
	ended.End()
	require.Len(t, rec.Ended(), 1)

	res := vmm.StopResult{Steps: []vmm.StepResult{{Step: vmm.StepQuitSent, Via: "qmp", Started: time.Now(), Duration: time.Millisecond}}}
	traceLadder(ctxT(t, time.Second), res)
	// An ended span in the context does not record either.
	traceLadder(trace.ContextWithSpan(ctxT(t, time.Second), ended), res)
	assert.Len(t, rec.Ended(), 1, "no span started for the ladder")
}
