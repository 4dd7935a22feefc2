package supervise

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"vmflow/hostagent/vmm"
)

// tracerName is the instrumentation scope of the stop ladder's spans.
const tracerName = "vmflow/hostagent/supervise"

// traceLadder records the ladder's steps as spans under ctx's span (the
// StopVM activity's, when its agent traces): each step ("powerdown",
// "quit", "kill") from its start until it was sent, then the wait after it
// ("graceful-wait", "quit-wait", "kill-wait") until the group was gone or
// the wait ran out. They are recorded once the ladder is over, with the
// times it measured, by the provider of ctx's span: nothing at all when no
// span records (tracing off).
func traceLadder(ctx context.Context, res vmm.StopResult) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return
	}
	tr := parent.TracerProvider().Tracer(tracerName)
	for _, st := range res.Steps {
		stepName, waitName, ok := stepSpans(st.Step)
		if !ok || st.Started.IsZero() {
			continue
		}
		sent := st.Started.Add(st.Duration - st.Wait)
		_, span := tr.Start(ctx, stepName, trace.WithTimestamp(st.Started),
			trace.WithAttributes(attribute.String("via", st.Via)))
		if st.Err != nil {
			// The ladder went on (the step was skipped): recorded, not
			// a failed span.
			span.RecordError(st.Err)
		}
		span.End(trace.WithTimestamp(sent))
		if st.Wait <= 0 {
			continue
		}
		_, wait := tr.Start(ctx, waitName, trace.WithTimestamp(sent),
			trace.WithAttributes(attribute.Bool("exited", st.Exited)))
		if !st.Exited && st.Step == vmm.StepKillSent {
			wait.SetStatus(codes.Error, "the thread group outlived SIGKILL's wait")
		}
		wait.End(trace.WithTimestamp(st.Started.Add(st.Duration)))
	}
}
