package platformapi

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/api/operatorservice/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"

	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// EnvTemporal names the temporal CLI to run the dev server with; unset, the
// vmflow checkout's bin/temporal (`make tools`) is used.
const EnvTemporal = "VMFLOW_TEMPORAL"

// host answers the host activities like a healthy host, except that
// ReleaseLeases fails while failRelease is set. It stands in for the host
// agent: this test is about what crosses the wire between a platform API,
// the workers and the host queue.
type host struct {
	failRelease atomic.Bool
	launches    atomic.Int32
}

var _ workflows.HostActivities = (*host)(nil)

func (*host) ValidateSpawn(context.Context, *vmflowv1.SpawnRequest) error { return nil }
func (*host) CreateRecord(context.Context, *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	return &vmflowv1.CreateRecordResult{InstanceUuid: "u1", CreatedByThisSpawn: true}, nil
}
func (*host) ClaimDevices(context.Context, *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error) {
	return nil, temporal.NewNonRetryableApplicationError("no vGPU in this test", workflows.ErrTypeVGPUUnavailable, nil)
}
func (h *host) LaunchVM(context.Context, *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	h.launches.Add(1)
	return &vmflowv1.LaunchVMResult{Pid: 42}, nil
}
func (*host) BeginDelete(context.Context, *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error) {
	return &vmflowv1.BeginDeleteResult{HasClaim: true}, nil
}
func (*host) StopVM(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error) {
	return &vmflowv1.StopVMResult{StepReached: "quit"}, nil
}
func (*host) WaitVMExit(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (h *host) ReleaseLeases(context.Context, *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error) {
	if h.failRelease.Load() {
		return nil, temporal.NewApplicationError("write remove: device or resource busy", workflows.ErrTypeReleaseFailed)
	}
	return &vmflowv1.ReleaseVGPUResult{Released: true}, nil
}
func (*host) TearDown(context.Context, *vmflowv1.InstanceRef) error     { return nil }
func (*host) DeleteRecord(context.Context, *vmflowv1.InstanceRef) error { return nil }
func (*host) ReconcileHost(context.Context, *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error) {
	return &vmflowv1.ReconcileVGPUResult{}, nil
}

// TestPlatformAPIOnDefaultConverter is the contract with a platform API that
// is not vmflow code: a client built from client.Options with no
// DataConverter sends proto messages as json/protobuf (lowerCamel keys) and
// plain objects as json/plain; vmflow's workers decode both and answer in
// json/plain snake_case, which that client reads.
func TestPlatformAPIOnDefaultConverter(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	addr, dir := startDevServer(t)

	// vmflow's side: workers on vmflow's converter, dialled through the
	// public vmflow/platform package.
	wc, err := platform.Dial(ctx, platform.Options{
		HostPort: addr, Namespace: client.DefaultNamespace,
		Env: emptyEnv{}, ConfigFile: filepath.Join(dir, "no-temporal-config.toml"),
		RetryInitial: 100 * time.Millisecond, RetryMax: time.Second,
	})
	require.NoError(t, err, "dev server log:\n%s", logTail(dir))
	defer wc.Close()
	waitSearchAttributes(ctx, t, wc)

	const queue = "vmflow-platformapi-test"
	w := worker.New(wc, queue, worker.Options{})
	// An hour of release backoff: only the retry signal can finish the
	// delete within this test.
	workflows.New(workflows.Config{ReleaseBackoff: time.Hour, ReleaseBackoffMax: time.Hour}).Register(w)
	require.NoError(t, w.Start())
	defer w.Stop()
	h := &host{}
	hw := worker.New(wc, workflows.HostTaskQueue("h1"), worker.Options{})
	workflows.RegisterHostActivities(hw, h)
	require.NoError(t, hw.Start())
	defer hw.Stop()

	// The platform API: the SDK's defaults, nothing from vmflow but names
	// and the generated request types.
	pc, err := client.DialContext(ctx, client.Options{HostPort: addr})
	require.NoError(t, err)
	defer pc.Close()
	start := func(id string) client.StartWorkflowOptions {
		return client.StartWorkflowOptions{
			ID: id, TaskQueue: queue,
			WorkflowIDConflictPolicy: enumspb.WORKFLOW_ID_CONFLICT_POLICY_USE_EXISTING,
			WorkflowIDReusePolicy:    enumspb.WORKFLOW_ID_REUSE_POLICY_ALLOW_DUPLICATE,
		}
	}

	// Spawn with a proto message: the default converter sends json/protobuf.
	spawn, err := pc.ExecuteWorkflow(ctx, start(workflows.SpawnWorkflowID("vm1")), workflows.SpawnWorkflow,
		&vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 1, MemoryMib: 64, Machine: "none"})
	require.NoError(t, err)
	var res vmflowv1.SpawnResult
	spawnCtx, cancelSpawn := context.WithTimeout(ctx, 30*time.Second)
	defer cancelSpawn()
	require.NoError(t, spawn.Get(spawnCtx, &res), "the worker decodes the json/protobuf spawn request")
	assert.EqualValues(t, 42, res.GetPid())
	assert.Equal(t, "u1", res.GetInstanceUuid())
	assert.EqualValues(t, 1, h.launches.Load())
	in := startInput(ctx, t, pc, workflows.SpawnWorkflowID("vm1"))
	assert.Equal(t, converter.MetadataEncodingProtoJSON, encodingOf(in), "the default converter really sent json/protobuf")
	assert.Contains(t, string(in.GetData()), `"instanceId":"vm1"`)
	// The result is json/plain with snake_case keys, what another
	// language's client gets as a plain object.
	var plain map[string]any
	require.NoError(t, spawn.Get(ctx, &plain))
	assert.Equal(t, map[string]any{"pid": float64(42), "instance_uuid": "u1", "host_id": "h1"}, plain)

	// Delete with a plain object with snake_case keys (json/plain), as the
	// TypeScript SDK sends one; the release fails until the fault clears.
	h.failRelease.Store(true)
	delID := workflows.DeleteWorkflowID("vm1")
	del, err := pc.ExecuteWorkflow(ctx, start(delID), workflows.DeleteWorkflow,
		map[string]any{"instance_id": "vm1", "host_id": "h1", "graceful_timeout_seconds": 5})
	require.NoError(t, err)
	assert.Equal(t, converter.MetadataEncodingJSON, encodingOf(startInput(ctx, t, pc, delID)))

	var st *vmflowv1.WorkflowStatus
	require.Eventually(t, func() bool {
		v, err := pc.QueryWorkflow(ctx, delID, "", workflows.StatusQuery)
		if err != nil {
			return false
		}
		var cur vmflowv1.WorkflowStatus
		if v.Get(&cur) != nil {
			return false
		}
		st = &cur
		return st.GetStage() == workflows.StageReleaseFailed
	}, time.Minute, 100*time.Millisecond, "delete never reached release-failed")
	assert.True(t, st.GetNeedsAttention())
	assert.Contains(t, st.GetLastError(), "device or resource busy")
	// The raw answer: json/plain, snake_case.
	v, err := pc.QueryWorkflow(ctx, delID, "", workflows.StatusQuery)
	require.NoError(t, err)
	var raw converter.RawValue
	require.NoError(t, v.Get(&raw))
	assert.Equal(t, converter.MetadataEncodingJSON, encodingOf(raw.Payload()))
	assert.Contains(t, string(raw.Payload().GetData()), `"needs_attention":true`)

	// The typed client, on vmflow's converter, sees the same.
	vc := workflows.NewClient(wc, queue)
	typed, err := vc.Status(ctx, delID)
	require.NoError(t, err)
	assert.Equal(t, workflows.StageReleaseFailed, typed.GetStage())

	// Retry with a proto message (json/protobuf) cuts the hour's backoff.
	h.failRelease.Store(false)
	require.NoError(t, pc.SignalWorkflow(ctx, delID, "", workflows.RetrySignal, &vmflowv1.RetrySignal{Reason: "fault cleared"}))
	done, cancelDone := context.WithTimeout(ctx, 30*time.Second)
	defer cancelDone()
	var dres vmflowv1.DeleteResult
	require.NoError(t, del.Get(done, &dres), "the retry signal finishes the delete")
	assert.False(t, dres.GetAbandoned())
	assert.Equal(t, converter.MetadataEncodingProtoJSON, encodingOf(signalInput(ctx, t, pc, delID)))

	v, err = pc.QueryWorkflow(ctx, delID, "", workflows.StatusQuery)
	require.NoError(t, err)
	// A fresh value: encoding/json (the default converter's json/plain
	// decoder) leaves fields the JSON omits, and false is omitted.
	var final vmflowv1.WorkflowStatus
	require.NoError(t, v.Get(&final))
	assert.Equal(t, workflows.StageDeleted, final.GetStage())
	assert.False(t, final.GetNeedsAttention())

	// A json/protobuf request with a field vmflow does not have (a typo, a
	// newer contract) is refused, the field named, not run with it dropped.
	bad := converter.NewRawValue(&commonpb.Payload{
		Metadata: map[string][]byte{
			converter.MetadataEncoding:    []byte(converter.MetadataEncodingProtoJSON),
			converter.MetadataMessageType: []byte("vmflow.v1.SpawnRequest"),
		},
		Data: []byte(`{"instanceId":"vm2","hostId":"h1","vcpu":1}`),
	})
	badRun, err := pc.ExecuteWorkflow(ctx, start(workflows.SpawnWorkflowID("vm2")), workflows.SpawnWorkflow, bad)
	require.NoError(t, err)
	defer func() {
		// A decode failure fails the workflow task, which keeps the run
		// open and retrying: do not leave it behind.
		_ = pc.TerminateWorkflow(context.Background(), badRun.GetID(), "", "test done")
	}()
	var failure string
	require.Eventually(t, func() bool {
		return historyHas(ctx, t, pc, badRun.GetID(), func(e *historypb.HistoryEvent) bool {
			msg := e.GetWorkflowTaskFailedEventAttributes().GetFailure().GetMessage() +
				e.GetWorkflowExecutionFailedEventAttributes().GetFailure().GetMessage()
			failure = msg
			return msg != ""
		})
	}, time.Minute, 200*time.Millisecond, "the bad request never failed")
	assert.Contains(t, failure, `unknown field "vcpu"`)
	assert.EqualValues(t, 1, h.launches.Load(), "nothing launched for it")
}

func encodingOf(p *commonpb.Payload) string {
	return string(p.GetMetadata()[converter.MetadataEncoding])
}

// startInput is the first input payload of a workflow's current run.
func startInput(ctx context.Context, t *testing.T, c client.Client, id string) *commonpb.Payload {
	t.Helper()
	var in *commonpb.Payload
	historyHas(ctx, t, c, id, func(e *historypb.HistoryEvent) bool {
		if a := e.GetWorkflowExecutionStartedEventAttributes(); a != nil {
			in = a.GetInput().GetPayloads()[0]
			return true
		}
		return false
	})
	require.NotNil(t, in, "no start event for %s", id)
	return in
}

// signalInput is the input of a workflow's first signal.
func signalInput(ctx context.Context, t *testing.T, c client.Client, id string) *commonpb.Payload {
	t.Helper()
	var in *commonpb.Payload
	historyHas(ctx, t, c, id, func(e *historypb.HistoryEvent) bool {
		if a := e.GetWorkflowExecutionSignaledEventAttributes(); a != nil {
			in = a.GetInput().GetPayloads()[0]
			return true
		}
		return false
	})
	require.NotNil(t, in, "no signal for %s", id)
	return in
}

// historyHas reports whether an event of id's history matches.
func historyHas(ctx context.Context, t *testing.T, c client.Client, id string, match func(*historypb.HistoryEvent) bool) bool {
	t.Helper()
	it := c.GetWorkflowHistory(ctx, id, "", false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	for it.HasNext() {
		e, err := it.Next()
		require.NoError(t, err)
		if match(e) {
			return true
		}
	}
	return false
}

// startDevServer runs `temporal server start-dev` with vmflow's search
// attributes (the workflows set them) and stops it when t ends. It returns
// the frontend's address and a folder for the test's files.
func startDevServer(t *testing.T) (addr, dir string) {
	t.Helper()
	bin := os.Getenv(EnvTemporal)
	if bin == "" {
		// go test runs in this folder; the vmflow checkout is two up.
		bin = filepath.Join("..", "..", "bin", "temporal")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Skipf("Temporal CLI not found (%v): `make tools` builds bin/temporal, or set %s", err, EnvTemporal)
	}
	dir = t.TempDir()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))

	args := []string{"server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", strconv.Itoa(port),
		"--db-filename", filepath.Join(dir, "temporal.db"), "--log-level", "warn"}
	for _, sa := range searchAttributes {
		args = append(args, "--search-attribute", sa.name+"="+sa.cliType)
	}
	logf, err := os.Create(filepath.Join(dir, "temporal.log"))
	require.NoError(t, err)
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// The server dies with the test binary (a timeout panic, kill -9).
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		defer logf.Close()
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
			t.Errorf("SIGTERM dev server: %v", err)
		}
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	return addr, dir
}

// searchAttributes are the workflows' search attributes, as the CLI's
// --search-attribute spells their types.
var searchAttributes = []struct{ name, cliType string }{
	{workflows.SAInstanceID.GetName(), "Keyword"},
	{workflows.SAHostID.GetName(), "Keyword"},
	{workflows.SAStage.GetName(), "Keyword"},
	{workflows.SANeedsAttention.GetName(), "Bool"},
}

// waitSearchAttributes waits until the server lists them: it may accept
// connections before it has registered them.
func waitSearchAttributes(ctx context.Context, t *testing.T, c client.Client) {
	t.Helper()
	var missing error
	require.Eventually(t, func() bool {
		resp, err := c.OperatorService().ListSearchAttributes(ctx,
			&operatorservice.ListSearchAttributesRequest{Namespace: client.DefaultNamespace})
		if err != nil {
			missing = err
			return false
		}
		for _, sa := range searchAttributes {
			if _, ok := resp.GetCustomAttributes()[sa.name]; !ok {
				missing = fmt.Errorf("search attribute %s not registered", sa.name)
				return false
			}
		}
		return true
	}, time.Minute, 100*time.Millisecond, "search attributes: %v", &missing)
}

func logTail(dir string) string {
	b, err := os.ReadFile(filepath.Join(dir, "temporal.log"))
	if err != nil {
		return err.Error()
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// emptyEnv keeps the developer's TEMPORAL_* variables out of the test.
type emptyEnv struct{}

func (emptyEnv) LookupEnv(string) (string, bool) { return "", false }
func (emptyEnv) Environ() []string               { return nil }
