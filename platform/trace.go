package platform

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/client"
	temporalotel "go.temporal.io/sdk/contrib/opentelemetry"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/interceptor"
	"go.temporal.io/sdk/workflow"

	"vmflow/internal/contract"
)

// The standard OpenTelemetry variables that turn tracing on: the OTLP
// collector's base URL ("/v1/traces" is appended) or the traces URL itself.
// The exporter reads the rest of the OTEL_EXPORTER_OTLP_* family (headers,
// TLS files, timeout, compression) and the SDK OTEL_TRACES_SAMPLER,
// OTEL_BSP_* and OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES.
const (
	EnvOTLPEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	EnvOTLPTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
)

// Span attributes vmflow adds to the Temporal SDK's spans (the log keys of
// the same values).
const (
	AttrInstanceID = "instance_id"
	AttrHostID     = "host_id"
	AttrStage      = "stage"
)

// stageHeader carries a host call's stage from the workflow to the
// activity's span on the agent, beside the trace's own header; only a
// process with tracing on writes or reads it.
const stageHeader = "vmflow-stage"

// Tracing is OpenTelemetry tracing of one process's Temporal calls: the
// SDK's tracing interceptor (a span per workflow start, workflow run,
// activity start and run, joined into one trace through Temporal headers)
// exporting over OTLP/HTTP, with vmflow's instance_id, host_id and stage
// on the spans. Options.Tracing sets it on a client; a nil *Tracing is
// tracing off.
type Tracing struct {
	provider     *sdktrace.TracerProvider
	interceptors []interceptor.ClientInterceptor
	endpoint     string
}

// TracingOptions configure StartTracing.
type TracingOptions struct {
	// Service is the service.name of the process's spans: vmflow-worker,
	// vmflow-hostagent, or a platform API's own name. OTEL_SERVICE_NAME
	// overrides it.
	Service string
	// Attributes are added to the resource (the agent's host_id);
	// OTEL_RESOURCE_ATTRIBUTES adds more.
	Attributes []attribute.KeyValue
}

// TracingRequested reports whether the environment asks for traces: an OTLP
// endpoint is set, and neither OTEL_SDK_DISABLED=true nor
// OTEL_TRACES_EXPORTER=none turns them off.
func TracingRequested() bool {
	return tracingEndpoint() != ""
}

func tracingEndpoint() string {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") || os.Getenv("OTEL_TRACES_EXPORTER") == "none" {
		return ""
	}
	if e := os.Getenv(EnvOTLPTracesEndpoint); e != "" {
		return e
	}
	return os.Getenv(EnvOTLPEndpoint)
}

// StartTracing starts exporting traces over OTLP/HTTP when the environment
// asks for them (TracingRequested) and returns nil otherwise: no exporter, no
// interceptor, nothing running. Shut the result down before the process
// exits, so the last spans are sent.
func StartTracing(ctx context.Context, o TracingOptions) (*Tracing, error) {
	endpoint := tracingEndpoint()
	if endpoint == "" {
		return nil, nil
	}
	if err := checkTraceProtocol(); err != nil {
		return nil, err
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("tracing: OTLP exporter for %s: %w", endpoint, err)
	}
	t, err := newTracing(ctx, o, sdktrace.WithBatcher(exp))
	if err != nil {
		return nil, errors.Join(err, exp.Shutdown(ctx))
	}
	t.endpoint = endpoint
	return t, nil
}

// checkTraceProtocol refuses an OTLP protocol this exporter does not speak
// (grpc): silently sending HTTP to a gRPC port would lose every span.
func checkTraceProtocol() error {
	for _, v := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		switch p := os.Getenv(v); p {
		case "":
			continue
		case "http/protobuf", "http/json":
			return nil
		default:
			return fmt.Errorf("tracing: %s=%q: vmflow exports OTLP over HTTP only (http/protobuf or http/json; the collector's port 4318)", v, p)
		}
	}
	return nil
}

// newTracing builds the provider over the span processor and the
// interceptors that use it.
func newTracing(ctx context.Context, o TracingOptions, processor sdktrace.TracerProviderOption) (*Tracing, error) {
	if o.Service == "" {
		return nil, errors.New("tracing: no service name")
	}
	// Later options win: the environment overrides what the code says.
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(o.Service)),
		resource.WithAttributes(o.Attributes...),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv())
	if err != nil {
		return nil, fmt.Errorf("tracing: resource: %w", err)
	}
	// The sampler is the SDK's default (parent-based, always on) unless
	// OTEL_TRACES_SAMPLER says otherwise.
	tp := sdktrace.NewTracerProvider(processor, sdktrace.WithResource(res))
	ti, err := temporalotel.NewTracingInterceptor(temporalotel.TracerOptions{Tracer: tp.Tracer("vmflow")})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("tracing: interceptor: %w", err), tp.Shutdown(ctx))
	}
	// The order matters: a workflow's outbound calls pass the interceptors
	// last to first, everything else first to last. callStage must see a
	// workflow's activity call after the tracing interceptor started its
	// span, spanAttributes every other call after it.
	return &Tracing{provider: tp, interceptors: []interceptor.ClientInterceptor{&callStage{}, ti, &spanAttributes{}}}, nil
}

// Shutdown sends the spans not sent yet and stops the exporter, within
// ctx's deadline. Nil (tracing off) does nothing.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if t == nil {
		return nil
	}
	if err := t.provider.Shutdown(ctx); err != nil {
		return fmt.Errorf("tracing: flush to %s: %w", t.endpoint, err)
	}
	return nil
}

// TracerProvider is where the process's own spans come from (a noop one
// for a nil Tracing): a platform API that starts its request's span from
// it makes the workflows it starts part of the request's trace.
func (t *Tracing) TracerProvider() trace.TracerProvider {
	if t == nil {
		return noop.NewTracerProvider()
	}
	return t.provider
}

// Endpoint is where the spans go ("" for a nil Tracing).
func (t *Tracing) Endpoint() string {
	if t == nil {
		return ""
	}
	return t.endpoint
}

// requestAttributes are the instance and host a Temporal call's first
// argument names (every vmflow request has an instance_id; a workflow's
// has its host_id).
func requestAttributes(args []any) []attribute.KeyValue {
	if len(args) == 0 {
		return nil
	}
	var attrs []attribute.KeyValue
	if r, ok := args[0].(interface{ GetInstanceId() string }); ok && r.GetInstanceId() != "" {
		attrs = append(attrs, attribute.String(AttrInstanceID, r.GetInstanceId()))
	}
	if r, ok := args[0].(interface{ GetHostId() string }); ok && r.GetHostId() != "" {
		attrs = append(attrs, attribute.String(AttrHostID, r.GetHostId()))
	}
	return attrs
}

// queueAttributes: the host whose queue a host activity runs on.
func queueAttributes(queue string) []attribute.KeyValue {
	if host, ok := strings.CutPrefix(queue, contract.HostTaskQueuePrefix); ok && host != "" {
		return []attribute.KeyValue{attribute.String(AttrHostID, host)}
	}
	return nil
}

// spanAttributes adds vmflow's attributes to the span the tracing
// interceptor started for a workflow start (the platform API's),
// a workflow run (the worker's) and an activity run (the agent's).
type spanAttributes struct {
	interceptor.InterceptorBase
}

func (*spanAttributes) InterceptClient(next interceptor.ClientOutboundInterceptor) interceptor.ClientOutboundInterceptor {
	i := &startAttributes{}
	i.Next = next
	return i
}

func (*spanAttributes) InterceptActivity(ctx context.Context, next interceptor.ActivityInboundInterceptor) interceptor.ActivityInboundInterceptor {
	i := &runActivityAttributes{}
	i.Next = next
	return i
}

func (*spanAttributes) InterceptWorkflow(ctx workflow.Context, next interceptor.WorkflowInboundInterceptor) interceptor.WorkflowInboundInterceptor {
	i := &runWorkflowAttributes{}
	i.Next = next
	return i
}

type startAttributes struct {
	interceptor.ClientOutboundInterceptorBase
}

func (i *startAttributes) ExecuteWorkflow(ctx context.Context, in *interceptor.ClientExecuteWorkflowInput) (client.WorkflowRun, error) {
	trace.SpanFromContext(ctx).SetAttributes(requestAttributes(in.Args)...)
	return i.Next.ExecuteWorkflow(ctx, in)
}

type runActivityAttributes struct {
	interceptor.ActivityInboundInterceptorBase
}

func (i *runActivityAttributes) ExecuteActivity(ctx context.Context, in *interceptor.ExecuteActivityInput) (any, error) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(requestAttributes(in.Args)...)
		span.SetAttributes(queueAttributes(activity.GetInfo(ctx).TaskQueue)...)
		var stage string
		if p := interceptor.Header(ctx)[stageHeader]; p != nil && converter.GetDefaultDataConverter().FromPayload(p, &stage) == nil && stage != "" {
			span.SetAttributes(attribute.String(AttrStage, stage))
		}
	}
	return i.Next.ExecuteActivity(ctx, in)
}

type runWorkflowAttributes struct {
	interceptor.WorkflowInboundInterceptorBase
}

func (i *runWorkflowAttributes) ExecuteWorkflow(ctx workflow.Context, in *interceptor.ExecuteWorkflowInput) (any, error) {
	// The run's span is started on replay as well (a worker that did not
	// have the run cached); it is this run's all the same.
	if span, ok := temporalotel.SpanFromWorkflowContext(ctx); ok {
		span.SetAttributes(requestAttributes(in.Args)...)
	}
	return i.Next.ExecuteWorkflow(ctx, in)
}

// callStage adds the instance, host and stage to the span of a workflow's
// host activity call and sends the stage along in the activity's header,
// for the agent's span. The stage is the one the workflow put on the
// call's context (contract.StageKey): workflow code cannot reach a span.
type callStage struct {
	interceptor.InterceptorBase
}

func (*callStage) InterceptWorkflow(ctx workflow.Context, next interceptor.WorkflowInboundInterceptor) interceptor.WorkflowInboundInterceptor {
	i := &callStageInbound{}
	i.Next = next
	return i
}

type callStageInbound struct {
	interceptor.WorkflowInboundInterceptorBase
}

func (i *callStageInbound) Init(outbound interceptor.WorkflowOutboundInterceptor) error {
	o := &callStageOutbound{}
	o.Next = outbound
	return i.Next.Init(o)
}

type callStageOutbound struct {
	interceptor.WorkflowOutboundInterceptorBase
}

func (o *callStageOutbound) ExecuteActivity(ctx workflow.Context, activityType string, args ...any) workflow.Future {
	stage, _ := ctx.Value(contract.StageKey).(string)
	if stage != "" {
		if h := interceptor.WorkflowHeader(ctx); h != nil {
			if p, err := converter.GetDefaultDataConverter().ToPayload(stage); err == nil {
				h[stageHeader] = p
			}
		}
	}
	// On replay no span is started for the call: the context's span is
	// the run's, which this call must not relabel.
	if !workflow.IsReplaying(ctx) {
		if span, ok := temporalotel.SpanFromWorkflowContext(ctx); ok {
			span.SetAttributes(requestAttributes(args)...)
			span.SetAttributes(queueAttributes(workflow.GetActivityOptions(ctx).TaskQueue)...)
			if stage != "" {
				span.SetAttributes(attribute.String(AttrStage, stage))
			}
		}
	}
	return o.Next.ExecuteActivity(ctx, activityType, args...)
}
