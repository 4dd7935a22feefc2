package e2e

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/client"
	"golang.org/x/sys/unix"

	"vmflow/guest"
	"vmflow/guest/build"
	"vmflow/hostagent/admission"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm/vmmtest"
	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
	"vmflow/testsupport/promtest"
	"vmflow/testsupport/stacktest"
	"vmflow/workflows"
)

// poll is how often wait loops look again. Every wait has a deadline.
const poll = 100 * time.Millisecond

// binaries are vmflow-worker and vmflow-hostagent, built once per test
// binary from this checkout (so the tests never run stale bin/ files).
var binaries struct {
	once   sync.Once
	dir    string
	worker string
	agent  string
	err    error
}

func buildBinaries(t *testing.T) (worker, agent string) {
	t.Helper()
	binaries.once.Do(func() {
		// Not t.TempDir: the binaries outlive the first test that asks;
		// TestMain removes the folder.
		var err error
		if binaries.dir, err = os.MkdirTemp("", "vmflow-e2e-bin-"); err != nil {
			binaries.err = fmt.Errorf("build binaries: %w", err)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		binaries.worker, binaries.agent, binaries.err = stacktest.BuildBinaries(ctx, binaries.dir)
	})
	if binaries.err != nil {
		t.Fatalf("%v", binaries.err)
	}
	return binaries.worker, binaries.agent
}

// requireQEMU skips t when QEMU is missing (`make tools` installs it).
var requireQEMU = vmmtest.RequiresQEMU

// requireGuest returns the built guest, or skips t when `make guest` has
// not built it (the tests never download a kernel themselves).
func requireGuest(t *testing.T) build.Artifacts {
	t.Helper()
	dir, err := build.DefaultDir()
	if err != nil {
		t.Fatalf("guest dir: %v", err)
	}
	a := build.Artifacts{Dir: dir, Kernel: filepath.Join(dir, build.KernelFile), Initrd: filepath.Join(dir, build.InitrdFile)}
	for _, f := range []string{a.Kernel, a.Initrd} {
		if _, err := os.Stat(f); err != nil {
			t.Skipf("guest not built (%v): `make guest` builds it into %s", err, dir)
		}
	}
	return a
}

// suffix is a random tag that keeps ids unique across tests and runs
// against a reused server.
func suffix(t *testing.T) string {
	t.Helper()
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		t.Fatalf("random: %v", err)
	}
	return hex.EncodeToString(b)
}

// outDir is where a test leaves logs and screenshots: $VMFLOW_E2E_OUT/<test>
// when set (kept after the run), else a temporary folder.
func outDir(t *testing.T) string {
	t.Helper()
	base := os.Getenv("VMFLOW_E2E_OUT")
	if base == "" {
		return t.TempDir()
	}
	d := filepath.Join(base, strings.ReplaceAll(t.Name(), "/", "_"))
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatalf("out dir: %v", err)
	}
	return d
}

// envOptions shape one test's stack.
type envOptions struct {
	// server defaults to the shared headless dev server.
	server devserver.Temporal
	// workerArgs and agentArgs are added to the worker's and the agent's
	// flags (later flags win).
	workerArgs, agentArgs []string
	// qemu replaces the agent's QEMU binary.
	qemu string
	// noStart leaves the agent and worker stopped.
	noStart bool
	// stateFS, when set, mounts a tmpfs of that many bytes as the state
	// dir: a small file system a test can fill.
	stateFS int
	// shareWith makes this env another host of that env's stack: its
	// server, task queue and worker (this env starts no worker of its own),
	// with its own agent, host id, state dir and simulator.
	shareWith *env
	// network gives the agent a network (netSubnet) in a namespace of the
	// env's own, deleted after.
	network bool
	// sim, when set, changes the simulator's options before it starts.
	sim func(*vgpusim.Options)
	// metrics serves the agent's and the worker's /metrics on loopback
	// addresses of their own (env.agentMetrics, env.workerMetrics).
	metrics bool
}

// netSubnet is every network env's subnet: each has a namespace of its own.
const netSubnet = "10.77.0.0/24"

// env is one test's vmflow stack: its own simulator, host id, state dir,
// task queue, agent and worker, against a dev server.
type env struct {
	t        *testing.T
	srv      devserver.Temporal
	c        client.Client
	sim      *simtest.Sim
	hostID   string
	queue    string
	stateDir string
	uids     store.UIDRange // the agent's --qemu-uid-range
	st       *store.Store
	out      string
	guest    build.Artifacts
	agent    *stacktest.Daemon
	worker   *stacktest.Daemon
	// netns and net: the agent's network namespace and a netlink handle in
	// it (envOptions.network); empty and nil without. netView reads the
	// agent's network (its anti-spoofing filter) without changing it.
	netns   string
	net     *netlink.Handle
	netView *network.Net
	// agentMetrics and workerMetrics: where the daemons serve /metrics
	// (envOptions.metrics); empty without.
	agentMetrics, workerMetrics string
}

func newEnv(t *testing.T, o envOptions) *env {
	t.Helper()
	requireQEMU(t)
	g := requireGuest(t)
	srv := o.server
	if o.shareWith != nil {
		srv = o.shareWith.srv
	}
	if srv == nil {
		srv = devserver.Shared(t)
	}
	workerBin, agentBin := buildBinaries(t)
	e := &env{t: t, srv: srv, c: srv.Client(t), out: outDir(t), guest: g}
	tag := suffix(t)
	e.hostID = "e2e-h-" + tag
	e.queue = "e2e-" + tag
	if o.shareWith != nil {
		e.queue = o.shareWith.queue
	}
	// Two whole GPUs (vgpusim.PCIGPUAt: one alone, one with its audio
	// function), handed out only by agents run with --gpu-passthrough.
	simOpts := vgpusim.Options{MdevParents: 2, VendorVFs: 2, PCIGPUs: 2}
	if o.sim != nil {
		o.sim(&simOpts)
	}
	e.sim = simtest.Start(t, simOpts)

	// A short state dir: QMP socket paths must fit in 107 bytes.
	var err error
	if e.stateDir, err = os.MkdirTemp("", "vf"); err != nil {
		t.Fatalf("state dir: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("state dir kept for inspection: %s", e.stateDir)
			return
		}
		if err := os.RemoveAll(e.stateDir); err != nil {
			t.Errorf("remove state dir: %v", err)
		}
	})
	if o.stateFS > 0 {
		if err := unix.Mount("tmpfs", e.stateDir, "tmpfs", 0, fmt.Sprintf("size=%d,mode=0700", o.stateFS)); err != nil {
			t.Fatalf("state file system: %v", err)
		}
		t.Cleanup(func() { _ = unix.Unmount(e.stateDir, unix.MNT_DETACH) }) // before the removal above
	}
	devRoot := filepath.Join(e.stateDir, "dev")
	if err := os.Mkdir(devRoot, 0o755); err != nil {
		t.Fatalf("dev root: %v", err)
	}
	if e.st, err = store.New(e.stateDir); err != nil {
		t.Fatalf("store: %v", err)
	}
	// Runs after the agent has stopped (cleanups run last-in first-out):
	// whatever QEMU is still alive was started for this test; kill it.
	t.Cleanup(func() { stacktest.KillLeftoverVMs(t, e.st, nil) })

	connEnv := []string{
		"TEMPORAL_ADDRESS=" + srv.Address(),
		"TEMPORAL_NAMESPACE=" + srv.Namespace(),
		// A developer's profile (TLS, API key) must not apply here.
		"TEMPORAL_CONFIG_FILE=" + filepath.Join(e.stateDir, "no-temporal-config.toml"),
	}
	agentArgs := []string{"run",
		"--host-id", e.hostID,
		"--state-dir", e.stateDir,
		"--sysfs-root", e.sim.Root,
		"--dev-root", devRoot,
		"--image-root", g.Dir,
		"--vgpu-attach=false",
		"--workflow-task-queue", e.queue,
		// Reconcile is a safety net with its own tests; here it would only
		// add retries nobody asked for.
		"--reconcile-every", "1h",
		"--address", srv.Address(),
		"--namespace", srv.Namespace(),
	}
	if o.qemu != "" {
		agentArgs = append(agentArgs, "--qemu", o.qemu)
	}
	if o.network {
		e.netns = nettest.Namespace(t)
		e.net = nettest.Handle(t, e.netns)
		// A read-only view of the agent's network (New changes nothing).
		view, err := network.New(network.Config{Subnet: netip.MustParsePrefix(netSubnet), NetNS: e.netns, Store: e.st})
		if err != nil {
			t.Fatalf("network view: %v", err)
		}
		t.Cleanup(view.Close)
		e.netView = view
		agentArgs = append(agentArgs, "--net-netns", e.netns, "--net-subnet", netSubnet)
	}
	if o.metrics {
		e.agentMetrics = freeAddr(t)
		agentArgs = append(agentArgs, "--metrics-addr", e.agentMetrics)
	}
	agentArgs = append(agentArgs, stacktest.HoldersIgnoreInit()...)
	// Agents of shared-server tests run side by side: disjoint ranges.
	e.uids = stacktest.QEMUUIDRange()
	agentArgs = append(agentArgs, "--qemu-uid-range", e.uids.String())
	// The tests' VMs are small (-machine none, or a 256 MiB guest): a host
	// of 2 CPUs at the default 4.0 holds 8, fewer than some tests run at
	// once. A test of the ledger itself sets its own (later flags win).
	agentArgs = append(agentArgs, "--cpu-overcommit", "32", "--memory-overcommit", "4")
	agentArgs = append(agentArgs, o.agentArgs...)
	// Runs after the agent has stopped, as KillLeftoverVMs does: a QEMU of
	// this agent's uids that no record names is killed too.
	uids := e.uids
	t.Cleanup(func() { stacktest.KillUIDRange(t, uids) })
	e.agent = &stacktest.Daemon{Name: "vmflow-hostagent", Bin: agentBin, Args: agentArgs, Env: connEnv, Log: filepath.Join(e.out, "hostagent.log")}
	workerArgs := append([]string{
		"--task-queue", e.queue,
		"--address", srv.Address(),
		"--namespace", srv.Namespace(),
		// Several release rounds in seconds, and an agent that is away is
		// noticed in seconds rather than a minute.
		"--release-backoff", "1s",
		"--release-backoff-max", "2s",
		"--host-pickup-timeout", "5s",
		"--unreachable-backoff", "1s",
		"--unreachable-backoff-max", "2s",
	}, o.workerArgs...)
	if o.metrics && o.shareWith == nil {
		e.workerMetrics = freeAddr(t)
		workerArgs = append(workerArgs, "--metrics-addr", e.workerMetrics)
	}
	e.worker = &stacktest.Daemon{Name: "vmflow-worker", Bin: workerBin, Args: workerArgs, Env: connEnv, Log: filepath.Join(e.out, "worker.log")}
	t.Cleanup(func() {
		if err := e.agent.Stop(); err != nil {
			t.Errorf("stop agent: %v", err)
		}
		if t.Failed() {
			t.Logf("--- %s (tail) ---\n%s", e.agent.Log, e.agent.Tail(6000))
		}
	})
	t.Cleanup(func() {
		if err := e.worker.Stop(); err != nil {
			t.Errorf("stop worker: %v", err)
		}
		if t.Failed() {
			t.Logf("--- %s (tail) ---\n%s", e.worker.Log, e.worker.Tail(3000))
		}
	})
	t.Cleanup(e.deleteSchedule)
	if !o.noStart {
		e.agent.Start(t)
		if o.shareWith == nil {
			e.worker.Start(t)
		}
	}
	return e
}

// deleteSchedule removes the reconcile Schedule the agent created, so the
// shared server does not keep starting workflows for a host that is gone.
func (e *env) deleteSchedule() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Best effort: a test that never started an agent has none.
	_ = e.c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID(e.hostID)).Delete(ctx)
}

// onBackends runs body once per Temporal backend, as subtests named after
// it: the shared dev server (SQLite) and the shared self-hosted server on
// PostgreSQL, production's backend. Each subtest's time is recorded.
func onBackends(t *testing.T, body func(t *testing.T, srv devserver.Temporal)) {
	backends := []struct {
		name  string
		start func(testing.TB) devserver.Temporal
	}{
		{"dev", func(t testing.TB) devserver.Temporal { return devserver.Shared(t) }},
		{"postgres", func(t testing.TB) devserver.Temporal { return devserver.SharedPostgres(t) }},
	}
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			timeTest(t)
			body(t, b.start(t))
		})
	}
}

// freeAddr is a loopback address nothing listened on a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	addr, err := promtest.FreeAddr()
	if err != nil {
		t.Fatalf("%v", err)
	}
	return addr
}

// waitFor polls cond until it holds or timeout passes; detail describes
// what was last seen, for the failure message.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last string
	for {
		ok, detail := cond()
		if ok {
			return
		}
		last = detail
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; last seen: %s", timeout, what, last)
		}
		time.Sleep(poll) // the poll interval of a deadline-bounded wait, not a synchronisation
	}
}

// ctx is a context for one step of a test.
func (e *env) ctx(d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	e.t.Cleanup(cancel)
	return ctx
}

// guestSpawn is a spawn request for the real guest under TCG.
func (e *env) guestSpawn(id string, vgpu bool) *vmflowv1.SpawnRequest {
	r := &vmflowv1.SpawnRequest{
		InstanceId: id, HostId: e.hostID, Vcpus: 1, MemoryMib: 256,
		Machine: "q35", Accel: "tcg",
		Kernel: e.guest.Kernel, Initrd: e.guest.Initrd, Cmdline: guest.KernelCmdline,
	}
	if vgpu {
		r.VgpuProfile = "GRID A100-4C"
	}
	return r
}

// netSpawn is a spawn request for a q35 VM with a network and no images:
// QEMU runs its firmware under TCG, which holds the TAP and answers QMP.
func (e *env) netSpawn(id string, vgpu bool) *vmflowv1.SpawnRequest {
	r := &vmflowv1.SpawnRequest{InstanceId: id, HostId: e.hostID, Vcpus: 1, MemoryMib: 128, Machine: "q35", Accel: "tcg",
		Network: admission.NetworkDefault}
	if vgpu {
		r.VgpuProfile = "GRID A100-4C"
	}
	return r
}

// taps lists the agent's TAPs (network.TAPPrefix) in its namespace.
func (e *env) taps() []string {
	e.t.Helper()
	links, err := e.net.LinkList()
	if err != nil {
		e.t.Fatalf("list links in %s: %v", e.netns, err)
	}
	var out []string
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, network.TAPPrefix) {
			out = append(out, l.Attrs().Name)
		}
	}
	return out
}

// noneSpawn is a spawn request for QEMU -machine none under the tests'
// accelerator (vmmtest.Accel: KVM where usable): a process with QMP in
// ~60 ms, no guest (system_powerdown has no effect on it).
func (e *env) noneSpawn(id string, vgpu bool) *vmflowv1.SpawnRequest {
	r := &vmflowv1.SpawnRequest{InstanceId: id, HostId: e.hostID, Vcpus: 1, MemoryMib: 128, Machine: "none", Accel: string(vmmtest.Accel())}
	if vgpu {
		r.VgpuProfile = "GRID A100-4C"
	}
	return r
}

func (e *env) startSpawn(req *vmflowv1.SpawnRequest) client.WorkflowRun {
	e.t.Helper()
	run, err := e.c.ExecuteWorkflow(e.ctx(30*time.Second), client.StartWorkflowOptions{
		ID: workflows.SpawnWorkflowID(req.GetInstanceId()), TaskQueue: e.queue,
		StaticSummary: "e2e spawn " + req.GetInstanceId(),
	}, workflows.SpawnWorkflow, req)
	if err != nil {
		e.t.Fatalf("start spawn %s: %v", req.GetInstanceId(), err)
	}
	return run
}

func (e *env) spawn(req *vmflowv1.SpawnRequest) *vmflowv1.SpawnResult {
	e.t.Helper()
	run := e.startSpawn(req)
	var res vmflowv1.SpawnResult
	if err := run.Get(e.ctx(2*time.Minute), &res); err != nil {
		e.t.Fatalf("spawn %s: %v", req.GetInstanceId(), err)
	}
	return &res
}

func (e *env) startDelete(id string, graceful uint32) client.WorkflowRun {
	e.t.Helper()
	run, err := e.c.ExecuteWorkflow(e.ctx(30*time.Second), client.StartWorkflowOptions{
		ID: workflows.DeleteWorkflowID(id), TaskQueue: e.queue,
		StaticSummary: "e2e delete " + id,
	}, workflows.DeleteWorkflow, &vmflowv1.DeleteRequest{InstanceId: id, HostId: e.hostID, GracefulTimeoutSeconds: graceful})
	if err != nil {
		e.t.Fatalf("start delete %s: %v", id, err)
	}
	return run
}

// status queries a workflow's status (the same query as the CLI's
// `temporal workflow query --name status`).
func (e *env) status(workflowID string) (*vmflowv1.WorkflowStatus, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	v, err := e.c.QueryWorkflow(ctx, workflowID, "", workflows.StatusQuery)
	if err != nil {
		return nil, fmt.Errorf("query %s: %w", workflowID, err)
	}
	var st vmflowv1.WorkflowStatus
	if err := v.Get(&st); err != nil {
		return nil, fmt.Errorf("decode status of %s: %w", workflowID, err)
	}
	return &st, nil
}

// waitStage waits until the workflow's status says stage (and, if given,
// more holds of it).
func (e *env) waitStage(workflowID, stage string, timeout time.Duration, more func(*vmflowv1.WorkflowStatus) bool) *vmflowv1.WorkflowStatus {
	e.t.Helper()
	var st *vmflowv1.WorkflowStatus
	waitFor(e.t, timeout, fmt.Sprintf("%s at stage %s", workflowID, stage), func() (bool, string) {
		var err error
		st, err = e.status(workflowID)
		if err != nil {
			return false, err.Error()
		}
		return st.GetStage() == stage && (more == nil || more(st)), fmt.Sprintf("%+v", st)
	})
	return st
}

// record reads an instance record; nil when there is none.
func (e *env) record(id string) *vmflowv1.InstanceRecord {
	e.t.Helper()
	rec, err := e.st.Get(id)
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		e.t.Fatalf("read record %s: %v", id, err)
	}
	return rec
}

func identityOf(rec *vmflowv1.InstanceRecord) proc.Identity {
	return store.IdentityOf(rec.GetProcess())
}

// assertNoProcess checks that nothing is left of QEMU pid: no process and
// no zombie (no /proc entry at all), whatever its identity was.
func assertNoProcess(t *testing.T, id proc.Identity) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("no trace of QEMU %v", id), func() (bool, string) {
		st := proc.Inspect(id)
		if st.Alive {
			return false, "alive: " + string(st.State)
		}
		// The pid may have been reused by a stranger since; only our QEMU
		// (same start time) as a zombie counts.
		s, err := proc.ReadStat(id.PID)
		if err == nil && s.StartTime == id.StartTime {
			return false, "still in /proc in state " + string(rune(s.State))
		}
		return true, ""
	})
}

// simDevices lists the vGPU devices the simulator holds: mdev devices and
// vendor VFs with a type set.
func (e *env) simDevices() []string {
	e.t.Helper()
	var devs []string
	entries, err := os.ReadDir(e.sim.Path("bus", "mdev", "devices"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		e.t.Fatalf("list mdev devices: %v", err)
	}
	for _, d := range entries {
		devs = append(devs, "mdev "+d.Name())
	}
	vfs, err := filepath.Glob(e.sim.Path("bus", "pci", "devices", "*", "nvidia", "current_vgpu_type"))
	if err != nil {
		e.t.Fatalf("glob vendor VFs: %v", err)
	}
	for _, f := range vfs {
		b, err := os.ReadFile(f)
		if err != nil {
			e.t.Fatalf("read %s: %v", f, err)
		}
		if v := strings.TrimSpace(string(b)); v != "0" {
			devs = append(devs, "vf "+filepath.Base(filepath.Dir(filepath.Dir(f)))+" type "+v)
		}
	}
	return devs
}

// console is QEMU's log (the serial console) of one instance, held open so
// it can still be read after the delete removed the instance's directory.
type console struct{ f *os.File }

// openConsole waits until QEMU's log of id exists and opens it.
func (e *env) openConsole(id string) *console {
	e.t.Helper()
	p, err := e.st.Paths(id)
	if err != nil {
		e.t.Fatalf("paths: %v", err)
	}
	var f *os.File
	waitFor(e.t, 10*time.Second, "QEMU log of "+id, func() (bool, string) {
		f, err = os.Open(p.Log)
		return err == nil, fmt.Sprint(err)
	})
	e.t.Cleanup(func() { f.Close() })
	return &console{f: f}
}

// has reports whether the console printed line so far, and its last line.
func (c *console) has(line string) (bool, string) {
	var last string
	sc := bufio.NewScanner(io.NewSectionReader(c.f, 0, 1<<30))
	for sc.Scan() {
		if strings.Contains(sc.Text(), line) {
			return true, sc.Text()
		}
		if strings.TrimSpace(sc.Text()) != "" {
			last = sc.Text()
		}
	}
	return false, last
}

// wait waits until the console printed line.
func (c *console) wait(t *testing.T, line string, timeout time.Duration) {
	t.Helper()
	waitFor(t, timeout, fmt.Sprintf("%q on the serial console", line), func() (bool, string) {
		ok, last := c.has(line)
		return ok, "last line: " + last
	})
}

// agentStopSteps reads the stop ladder's steps for instance id from the
// agent's log ("stop step" lines), in order.
func (e *env) agentStopSteps(id string) []string {
	e.t.Helper()
	b, err := os.ReadFile(e.agent.Log)
	if err != nil {
		e.t.Fatalf("agent log: %v", err)
	}
	var steps []string
	for _, line := range strings.Split(string(b), "\n") {
		var l struct {
			Msg        string `json:"msg"`
			InstanceID string `json:"instance_id"`
			Step       string `json:"step"`
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "stop step" && l.InstanceID == id {
			steps = append(steps, l.Step)
		}
	}
	return steps
}

// activityResults returns the decoded results of the completed activities
// of type activityType in a workflow's history, in order.
func activityResults[T any](t *testing.T, c client.Client, workflowID, activityType string) []*T {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	it := c.GetWorkflowHistory(ctx, workflowID, "", false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	types := map[int64]string{}
	var out []*T
	for it.HasNext() {
		ev, err := it.Next()
		if err != nil {
			t.Fatalf("history of %s: %v", workflowID, err)
		}
		if a := ev.GetActivityTaskScheduledEventAttributes(); a != nil {
			types[ev.GetEventId()] = a.GetActivityType().GetName()
		}
		if a := ev.GetActivityTaskCompletedEventAttributes(); a != nil && types[a.GetScheduledEventId()] == activityType {
			v := new(T)
			if err := platform.DataConverter().FromPayloads(a.GetResult(), v); err != nil {
				t.Fatalf("decode %s result in %s: %v", activityType, workflowID, err)
			}
			out = append(out, v)
		}
	}
	return out
}

// cli runs the temporal CLI against the test's server.
func (e *env) cli(args ...string) string {
	e.t.Helper()
	out, err := e.srv.CLI(e.ctx(30*time.Second), args...)
	if err != nil {
		e.t.Fatalf("%v", err)
	}
	return string(out)
}

// processesOf lists the processes running as a uid of this test agent's
// --qemu-uid-range: every QEMU it starts (and the rlimit wrapper in the
// instant before QEMU) has one, nothing else does. QEMU's argv names no
// instance path any more; it names the instance in -name guest=<id>.
func (e *env) processesOf() []string {
	e.t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		e.t.Fatalf("list /proc: %v", err)
	}
	var found []string
	for _, d := range entries {
		if _, err := strconv.Atoi(d.Name()); err != nil {
			continue
		}
		pid, _ := strconv.Atoi(d.Name())
		uids, err := proc.ReadUIDs(pid)
		if err != nil || !e.uids.Contains(uids[0]) {
			continue
		}
		b, _ := os.ReadFile("/proc/" + d.Name() + "/cmdline")
		state := "?"
		if s, err := proc.ReadStat(pid); err == nil {
			state = string(rune(s.State))
		}
		// A zombie's cmdline is empty: the uid still says whose it is.
		found = append(found, fmt.Sprintf("pid %s (%s) uid %d: %s", d.Name(), state, uids[0], strings.ReplaceAll(string(b), "\x00", " ")))
	}
	return found
}

// assertNothingLeft checks that no process of this test's state dir is
// alive or a zombie, no record remains and the simulator holds no device.
func (e *env) assertNothingLeft() {
	e.t.Helper()
	waitFor(e.t, 10*time.Second, "no QEMU of this test's state dir (alive or zombie)", func() (bool, string) {
		ps := e.processesOf()
		return len(ps) == 0, strings.Join(ps, "; ")
	})
	recs, err := e.st.List()
	if err != nil {
		e.t.Errorf("list records: %v", err)
	}
	for _, r := range recs {
		e.t.Errorf("record left: %s in state %s, claim %v", r.GetId(), r.GetState(), store.VGPU(r))
	}
	if devs := e.simDevices(); len(devs) > 0 {
		e.t.Errorf("vGPU devices left in the simulator: %v", devs)
	}
}

// writeScript writes an executable shell script into dir.
func writeScript(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatalf("write %s: %v", p, err)
	}
	// A QEMU stand-in is exec'd as the VM's own uid: t.TempDir's folders
	// (0700, root's) must let it through.
	for _, d := range []string{dir, filepath.Dir(dir)} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatalf("chmod %s: %v", d, err)
		}
	}
	return p
}

// checkWholeGPUs: a function of the simulator's PCI GPUs is on vfio-pci
// exactly when a held whole-GPU lease of recs names it.
func (e *env) checkWholeGPUs(when string, recs []*vmflowv1.InstanceRecord) []string {
	named := map[string]string{}
	for _, r := range recs {
		for _, l := range store.HeldPassthrough(r) {
			for _, a := range store.PassthroughDevices(l) {
				named[a] = r.GetId()
			}
		}
	}
	var v []string
	for i := range 2 {
		g := vgpusim.PCIGPUAt(i)
		for _, a := range []string{g.GPU, g.Audio} {
			if a == "" {
				continue
			}
			drv, _ := e.sim.Server.PCIDriver(a)
			if _, ok := named[a]; ok != (drv == "vfio-pci") {
				v = append(v, fmt.Sprintf("%s: PCI function %s is on %q, held by %q", when, a, drv, named[a]))
			}
		}
	}
	return v
}
