package bench

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.temporal.io/sdk/client"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vgpu/vgpusim"
	"vmflow/hostagent/vgpu/vgpusim/simtest"
	"vmflow/internal/devserver"
	"vmflow/internal/stacktest"
	"vmflow/workflows"
)

// stack is a dev server, a worker and a host agent (the real binaries),
// a vGPU simulator, one host id and state dir.
type stack struct {
	t        *testing.T
	srv      *devserver.Server
	c        client.Client
	hostID   string
	queue    string
	stateDir string
	st       *store.Store
	agent    *stacktest.Daemon
	worker   *stacktest.Daemon
	sim      *simtest.Sim
}

// newStack starts the stack; extra are start-dev arguments (the scale
// table's dev-server variant).
func newStack(t *testing.T, extra ...string) *stack {
	workerBin, agentBin, err := stacktest.BuildBinaries(ctxFor(t, 5*time.Minute), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	// Metrics: the actions section reads the server's own `action` counter.
	srv := devserver.Start(t, devserver.Options{ExtraArgs: extra, Metrics: true})
	sim := simtest.Start(t, vgpusim.Options{MdevParents: 2, VendorVFs: 2})
	s := &stack{t: t, srv: srv, c: srv.Client(t), hostID: "bench-h", queue: "bench", sim: sim}
	if s.stateDir, err = os.MkdirTemp("/tmp", "vfb"); err != nil {
		t.Fatalf("state dir: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(s.stateDir) })
	devRoot := filepath.Join(s.stateDir, "dev")
	imgRoot := filepath.Join(s.stateDir, "img")
	for _, d := range []string{devRoot, imgRoot} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatalf("mkdir: %v", err)
		}
	}
	if s.st, err = store.New(s.stateDir); err != nil {
		t.Fatalf("store: %v", err)
	}
	// Cleanups run last-in first-out: this one runs after the agent has
	// stopped, and kills whatever QEMU a record still names. Such a QEMU is
	// this process's (adopted) child: adopt it for reaping.
	t.Cleanup(func() { stacktest.KillLeftoverVMs(t, s.st, func(pid int) { adopt(pid) }) })
	out := t.TempDir()
	if d := os.Getenv("VMFLOW_BENCH_LOGS"); d != "" {
		out = filepath.Join(d, strings.ReplaceAll(t.Name(), "/", "_"))
		if err := os.MkdirAll(out, 0o755); err != nil {
			t.Fatalf("logs: %v", err)
		}
	}
	connEnv := []string{
		"TEMPORAL_ADDRESS=" + srv.Address(),
		"TEMPORAL_NAMESPACE=" + srv.Namespace(),
		// A developer's profile (TLS, API key) must not apply here.
		"TEMPORAL_CONFIG_FILE=" + filepath.Join(s.stateDir, "no-temporal-config.toml"),
	}
	agentArgs := append([]string{"run",
		"--host-id", s.hostID,
		"--state-dir", s.stateDir,
		"--sysfs-root", sim.Root,
		"--dev-root", devRoot,
		"--image-root", imgRoot,
		// The simulator's devices cannot be opened by QEMU.
		"--vgpu-attach=false",
		"--workflow-task-queue", s.queue,
		"--reconcile-every", "1h",
		"--address", srv.Address(),
		"--namespace", srv.Namespace(),
	}, append(stacktest.HoldersIgnoreInit(), "--qemu-uid-range", stacktest.QEMUUIDRange().String())...)
	s.agent = &stacktest.Daemon{Name: "vmflow-hostagent", Bin: agentBin, Args: agentArgs, Env: connEnv, Log: filepath.Join(out, "hostagent.log"), LineWatch: true}
	s.worker = &stacktest.Daemon{Name: "vmflow-worker", Bin: workerBin, Env: connEnv, Log: filepath.Join(out, "worker.log"), LineWatch: true, Args: []string{
		"--task-queue", s.queue, "--address", srv.Address(), "--namespace", srv.Namespace()}}
	t.Cleanup(func() {
		if err := s.agent.Stop(); err != nil {
			t.Errorf("stop agent: %v", err)
		}
	})
	t.Cleanup(func() {
		if err := s.worker.Stop(); err != nil {
			t.Errorf("stop worker: %v", err)
		}
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		// Best effort: the reconcile schedule the agent created.
		_ = s.c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID(s.hostID)).Delete(ctx)
	})
	serving := s.agent.Watch(func(l string) bool { return strings.Contains(l, `"serving host activities"`) })
	s.agent.Start(t)
	s.worker.Start(t)
	select {
	case <-serving:
	case <-time.After(60 * time.Second):
		t.Fatalf("agent not serving after 60 s; log %s", s.agent.Log)
	}
	return s
}
