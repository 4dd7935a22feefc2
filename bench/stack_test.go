package bench

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.temporal.io/sdk/client"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/store"
	"vmflow/testsupport/devserver"
	"vmflow/testsupport/stacktest"
	"vmflow/workflows"
)

// stack is a Temporal server, a worker and a host agent (the real
// binaries), a vGPU simulator, one host id and state dir.
type stack struct {
	t   *testing.T
	srv devserver.Temporal
	// dev is the dev server when srv is one (the actions section reads its
	// metrics); nil on the PostgreSQL backend.
	dev *devserver.Server
	// pg is the PostgreSQL backend when srv is one.
	pg       *devserver.PostgresServer
	c        client.Client
	hostID   string
	queue    string
	stateDir string
	st       *store.Store
	agent    *stacktest.Daemon
	worker   *stacktest.Daemon
	sim      *simtest.Sim

	agentBin string
	connEnv  []string
	out      string
	// startRetries counts workflow starts sent again after the SDK's RPC
	// deadline (see run); shared by the hosts of one stack.
	startRetries *atomic.Int64
}

// newStack starts the stack on a dev server of its own; extra are start-dev
// arguments (the scale table's dev-server variant).
func newStack(t *testing.T, extra ...string) *stack {
	// Metrics: the actions section reads the server's own `action` counter.
	srv := devserver.Start(t, devserver.Options{ExtraArgs: extra, Metrics: true})
	s := newStackOn(t, srv, "bench-h", "bench")
	s.dev = srv
	return s
}

// newStackOn starts a worker on queue and a host agent hostID against srv.
func newStackOn(t *testing.T, srv devserver.Temporal, hostID, queue string) *stack {
	s := newWorkerOn(t, srv, queue)
	s.startHost(hostID)
	return s
}

// newWorkerOn builds the binaries and starts a worker on queue against
// srv: a stack with no host agent yet.
func newWorkerOn(t *testing.T, srv devserver.Temporal, queue string) *stack {
	workerBin, agentBin, err := stacktest.BuildBinaries(ctxFor(t, 5*time.Minute), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := &stack{t: t, srv: srv, c: srv.Client(t), queue: queue, agentBin: agentBin, out: t.TempDir(), startRetries: new(atomic.Int64)}
	if d := os.Getenv("VMFLOW_BENCH_LOGS"); d != "" {
		s.out = filepath.Join(d, strings.ReplaceAll(t.Name(), "/", "_"))
		if err := os.MkdirAll(s.out, 0o755); err != nil {
			t.Fatalf("logs: %v", err)
		}
	}
	// A developer's profile (TLS, API key) must not apply here; the file
	// named does not exist.
	s.connEnv = []string{
		"TEMPORAL_ADDRESS=" + srv.Address(),
		"TEMPORAL_NAMESPACE=" + srv.Namespace(),
		"TEMPORAL_CONFIG_FILE=" + filepath.Join(s.out, "no-temporal-config.toml"),
	}
	s.worker = &stacktest.Daemon{Name: "vmflow-worker", Bin: workerBin, Env: s.connEnv, Log: filepath.Join(s.out, "worker.log"), LineWatch: true, Args: []string{
		"--task-queue", s.queue, "--address", srv.Address(), "--namespace", srv.Namespace()}}
	t.Cleanup(func() {
		if err := s.worker.Stop(); err != nil {
			t.Errorf("stop worker: %v", err)
		}
	})
	s.worker.Start(t)
	return s
}

// addHost starts another host agent (its own host id, state dir and
// simulator) on s's server and task queue, served by s's worker.
func (s *stack) addHost(hostID string) *stack {
	h := &stack{t: s.t, srv: s.srv, dev: s.dev, pg: s.pg, c: s.c, queue: s.queue, worker: s.worker,
		agentBin: s.agentBin, connEnv: s.connEnv, out: s.out, startRetries: s.startRetries}
	h.startHost(hostID)
	return h
}

// startHost starts s's host agent as hostID and waits until it serves.
func (s *stack) startHost(hostID string) {
	t := s.t
	s.hostID = hostID
	s.sim = simtest.Start(t, vgpusim.Options{MdevParents: 2, VendorVFs: 2})
	var err error
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
	agentArgs := append([]string{"run",
		"--host-id", s.hostID,
		"--state-dir", s.stateDir,
		"--sysfs-root", s.sim.Root,
		"--dev-root", devRoot,
		"--image-root", imgRoot,
		// The simulator's devices cannot be opened by QEMU.
		"--vgpu-attach=false",
		"--workflow-task-queue", s.queue,
		"--reconcile-every", "1h",
		// The benchmarks pack -machine none VMs (no guest runs, 16 MiB)
		// far past what a host of real guests promises: up to 1,000 on
		// 2 CPUs and 23 GiB here.
		"--cpu-overcommit", "256", "--memory-overcommit", "64",
		"--address", s.srv.Address(),
		"--namespace", s.srv.Namespace(),
	}, append(stacktest.HoldersIgnoreInit(), "--qemu-uid-range", stacktest.QEMUUIDRange().String())...)
	s.agent = &stacktest.Daemon{Name: "vmflow-hostagent", Bin: s.agentBin, Args: agentArgs, Env: s.connEnv, Log: filepath.Join(s.out, "hostagent-"+hostID+".log"), LineWatch: true}
	t.Cleanup(func() {
		if err := s.agent.Stop(); err != nil {
			t.Errorf("stop agent: %v", err)
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
	select {
	case <-serving:
	case <-time.After(60 * time.Second):
		t.Fatalf("agent not serving after 60 s; log %s", s.agent.Log)
	}
}

// serverTicks is the CPU the Temporal server has used so far, and its
// database's (PostgreSQL: the postmaster and every backend, live or
// exited; the dev server's SQLite is inside its process), in clock ticks.
func (s *stack) serverTicks() (server, db int64) {
	if s.pg != nil {
		return cpuTicks(s.pg.ServerPid(), false), treeTicks(s.pg.PostgresPid())
	}
	return cpuTicks(pidOf("start-dev", s.dev.DBFile()), false), 0
}
