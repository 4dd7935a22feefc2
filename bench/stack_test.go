package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.temporal.io/sdk/client"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vgpu/vgpusim"
	"vmflow/hostagent/vgpu/vgpusim/simtest"
	"vmflow/internal/devserver"
	"vmflow/workflows"
)

// daemon is a vmflow binary run as a subprocess (the ideas of e2e's
// harness, cut down): restartable, stderr copied to a log file line by
// line so the driver can time the moment a line appears.
type daemon struct {
	name string
	bin  string
	args []string
	env  []string
	log  string

	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{}
	started  time.Time
	watchers []*watcher
}

type watcher struct {
	match func(string) bool
	ch    chan seen
}

// seen is a log line and when the driver read it.
type seen struct {
	at   time.Time
	line string
}

// watch returns a channel that receives the first line of the daemon's
// output, from now on, for which match holds.
func (d *daemon) watch(match func(string) bool) <-chan seen {
	w := &watcher{match: match, ch: make(chan seen, 1)}
	d.mu.Lock()
	d.watchers = append(d.watchers, w)
	d.mu.Unlock()
	return w.ch
}

func (d *daemon) start(t *testing.T) {
	t.Helper()
	f, err := os.OpenFile(d.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatalf("%s log: %v", d.name, err)
	}
	fmt.Fprintf(f, "=== %s start at %s: %s %s\n", d.name, time.Now().Format(time.RFC3339Nano), d.bin, strings.Join(d.args, " "))
	pr, pw, err := os.Pipe()
	if err != nil {
		f.Close()
		t.Fatalf("%s pipe: %v", d.name, err)
	}
	cmd := exec.Command(d.bin, d.args...)
	cmd.Env = append(os.Environ(), d.env...)
	cmd.Stdout, cmd.Stderr = pw, pw
	// A crashed or timed-out driver takes its daemons with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	d.mu.Lock()
	defer d.mu.Unlock()
	started := time.Now()
	if err := cmd.Start(); err != nil {
		pw.Close()
		pr.Close()
		f.Close()
		t.Fatalf("start %s: %v", d.name, err)
	}
	pw.Close() // the child holds its copy
	done := make(chan struct{})
	go func() {
		d.copyLines(pr, f)
		_ = cmd.Wait() // only reaping matters; the log has the story
		pr.Close()
		f.Close()
		close(done)
	}()
	d.cmd, d.done, d.started = cmd, done, started
}

// copyLines copies the daemon's output to the log and hands matching lines
// to watchers. The pipe ends when the daemon (and any child holding its
// stderr) exits; QEMU's own output goes to its log file, not here.
func (d *daemon) copyLines(r io.Reader, f *os.File) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		at := time.Now()
		line := sc.Text()
		_, _ = f.WriteString(line + "\n")
		d.mu.Lock()
		kept := d.watchers[:0]
		for _, w := range d.watchers {
			if w.match(line) {
				w.ch <- seen{at: at, line: line}
				continue
			}
			kept = append(kept, w)
		}
		d.watchers = kept
		d.mu.Unlock()
	}
}

func (d *daemon) pid() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd == nil || d.cmd.Process == nil {
		return 0
	}
	return d.cmd.Process.Pid
}

// signal sends sig and waits up to wait until the daemon is reaped.
func (d *daemon) signal(sig syscall.Signal, wait time.Duration) error {
	d.mu.Lock()
	cmd, done := d.cmd, d.done
	d.mu.Unlock()
	if cmd == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	default:
	}
	if err := cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("%s %s: %w", d.name, sig, err)
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-done:
		return nil
	case <-timer.C:
		return fmt.Errorf("%s (pid %d) still running %s after %s", d.name, cmd.Process.Pid, wait, sig)
	}
}

// stop: SIGTERM, then SIGKILL after 20 s.
func (d *daemon) stop() error {
	if err := d.signal(syscall.SIGTERM, 20*time.Second); err != nil {
		return errors.Join(err, d.signal(syscall.SIGKILL, 10*time.Second))
	}
	return nil
}

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
	agent    *daemon
	worker   *daemon
}

// buildBinaries builds vmflow-worker and vmflow-hostagent from this
// checkout into a temporary folder (never stale bin/ files).
func buildBinaries(t *testing.T) (worker, agent string) {
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	ctx := ctxFor(t, 5*time.Minute)
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir+"/", "./worker", "./hostagent")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./worker ./hostagent: %v\n%s", err, out)
	}
	return filepath.Join(dir, "worker"), filepath.Join(dir, "hostagent")
}

// holdersIgnoreInit passes --holders-ignore-pid 1 only where PID 1's open
// files cannot be read even by root (this sandbox): the agent would
// otherwise count it as a possible VFIO holder and never release a vGPU.
func holdersIgnoreInit() []string {
	if _, err := os.Readlink("/proc/1/fd/0"); errors.Is(err, os.ErrPermission) {
		return []string{"--holders-ignore-pid", "1"}
	}
	return nil
}

// newStack starts the stack; extra are start-dev arguments (the scale
// table's dev-server variant).
func newStack(t *testing.T, extra ...string) *stack {
	workerBin, agentBin := buildBinaries(t)
	srv := devserver.Start(t, devserver.Options{ExtraArgs: extra})
	sim := simtest.Start(t, vgpusim.Options{MdevParents: 2, VendorVFs: 2})
	s := &stack{t: t, srv: srv, c: srv.Client(t), hostID: "bench-h", queue: "bench"}
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
	// stopped, and kills whatever QEMU a record still names.
	t.Cleanup(s.killLeftoverVMs)
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
	}, holdersIgnoreInit()...)
	s.agent = &daemon{name: "vmflow-hostagent", bin: agentBin, args: agentArgs, env: connEnv, log: filepath.Join(out, "hostagent.log")}
	s.worker = &daemon{name: "vmflow-worker", bin: workerBin, env: connEnv, log: filepath.Join(out, "worker.log"), args: []string{
		"--task-queue", s.queue, "--address", srv.Address(), "--namespace", srv.Namespace()}}
	t.Cleanup(func() {
		if err := s.agent.stop(); err != nil {
			t.Errorf("stop agent: %v", err)
		}
	})
	t.Cleanup(func() {
		if err := s.worker.stop(); err != nil {
			t.Errorf("stop worker: %v", err)
		}
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		// Best effort: the reconcile schedule the agent created.
		_ = s.c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID(s.hostID)).Delete(ctx)
	})
	serving := s.agent.watch(func(l string) bool { return strings.Contains(l, `"serving host activities"`) })
	s.agent.start(t)
	s.worker.start(t)
	select {
	case <-serving:
	case <-time.After(60 * time.Second):
		t.Fatalf("agent not serving after 60 s; log %s", s.agent.log)
	}
	return s
}

// killLeftoverVMs kills, by verified identity, every QEMU a record still
// names, and waits until it is gone. The agent has stopped by now, so such
// a QEMU is this process's (adopted) child: adopt it for reaping.
func (s *stack) killLeftoverVMs() {
	recs, err := s.st.List()
	if err != nil {
		s.t.Errorf("list records: %v", err)
		return
	}
	for _, r := range recs {
		p := r.GetProcess()
		if p == nil {
			continue
		}
		id := proc.Identity{PID: int(p.GetPid()), StartTime: p.GetStartTime(), BootID: p.GetBootId()}
		if !proc.Inspect(id).Alive {
			continue
		}
		s.t.Errorf("instance %s: QEMU %v still running at the end; killing it", r.GetId(), id)
		adopt(id.PID)
		if err := proc.Signal(id, syscall.SIGKILL); err != nil {
			s.t.Errorf("kill leftover QEMU %v: %v", id, err)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := pollUntil(ctx, 20*time.Millisecond, func() bool { return !proc.Inspect(id).Alive }); err != nil {
			s.t.Errorf("leftover QEMU %v: %v", id, err)
		}
		cancel()
	}
}
