package platform

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"vmflow/internal/contract"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/otlptest"
)

// Without an OTLP endpoint tracing is off and costs nothing: no Tracing,
// so no exporter or provider, and a client gets no interceptor at all.
func TestTracingOffWithoutEndpoint(t *testing.T) {
	otlptest.ClearEnv(t)
	assert.False(t, TracingRequested())
	tr, err := StartTracing(context.Background(), TracingOptions{Service: "vmflow-test"})
	require.NoError(t, err)
	assert.Nil(t, tr)
	assert.NoError(t, tr.Shutdown(context.Background()), "a nil Tracing shuts down as nothing")
	assert.Empty(t, tr.Endpoint())

	copts, err := ClientOptions(Options{Env: fakeEnv{}, Tracing: tr})
	require.NoError(t, err)
	assert.Empty(t, copts.Interceptors, "no interceptor without tracing")

	// Turned off explicitly, an endpoint does not turn it on.
	t.Setenv(EnvOTLPEndpoint, "http://127.0.0.1:1")
	assert.True(t, TracingRequested())
	for _, off := range [][2]string{{"OTEL_SDK_DISABLED", "true"}, {"OTEL_TRACES_EXPORTER", "none"}} {
		t.Run(off[0], func(t *testing.T) {
			t.Setenv(off[0], off[1])
			assert.False(t, TracingRequested())
			tr, err := StartTracing(context.Background(), TracingOptions{Service: "vmflow-test"})
			require.NoError(t, err)
			assert.Nil(t, tr)
		})
	}
}

// A gRPC endpoint would silently lose every span: refused at start.
func TestTracingRefusesGRPC(t *testing.T) {
	otlptest.ClearEnv(t)
	t.Setenv(EnvOTLPEndpoint, "http://127.0.0.1:4317")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	_, err := StartTracing(context.Background(), TracingOptions{Service: "vmflow-test"})
	require.ErrorContains(t, err, "OTLP over HTTP only")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
	tr, err := StartTracing(context.Background(), TracingOptions{Service: "vmflow-test"})
	require.NoError(t, err, "the traces protocol wins over the general one")
	require.NoError(t, tr.Shutdown(context.Background()))
}

// With an endpoint, spans go out over OTLP/HTTP with the service name and
// resource attributes, and Shutdown sends what the batcher still holds.
func TestTracingExportsOverOTLPHTTP(t *testing.T) {
	otlptest.ClearEnv(t)
	sink := otlptest.Start(t)
	t.Setenv(EnvOTLPEndpoint, sink.URL())
	// The batcher would wait a minute: only Shutdown's flush can send it.
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tr, err := StartTracing(ctx, TracingOptions{Service: "vmflow-test", Attributes: []attribute.KeyValue{attribute.String(AttrHostID, "h1")}})
	require.NoError(t, err)
	require.NotNil(t, tr)
	assert.Equal(t, sink.URL(), tr.Endpoint())
	copts, err := ClientOptions(Options{Env: fakeEnv{}, Tracing: tr})
	require.NoError(t, err)
	assert.Len(t, copts.Interceptors, 3, "vmflow's two around the SDK's tracing interceptor")

	_, span := tr.TracerProvider().Tracer("test").Start(ctx, "a span")
	span.End()
	assert.Empty(t, sink.Spans(), "nothing sent before the flush")
	require.NoError(t, tr.Shutdown(ctx))

	got := sink.Spans()
	require.Len(t, got, 1)
	assert.Equal(t, "a span", got[0].Name)
	assert.Equal(t, "vmflow-test", got[0].Resource["service.name"])
	assert.Equal(t, "h1", got[0].Resource[AttrHostID])
}

// OTEL_SERVICE_NAME overrides the name the code gives.
func TestTracingServiceNameFromEnv(t *testing.T) {
	otlptest.ClearEnv(t)
	rec := tracetest.NewSpanRecorder()
	t.Setenv("OTEL_SERVICE_NAME", "renamed")
	tr, err := newTracing(context.Background(), TracingOptions{Service: "vmflow-test"}, sdktrace.WithSpanProcessor(rec))
	require.NoError(t, err)
	_, span := tr.TracerProvider().Tracer("test").Start(context.Background(), "s")
	span.End()
	require.Len(t, rec.Ended(), 1)
	name, ok := rec.Ended()[0].Resource().Set().Value("service.name")
	assert.True(t, ok && name.AsString() == "renamed", "service.name %v", name)
}

func attrsOf(s sdktrace.ReadOnlySpan) map[string]string {
	m := map[string]string{}
	for _, a := range s.Attributes() {
		m[string(a.Key)] = a.Value.String()
	}
	return m
}

// tracedDelete calls one host activity the way the workflows' hostRunner
// does: on the host's queue, with its stage on the call's context.
func tracedDelete(ctx workflow.Context, req *vmflowv1.DeleteRequest) error {
	ctx = workflow.WithActivityOptions(ctx, workflow.ActivityOptions{
		TaskQueue: contract.HostTaskQueuePrefix + req.GetHostId(), StartToCloseTimeout: time.Minute,
	})
	ctx = workflow.WithValue(ctx, contract.StageKey, "stopping")
	return workflow.ExecuteActivity(ctx, "StopThing", &vmflowv1.InstanceRef{InstanceId: req.GetInstanceId()}).Get(ctx, nil)
}

// The workflow run, its activity call and the activity's run carry the
// instance, the host and the call's stage: the workflow's own span from
// its input, the call's from the workflow's context, the run's on the
// agent from the activity's input, queue and header.
func TestTracingSpanAttributes(t *testing.T) {
	otlptest.ClearEnv(t)
	rec := tracetest.NewSpanRecorder()
	tr, err := newTracing(context.Background(), TracingOptions{Service: "vmflow-test"}, sdktrace.WithSpanProcessor(rec))
	require.NoError(t, err)
	var workerInterceptors []interceptor.WorkerInterceptor
	for _, i := range tr.interceptors {
		workerInterceptors = append(workerInterceptors, i.(interceptor.WorkerInterceptor))
	}

	var suite testsuite.WorkflowTestSuite
	env := suite.NewTestWorkflowEnvironment()
	env.SetWorkerOptions(worker.Options{Interceptors: workerInterceptors})
	env.RegisterWorkflow(tracedDelete)
	var inActivity trace.SpanContext
	env.RegisterActivityWithOptions(func(ctx context.Context, ref *vmflowv1.InstanceRef) error {
		inActivity = trace.SpanContextFromContext(ctx)
		return nil
	}, activity.RegisterOptions{Name: "StopThing"})
	env.ExecuteWorkflow(tracedDelete, &vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1"})
	require.True(t, env.IsWorkflowCompleted())
	require.NoError(t, env.GetWorkflowError())

	spans := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		spans[s.Name()] = s
	}
	want := map[string]map[string]string{
		"RunWorkflow:tracedDelete": {AttrInstanceID: "vm1", AttrHostID: "h1"},
		"StartActivity:StopThing":  {AttrInstanceID: "vm1", AttrHostID: "h1", AttrStage: "stopping"},
		"RunActivity:StopThing":    {AttrInstanceID: "vm1", AttrHostID: "h1", AttrStage: "stopping"},
	}
	for name, attrs := range want {
		s, ok := spans[name]
		if !assert.True(t, ok, "span %s recorded (have %v)", name, rec.Ended()) {
			continue
		}
		got := attrsOf(s)
		for k, v := range attrs {
			assert.Equal(t, v, got[k], "%s: %s", name, k)
		}
		if name == "RunWorkflow:tracedDelete" {
			assert.NotContains(t, got, AttrStage, "the run is no one call's stage")
		}
	}
	run := spans["RunActivity:StopThing"]
	require.NotNil(t, run)
	assert.Equal(t, run.SpanContext().SpanID(), inActivity.SpanID(), "the activity's context holds its span")
	assert.Equal(t, spans["StartActivity:StopThing"].SpanContext().SpanID(), run.Parent().SpanID(), "one trace through the header")
}

// clientStub stands in for the SDK below the client interceptors.
type clientStub struct {
	interceptor.ClientOutboundInterceptor
	started bool
}

func (c *clientStub) ExecuteWorkflow(context.Context, *interceptor.ClientExecuteWorkflowInput) (client.WorkflowRun, error) {
	c.started = true
	return nil, nil
}

// A platform API's workflow start carries the instance and host of its
// request.
func TestTracingStartAttributes(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	ctx, span := tp.Tracer("test").Start(context.Background(), "StartWorkflow:DeleteInstance")
	stub := &clientStub{}
	out := (&spanAttributes{}).InterceptClient(stub)
	_, err := out.ExecuteWorkflow(ctx, &interceptor.ClientExecuteWorkflowInput{
		WorkflowType: "DeleteInstance", Args: []any{&vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1"}},
	})
	require.NoError(t, err)
	span.End()
	assert.True(t, stub.started)
	require.Len(t, rec.Ended(), 1)
	got := attrsOf(rec.Ended()[0])
	assert.Equal(t, "vm1", got[AttrInstanceID])
	assert.Equal(t, "h1", got[AttrHostID])
}
