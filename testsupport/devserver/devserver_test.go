package devserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/api/operatorservice/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"vmflow/internal/tclient"
	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if err := StopShared(); err != nil {
		fmt.Fprintln(os.Stderr, "devserver:", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// echoSpawn is a trivial workflow over the real contract types: it proves
// the input was decoded field by field.
func echoSpawn(_ workflow.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.SpawnResult, error) {
	return &vmflowv1.SpawnResult{QmpSocket: req.GetInstanceId() + "@" + req.GetHostId(), Pid: int32(req.GetVcpus())}, nil
}

// waitForGo blocks until the "go" signal, then returns its reason.
func waitForGo(ctx workflow.Context, _ *vmflowv1.DeleteRequest) (*vmflowv1.DeleteResult, error) {
	var sig *vmflowv1.RetrySignal
	workflow.GetSignalChannel(ctx, "go").Receive(ctx, &sig)
	return &vmflowv1.DeleteResult{AbandonReason: sig.GetReason()}, nil
}

func startWorker(t *testing.T, c client.Client, queue string) {
	t.Helper()
	w := worker.New(c, queue, worker.Options{})
	w.RegisterWorkflowWithOptions(echoSpawn, workflow.RegisterOptions{Name: "EchoSpawn"})
	w.RegisterWorkflowWithOptions(waitForGo, workflow.RegisterOptions{Name: "WaitForGo"})
	require.NoError(t, w.Start())
	t.Cleanup(w.Stop)
}

// eventually polls cond until it returns nil or the deadline passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s: %v", what, timeout, err)
		}
		<-tick.C
	}
}

func history(ctx context.Context, c client.Client, id string) ([]*historypb.HistoryEvent, error) {
	it := c.GetWorkflowHistory(ctx, id, "", false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	var events []*historypb.HistoryEvent
	for it.HasNext() {
		e, err := it.Next()
		if err != nil {
			return nil, err
		}
		events = append(events, e)
	}
	return events, nil
}

func TestStrictConverterEndToEnd(t *testing.T) {
	s := Shared(t)
	metrics, err := tclient.NewMetrics()
	require.NoError(t, err)
	opts := s.TClientOptions()
	opts.MetricsHandler = metrics.SDKHandler()
	dctx, dcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer dcancel()
	c, err := platform.Dial(dctx, opts)
	require.NoError(t, err)
	t.Cleanup(c.Close)

	queue := "devserver-test-" + t.Name()
	startWorker(t, c, queue)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	t.Run("Go client round trip", func(t *testing.T) {
		run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "echo/go", TaskQueue: queue},
			"EchoSpawn", &vmflowv1.SpawnRequest{InstanceId: "vm0", HostId: "h0", Vcpus: 2})
		require.NoError(t, err)
		var res *vmflowv1.SpawnResult
		require.NoError(t, run.Get(ctx, &res))
		assert.Equal(t, "vm0@h0", res.GetQmpSocket())
		assert.Equal(t, int32(2), res.GetPid())

		// What the UI and CLI show: json/plain, snake_case.
		events, err := history(ctx, c, "echo/go")
		require.NoError(t, err)
		in := events[0].GetWorkflowExecutionStartedEventAttributes().GetInput().GetPayloads()[0]
		assert.Equal(t, "json/plain", string(in.GetMetadata()[converter.MetadataEncoding]))
		assert.JSONEq(t, `{"instance_id":"vm0","host_id":"h0","vcpus":2}`, string(in.GetData()))
		last := events[len(events)-1].GetWorkflowExecutionCompletedEventAttributes().GetResult().GetPayloads()[0]
		assert.JSONEq(t, `{"pid":2,"qmp_socket":"vm0@h0"}`, string(last.GetData()))
	})

	t.Run("CLI snake_case input decodes", func(t *testing.T) {
		out, err := s.CLI(ctx, "workflow", "start", "--task-queue", queue, "--type", "EchoSpawn",
			"--workflow-id", "echo/cli-snake", "--input", `{"instance_id":"vm1","host_id":"h1","vcpus":1}`)
		require.NoError(t, err, string(out))
		var res *vmflowv1.SpawnResult
		require.NoError(t, c.GetWorkflow(ctx, "echo/cli-snake", "").Get(ctx, &res))
		assert.Equal(t, "vm1@h1", res.GetQmpSocket())
		assert.Equal(t, int32(1), res.GetPid())

		// And the CLI reads our result back as plain JSON.
		out, err = s.CLI(ctx, "workflow", "result", "--workflow-id", "echo/cli-snake")
		require.NoError(t, err, string(out))
		t.Logf("temporal workflow result:\n%s", out)
		assert.Contains(t, string(out), `"qmp_socket":"vm1@h1"`)
	})

	t.Run("CLI camelCase input is rejected naming the key", func(t *testing.T) {
		out, err := s.CLI(ctx, "workflow", "start", "--task-queue", queue, "--type", "EchoSpawn",
			"--workflow-id", "echo/cli-camel", "--input", `{"instanceId":"vm1","host_id":"h1"}`)
		require.NoError(t, err, string(out))
		t.Cleanup(func() {
			// If decoding failed the workflow task (rather than the
			// workflow), the run stays open; do not leave it retrying.
			tctx, tcancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer tcancel()
			_ = c.TerminateWorkflow(tctx, "echo/cli-camel", "", "test done")
		})
		var failure string
		eventually(t, 30*time.Second, "decode failure in history", func() error {
			events, err := history(ctx, c, "echo/cli-camel")
			if err != nil {
				return err
			}
			for _, e := range events {
				if a := e.GetWorkflowExecutionFailedEventAttributes(); a != nil {
					failure = e.GetEventType().String() + ": " + a.GetFailure().GetMessage()
					return nil
				}
				if a := e.GetWorkflowTaskFailedEventAttributes(); a != nil {
					failure = e.GetEventType().String() + ": " + a.GetFailure().GetMessage()
					return nil
				}
			}
			return errors.New("no failure event yet")
		})
		t.Logf("failure seen in history: %s", failure)
		assert.Contains(t, failure, `"instanceId" is camelCase: use "instance_id"`)
	})

	t.Run("SDK metrics reach the registry", func(t *testing.T) {
		// A workflow of its own: the subtest passes alone too (-run
		// .../SDK), not only after the others completed theirs.
		run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "echo/metrics", TaskQueue: queue},
			"EchoSpawn", &vmflowv1.SpawnRequest{InstanceId: "vm2", HostId: "h2", Vcpus: 1})
		require.NoError(t, err)
		require.NoError(t, run.Get(ctx, nil))
		rec := httptest.NewRecorder()
		metrics.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		assert.Contains(t, rec.Body.String(), "temporal_workflow_completed_total")
		assert.Contains(t, rec.Body.String(), "temporal_request_total")
	})
}

func TestRestartKeepsRunningWorkflow(t *testing.T) {
	begin := time.Now()
	s := Start(t, Options{DBFile: filepath.Join(t.TempDir(), "restart.db")})
	t.Logf("dev server ready in %s on %s", time.Since(begin).Round(time.Millisecond), s.Address())
	c := s.Client(t)
	startWorker(t, c, "restart")

	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "wait/1", TaskQueue: "restart"},
		"WaitForGo", &vmflowv1.DeleteRequest{InstanceId: "vm1"})
	require.NoError(t, err)
	// Wait until the worker has run the first workflow task, so the run is
	// really in progress (blocked on the signal) when the server goes away.
	eventually(t, 30*time.Second, "first workflow task completed", func() error {
		events, err := history(ctx, c, "wait/1")
		if err != nil {
			return err
		}
		for _, e := range events {
			if e.GetEventType() == enumspb.EVENT_TYPE_WORKFLOW_TASK_COMPLETED {
				return nil
			}
		}
		return errors.New("not yet")
	})

	begin = time.Now()
	before := s.proc
	require.NoError(t, s.Restart())
	t.Logf("dev server restarted in %s", time.Since(begin).Round(time.Millisecond))
	require.True(t, s.Running())
	// A crash, not a shutdown: the old server got no chance to flush or
	// say goodbye.
	var exit *exec.ExitError
	require.ErrorAs(t, before.waitErr(), &exit)
	ws, ok := exit.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	assert.Equal(t, syscall.SIGKILL, ws.Signal(), "the restart killed the old server: %v", exit)

	// The same client and worker carry on after the restart.
	eventually(t, 30*time.Second, "signal after restart", func() error {
		return c.SignalWorkflow(ctx, "wait/1", "", "go", &vmflowv1.RetrySignal{Reason: "after restart"})
	})
	var res *vmflowv1.DeleteResult
	require.NoError(t, run.Get(ctx, &res))
	assert.Equal(t, "after restart", res.GetAbandonReason())

	require.NoError(t, s.Stop())
	assert.False(t, s.Running())
	require.NoError(t, s.Stop(), "stopping twice is fine")
}

func TestUI(t *testing.T) {
	s := Start(t, Options{UI: true})
	require.NotEmpty(t, s.UIAddress())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	eventually(t, 30*time.Second, "UI answers", func() error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.UIAddress()+"/", nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	})
	// The search attributes are there for the UI's saved queries, with
	// their types: listed, not ensured (which would create them).
	resp, err := s.Client(t).OperatorService().ListSearchAttributes(ctx, &operatorservice.ListSearchAttributesRequest{Namespace: s.Namespace()})
	require.NoError(t, err)
	for name, typ := range tclient.SearchAttributes() {
		got, ok := resp.GetCustomAttributes()[name]
		if assert.True(t, ok, "search attribute %s registered", name) {
			assert.Equal(t, typ, got, "type of %s", name)
		}
	}
}

func TestBinaryFromEnv(t *testing.T) {
	t.Setenv(EnvBinary, filepath.Join(t.TempDir(), "nope"))
	_, err := Binary()
	require.Error(t, err)
	assert.True(t, strings.Contains(err.Error(), EnvBinary), err.Error())
}
