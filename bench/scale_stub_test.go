package bench

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/testsupport/devserver"
	"vmflow/testsupport/stacktest"
	"vmflow/workflows"
)

// make bench-scale: the control plane alone at fleet size. Thousands of
// VMs whose QEMU is the stub VMM (hostagent/vmm/vmmtest/stubvmm: one
// thread, no guest), launched by real agents through the real jail, on the
// self-hosted Temporal server on PostgreSQL; what is measured is what the
// server, its database, the worker and the agents spend per VM.

// The scale section's place in BENCHMARKS.md.
const (
	scaleBegin = "<!-- make bench-scale: begin -->"
	scaleEnd   = "<!-- make bench-scale: end -->"
)

var scaleSection = docBlock{scaleBegin, scaleEnd}

// scaleSize is one round: n VMs over hosts agents.
type scaleSize struct{ n, hosts int }

func (z scaleSize) String() string { return fmt.Sprintf("%d over %d", z.n, z.hosts) }

// scaleSizes are the rounds, from VMFLOW_SCALE_SIZES ("1000/10,5000/50":
// 100 VMs per agent at each size, so a host's load stays the same while
// the fleet grows). Agents are reused from one round to the next, so the
// agent counts must not shrink.
func scaleSizes(t *testing.T) []scaleSize {
	v := os.Getenv("VMFLOW_SCALE_SIZES")
	if v == "" {
		v = "1000/10,5000/50"
		if quick() {
			v = "20/2,40/4"
		}
	}
	var out []scaleSize
	for _, f := range strings.Split(v, ",") {
		n, h, ok := strings.Cut(strings.TrimSpace(f), "/")
		z := scaleSize{}
		var err1, err2 error
		z.n, err1 = strconv.Atoi(n)
		z.hosts, err2 = strconv.Atoi(h)
		if !ok || err1 != nil || err2 != nil || z.n < 1 || z.hosts < 1 || z.hosts > 100 {
			t.Fatalf("VMFLOW_SCALE_SIZES %q: want VMS/AGENTS,... with 1 to 100 agents (a test process has 100 disjoint uid ranges)", v)
		}
		if len(out) > 0 && z.hosts < out[len(out)-1].hosts {
			t.Fatalf("VMFLOW_SCALE_SIZES %q: agent counts must not shrink (the agents are reused)", v)
		}
		out = append(out, z)
	}
	return out
}

// TestBenchScale is the `make bench-scale` driver. VMFLOW_SCALE_SIZES sets
// the rounds, VMFLOW_SCALE_IDLE the idle window (default 2m),
// VMFLOW_SCALE_INFLIGHT how many workflows the driver keeps in flight
// (default 1000); VMFLOW_BENCH_QUICK=1 shrinks everything.
func TestBenchScale(t *testing.T) {
	out := benchOutput(t, "make bench-scale")
	began := time.Now()
	load0 := LoadAvg()
	sizes := scaleSizes(t)
	idle := 2 * time.Minute
	if quick() {
		idle = 10 * time.Second
	}
	if v := os.Getenv("VMFLOW_SCALE_IDLE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("VMFLOW_SCALE_IDLE %q: want a positive duration", v)
		}
		idle = d
	}
	inflight := envInt(t, "VMFLOW_SCALE_INFLIGHT", 1000)

	stopReaper := stacktest.StartReaper(reapStubs)
	t.Cleanup(stopReaper)
	pgBegin := time.Now()
	pg := devserver.StartPostgres(t, devserver.PostgresOptions{Production: true, StartTimeout: 5 * time.Minute})
	pgReady := time.Since(pgBegin)
	f := &scaleFleet{t: t, s: newWorkerOn(t, pg, "scale"), stub: stacktest.BuildStubVMM(t), idle: idle, inflight: inflight}
	f.s.pg = pg

	var rounds []*scaleRound
	failed := ""
	for _, z := range sizes {
		var r *scaleRound
		if !t.Run(fmt.Sprintf("%d-over-%d", z.n, z.hosts), func(t *testing.T) { r = f.round(t, z) }) {
			failed = z.String()
			break
		}
		rounds = append(rounds, r)
	}
	block := stubScaleReport(f, rounds, scaleRun{began: began, load0: load0, pgReady: pgReady, failed: failed})
	doc, err := os.ReadFile(out)
	if err != nil && !os.IsNotExist(err) {
		t.Fatalf("read %s: %v", out, err)
	}
	if err := os.WriteFile(out, []byte(scaleSection.into(string(doc), block)), 0o644); err != nil {
		t.Fatalf("write %s: %v", out, err)
	}
	t.Logf("wrote the scale section of %s (%s)", out, time.Since(began).Round(time.Second))
}

// scaleFleet is the server, the worker and the agents of the run.
type scaleFleet struct {
	t        *testing.T
	s        *stack // the server, its client, the worker and the task queue; no agent of its own
	stub     string // the stub VMM, every agent's --qemu
	hosts    []*stack
	idle     time.Duration
	inflight int
}

// newHost prepares agent i: its own host id, state dir, uid range; the
// stub as its QEMU, no vGPU driver (no simulator), the capacity flags
// stack_test.go gives its agents (-machine none VMs of 16 MiB, far past
// what a host of real guests promises: 100 each here).
func (f *scaleFleet) newHost(i int) *stack {
	t, s := f.t, f.s
	h := &stack{t: t, srv: s.srv, pg: s.pg, c: s.c, queue: s.queue, worker: s.worker,
		agentBin: s.agentBin, connEnv: s.connEnv, out: s.out, startRetries: s.startRetries,
		hostID: fmt.Sprintf("scale-h%d", i)}
	var err error
	if h.stateDir, err = os.MkdirTemp("/tmp", "vfs"); err != nil {
		t.Fatalf("state dir: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(h.stateDir) })
	img := filepath.Join(h.stateDir, "img")
	if err := os.Mkdir(img, 0o755); err != nil {
		t.Fatalf("image root: %v", err)
	}
	if h.st, err = store.New(h.stateDir); err != nil {
		t.Fatalf("store: %v", err)
	}
	uids := stacktest.QEMUUIDRange()
	// Cleanups run last-in first-out: these run after the agent stopped.
	t.Cleanup(func() { stacktest.KillUIDRange(t, uids) })
	t.Cleanup(func() { stacktest.KillLeftoverVMs(t, h.st, nil) })
	args := append([]string{"run",
		"--host-id", h.hostID,
		"--state-dir", h.stateDir,
		"--image-root", img,
		"--qemu", f.stub,
		"--vgpu-driver", "none",
		"--workflow-task-queue", h.queue,
		"--reconcile-every", "1h",
		"--cpu-overcommit", "256", "--memory-overcommit", "64",
		"--address", h.srv.Address(),
		"--namespace", h.srv.Namespace(),
		"--qemu-uid-range", uids.String(),
	}, stacktest.HoldersIgnoreInit()...)
	h.agent = &stacktest.Daemon{Name: "vmflow-hostagent", Bin: h.agentBin, Args: args, Env: h.connEnv,
		Log: filepath.Join(h.out, "hostagent-"+h.hostID+".log"), LineWatch: true}
	t.Cleanup(func() {
		if err := h.agent.Stop(); err != nil {
			t.Errorf("stop agent %s: %v", h.hostID, err)
		}
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = h.c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID(h.hostID)).Delete(ctx) // best effort
	})
	return h
}

// agentDeadline bounds an agent's start to serving, and its re-attach.
const agentDeadline = 5 * time.Minute

// grow starts agents until there are n, all at once, and waits until each
// serves.
func (f *scaleFleet) grow(t *testing.T, n int) {
	var started []*stack
	var serving []<-chan stacktest.Line
	for len(f.hosts) < n {
		h := f.newHost(len(f.hosts))
		serving = append(serving, h.agent.Watch(isServing))
		h.agent.Start(f.t)
		f.hosts = append(f.hosts, h)
		started = append(started, h)
	}
	deadline := time.After(agentDeadline)
	for i, ch := range serving {
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("agent %s not serving %s after its start; log %s", started[i].hostID, agentDeadline, started[i].agent.Log)
		}
	}
}

func isServing(l string) bool { return strings.Contains(l, `"serving host activities"`) }

func isSupervising(l string) bool { return strings.Contains(l, `"msg":"supervising"`) }

// scalePhase is what one phase cost: its wall time, each process's CPU
// and the machine's.
type scalePhase struct {
	wall    time.Duration
	cpu     cpuSplit // seconds; qemu: the stubs'
	driver  float64  // this process (the platform API's client), seconds
	machine machineCPU
}

// scaleRound is one size's measurements.
type scaleRound struct {
	size                 scaleSize
	spawn, idle, restart scalePhase
	del                  scalePhase
	reattach             []time.Duration // each agent's ReattachReport
	killToServing        time.Duration
	stub                 stubStats
	agentRSS, agentHWM   []int64 // KiB, each agent's, with the VMs running (HWM: after the delete)
	serverRSS, pgPss     int64   // KiB
	mem0, mem1           memInfo // before the spawn, with every VM running
	tasks0, tasks1       int     // the machine's tasks (threads) then
	agentThreads         int     // the agents' threads, summed, with every VM running
}

// round runs one size: spawn all, idle, kill -9 and restart every agent,
// delete all.
func (f *scaleFleet) round(t *testing.T, z scaleSize) *scaleRound {
	f.grow(t, z.hosts)
	hosts := f.hosts[:z.hosts]
	r := &scaleRound{size: z}
	ids := make([]string, z.n)
	for i := range ids {
		ids[i] = fmt.Sprintf("z%d-%d", z.n, i)
	}
	host := func(i int) *stack { return hosts[i%len(hosts)] }
	ctx := ctxFor(t, 3*time.Hour)
	r.mem0, r.tasks0 = readMemInfo(), tasksNow()

	var err error
	r.spawn, err = f.measure(hosts, func() error {
		return allBounded(z.n, f.inflight, func(i int) error {
			h := host(i)
			_, err := h.run(ctx, workflows.SpawnWorkflowID(ids[i]), workflows.SpawnWorkflow, h.spawnReq(ids[i], false))
			return err
		})
	})
	if err != nil {
		t.Fatalf("spawn %s: %v", z, err)
	}
	r.mem1, r.tasks1 = readMemInfo(), tasksNow()
	expect := map[string]int{}
	var stubPids []int
	for _, h := range hosts {
		recs, err := h.st.List()
		if err != nil {
			t.Fatalf("list records of %s: %v", h.hostID, err)
		}
		expect[h.hostID] = len(recs)
		for _, rec := range recs {
			if p := rec.GetProcess(); p != nil {
				stubPids = append(stubPids, int(p.GetPid()))
			}
		}
		r.agentRSS = append(r.agentRSS, vmRSS(h.agent.Pid()))
		r.agentThreads += threadsOf(h.agent.Pid())
	}
	if len(stubPids) != z.n {
		t.Fatalf("%d stub VMs recorded running, want %d", len(stubPids), z.n)
	}
	r.stub = readStubStats(stubPids)
	r.spawn.cpu.qemu = r.stub.cpuSeconds
	r.serverRSS = vmRSS(f.s.pg.ServerPid())
	r.pgPss = treePss(f.s.pg.PostgresPid())

	// Idle: every VM running, nothing asked. The window measures; nothing
	// waits on it.
	r.idle, err = f.measure(hosts, func() error {
		select {
		case <-time.After(f.idle):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	if err != nil {
		t.Fatalf("idle: %v", err)
	}

	f.restartAll(t, hosts, expect, r)

	r.del, err = f.measure(hosts, func() error {
		return allBounded(z.n, f.inflight, func(i int) error {
			h := host(i)
			_, err := h.run(ctx, workflows.DeleteWorkflowID(ids[i]), workflows.DeleteWorkflow, h.deleteReq(ids[i]))
			return err
		})
	})
	if err != nil {
		t.Fatalf("delete %s: %v", z, err)
	}
	for _, h := range hosts {
		hwm, err := VmHWM(h.agent.Pid())
		if err != nil {
			t.Fatal(err)
		}
		r.agentHWM = append(r.agentHWM, hwm)
		left, err := h.st.List()
		if err != nil || len(left) > 0 {
			t.Fatalf("host %s after deleting: %d records left (%v)", h.hostID, len(left), err)
		}
	}
	return r
}

// measure runs fn as one phase of hosts' fleet and says what it cost.
func (f *scaleFleet) measure(hosts []*stack, fn func() error) (scalePhase, error) {
	c0, d0, m0 := f.cpuNow(hosts), cpuTicks(os.Getpid(), false), readMachineCPU()
	start := time.Now()
	err := fn()
	p := scalePhase{wall: time.Since(start)}
	p.cpu = f.cpuNow(hosts).since(c0)
	p.driver = float64(cpuTicks(os.Getpid(), false)-d0) / ticks
	p.machine = readMachineCPU().since(m0)
	return p, err
}

// cpuNow is the CPU ticks so far of the server, PostgreSQL, the worker and
// hosts' agents (summed).
func (f *scaleFleet) cpuNow(hosts []*stack) cpuSplit {
	server, db := f.s.serverTicks()
	c := cpuSplit{server: float64(server), db: float64(db), worker: float64(cpuTicks(f.s.worker.Pid(), false))}
	for _, h := range hosts {
		c.agent += float64(cpuTicks(h.agent.Pid(), false))
	}
	return c
}

// restartAll kills every agent with SIGKILL, starts them all again, and
// waits until each has re-attached its VMs (expect: how many per host) and
// serves. Its CPU: the server's, PostgreSQL's and the worker's over the
// window, the new agents' whole lives (the old ones were idle).
func (f *scaleFleet) restartAll(t *testing.T, hosts []*stack, expect map[string]int, r *scaleRound) {
	c0, d0, m0 := f.cpuNow(nil), cpuTicks(os.Getpid(), false), readMachineCPU()
	start := time.Now()
	for _, h := range hosts {
		// Its VMs are re-parented to this process (a child subreaper),
		// whose reapStubs reaps them once they exit.
		if err := h.agent.Signal(syscall.SIGKILL, 10*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	lines := make([]<-chan stacktest.Line, len(hosts))
	serving := make([]<-chan stacktest.Line, len(hosts))
	for i, h := range hosts {
		lines[i] = h.agent.Watch(isSupervising)
		serving[i] = h.agent.Watch(isServing)
		h.agent.Start(t)
	}
	deadline := time.After(agentDeadline)
	for i, h := range hosts {
		var got stacktest.Line
		select {
		case got = <-lines[i]:
		case <-deadline:
			t.Fatalf("agent %s: no supervising line %s after the restart; log %s", h.hostID, agentDeadline, h.agent.Log)
		}
		var sl supervising
		if err := json.Unmarshal([]byte(got.Text), &sl); err != nil {
			t.Fatalf("decode %q: %v", got.Text, err)
		}
		if sl.Attached != expect[h.hostID] {
			t.Fatalf("agent %s re-attached %d of %d: %s", h.hostID, sl.Attached, expect[h.hostID], got.Text)
		}
		took, err := sl.took()
		if err != nil {
			t.Fatal(err)
		}
		r.reattach = append(r.reattach, took)
	}
	for i, h := range hosts {
		select {
		case <-serving[i]:
		case <-deadline:
			t.Fatalf("agent %s not serving %s after the restart; log %s", h.hostID, agentDeadline, h.agent.Log)
		}
	}
	r.killToServing = time.Since(start)
	p := scalePhase{wall: r.killToServing}
	p.cpu = f.cpuNow(nil).since(c0)
	for _, h := range hosts {
		p.cpu.agent += float64(cpuTicks(h.agent.Pid(), false)) / ticks
	}
	p.driver = float64(cpuTicks(os.Getpid(), false)-d0) / ticks
	p.machine = readMachineCPU().since(m0)
	r.restart = p
}

// allBounded runs fn(i) for i in [0,n) with at most limit at once and
// returns the first error.
func allBounded(n, limit int, fn func(i int) error) error {
	sem := make(chan struct{}, limit)
	_, err := all(n, func(i int) error {
		sem <- struct{}{}
		defer func() { <-sem }()
		return fn(i)
	})
	return err
}

// stubStats is what the running stub VMMs were, averaged.
type stubStats struct {
	n                       int
	threads                 float64 // per stub
	rssKiB, anonKiB, pssKiB float64 // per stub
	cpuSeconds              float64 // all of them, so far
}

func readStubStats(pids []int) stubStats {
	s := stubStats{n: len(pids)}
	var ticksSum int64
	for _, pid := range pids {
		path := fmt.Sprintf("/proc/%d/status", pid)
		s.threads += float64(threadsOf(pid))
		s.rssKiB += float64(statusKiB(path, "VmRSS:"))
		s.anonKiB += float64(statusKiB(path, "RssAnon:"))
		s.pssKiB += float64(pssKiB(pid))
		ticksSum += cpuTicks(pid, false)
	}
	if s.n > 0 {
		n := float64(s.n)
		s.threads, s.rssKiB, s.anonKiB, s.pssKiB = s.threads/n, s.rssKiB/n, s.anonKiB/n, s.pssKiB/n
	}
	s.cpuSeconds = float64(ticksSum) / ticks
	return s
}

// threadsOf is how many threads pid has (0 when it is gone).
func threadsOf(pid int) int {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0
	}
	return len(tasks)
}

// pssKiB is pid's proportional set size (smaps_rollup): its private pages
// and its share of those it shares.
func pssKiB(pid int) int64 {
	return statusKiB(fmt.Sprintf("/proc/%d/smaps_rollup", pid), "Pss:")
}

// treePss is the Pss of pid and its live children (PostgreSQL's
// postmaster and backends, whose shared buffers Pss shares out once).
func treePss(pid int) int64 {
	sum := pssKiB(pid)
	for _, c := range childrenOf(pid) {
		sum += pssKiB(c)
	}
	return sum
}

// memInfo is what /proc/meminfo says of the machine's memory, in KiB.
type memInfo struct{ available, slab, pageTables, kernelStack, percpu float64 }

func readMemInfo() memInfo {
	g := func(k string) float64 { return float64(statusKiB("/proc/meminfo", k+":")) }
	return memInfo{g("MemAvailable"), g("Slab"), g("PageTables"), g("KernelStack"), g("Percpu")}
}

// kernel is the kernel's own memory among them.
func (m memInfo) kernel() float64 { return m.slab + m.pageTables + m.kernelStack + m.percpu }

// tasksNow is how many tasks (threads) the machine has: /proc/loadavg's
// fourth field, RUNNING/TOTAL. Each takes a pid (pid_max).
func tasksNow() int {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 4 {
		return 0
	}
	_, total, _ := strings.Cut(f[3], "/")
	n, _ := strconv.Atoi(total)
	return n
}

// pidMax is kernel.pid_max.
func pidMax() int {
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// machineCPU is the machine's CPU time from /proc/stat's cpu line, in
// seconds: busy (user, nice, system, irq, softirq, steal), iowait, and all.
type machineCPU struct{ busy, iowait, total float64 }

func readMachineCPU() machineCPU {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return machineCPU{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return machineCPU{}
	}
	v := make([]float64, 8)
	for i := range v {
		n, _ := strconv.ParseFloat(f[i+1], 64)
		v[i] = n / ticks
	}
	// user nice system idle iowait irq softirq steal
	m := machineCPU{busy: v[0] + v[1] + v[2] + v[5] + v[6] + v[7], iowait: v[4]}
	m.total = m.busy + m.iowait + v[3]
	return m
}

func (m machineCPU) since(m0 machineCPU) machineCPU {
	return machineCPU{busy: m.busy - m0.busy, iowait: m.iowait - m0.iowait, total: m.total - m0.total}
}

// reapStubs reaps this process's zombie stub VMMs until ctx ends: a killed
// agent's VMs are re-parented to this process (a child subreaper) and
// exit when deleted. It peeks at the next waitable child (waitid with
// WNOWAIT, woken by SIGCHLD) and reaps it only when it is a stub, leaving
// the daemons' exits to their exec.Cmd; no scan of /proc or of thousands
// of pids per round.
func reapStubs(ctx context.Context) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGCHLD)
	defer signal.Stop(sig)
	tick := time.NewTicker(time.Second) // SIGCHLDs coalesce; a daemon's zombie may sit in front for a moment
	defer tick.Stop()
	comm := stacktest.StubVMMComm
	for {
		for {
			var si unix.Siginfo
			if err := unix.Waitid(unix.P_ALL, 0, &si, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil); err != nil {
				break // ECHILD: no children at all
			}
			pid := siginfoPid(&si)
			if pid <= 0 {
				break // none waitable
			}
			st, err := proc.ReadStat(pid)
			if err != nil || st.State != 'Z' || st.Comm != comm {
				break // not a stub's: its owner reaps it
			}
			var ws unix.WaitStatus
			_, _ = unix.Wait4(pid, &ws, unix.WNOHANG, nil)
		}
		select {
		case <-ctx.Done():
			return
		case <-sig:
		case <-tick.C:
		}
	}
}

// siginfoPid is a siginfo's si_pid: on linux/amd64 it follows si_signo,
// si_errno, si_code and 4 bytes of padding. WNOHANG with nothing waitable
// leaves it zero (Linux clears the siginfo).
func siginfoPid(si *unix.Siginfo) int {
	return int(*(*int32)(unsafe.Add(unsafe.Pointer(si), 16)))
}

// scaleRun is what the report says of the run as a whole.
type scaleRun struct {
	began   time.Time
	load0   string
	pgReady time.Duration
	failed  string // the size that failed, "" when none
}

// perVM is CPU seconds as milliseconds per VM.
func perVM(sec float64, n int) string { return fmt.Sprintf("%.1f", 1000*sec/float64(n)) }

// cores is CPU seconds over a wall time: how many cores it kept busy.
func cores(sec float64, wall time.Duration) float64 { return sec / wall.Seconds() }

func medianDur(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return Summarize(ds).Median
}

func maxDur(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return slices.Max(ds)
}

func medianKiB(v []int64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return float64(s[len(s)/2])
}

func maxKiB(v []int64) float64 {
	if len(v) == 0 {
		return 0
	}
	return float64(slices.Max(v))
}

// stubScaleReport renders the section.
func stubScaleReport(f *scaleFleet, rounds []*scaleRound, run scaleRun) string {
	var b strings.Builder
	b.WriteString(scaleBegin + "\n")
	b.WriteString("## Control plane at fleet size (stub VMMs)\n\n")
	fmt.Fprintf(&b, "Generated by `make bench-scale` (driver: `bench/scale_stub_test.go`, `TestBenchScale`; `make bench` keeps this section as it is). Run on %s, wall time %s, load average %s → %s, on the machine described at the top (%d cores, shared with other engineers' runs: absolute figures drift with their load; the machine columns say how much of it was theirs).\n\n",
		run.began.UTC().Format("2006-01-02 15:04 MST"), time.Since(run.began).Round(time.Second), run.load0, LoadAvg(), runtime.NumCPU())
	fmt.Fprintf(&b, "The control plane alone: the Temporal server on PostgreSQL as in the fleet section (production defaults, 4 history shards; start %s), one `vmflow-worker`, and host agents on this one machine, each with its own state dir and uid range, `--vgpu-driver none`, the capacity flags of the other sections (`--cpu-overcommit 256 --memory-overcommit 64`), and as `--qemu` the stub VMM (`hostagent/vmm/vmmtest/stubvmm`): launched like QEMU through the jail (namespaces, its own root, uid, cgroup, seccomp allowlist), it runs one thread, holds no guest, answers QMP, and powers off at `system_powerdown` as a guest obeying the button would. Each size spreads its VMs round-robin over its agents (`-machine none`, 16 MiB asked); the driver keeps at most %d workflows in flight. Each round: spawn all; %s idle with every VM running; `kill -9` every agent and start them all again (this process is the child subreaper the VMs go to); delete all.\n\n",
		run.pgReady.Round(time.Second), f.inflight, f.idle)

	if len(rounds) > 0 {
		tab := Table{Header: []string{"VMs", "agents", "spawn-all s", "spawn wf/s", "kill -9 every agent → all re-attached and serving s", "re-attach (ReattachReport) ms, median / max agent", "delete-all s", "delete wf/s"}}
		for _, r := range rounds {
			n := float64(r.size.n)
			tab.Add(fmt.Sprint(r.size.n), fmt.Sprint(r.size.hosts),
				fmt.Sprintf("%.1f", r.spawn.wall.Seconds()), fmt.Sprintf("%.1f", n/r.spawn.wall.Seconds()),
				fmt.Sprintf("%.1f", r.killToServing.Seconds()),
				MS(medianDur(r.reattach))+" / "+MS(maxDur(r.reattach)),
				fmt.Sprintf("%.1f", r.del.wall.Seconds()), fmt.Sprintf("%.1f", n/r.del.wall.Seconds()))
		}
		b.WriteString(tab.Markdown() + "\n")

		b.WriteString("CPU per VM, in milliseconds (CPU seconds of the phase ÷ VMs; `/proc/<pid>/stat`: the server's process; PostgreSQL's postmaster with every backend, live or exited; the worker; the agents summed; the stubs' own time while running; this driver, the platform API's client, beside them). Machine: every process's CPU from `/proc/stat` over the phase ÷ (wall × cores), others' runs included; iowait likewise.\n\n")
		cpu := Table{Header: []string{"VMs", "phase", "server", "PostgreSQL", "worker", "agents", "stubs", "driver", "machine busy", "iowait", "cores used: server / PostgreSQL / worker / agents"}}
		for _, r := range rounds {
			for _, ph := range []struct {
				name string
				p    scalePhase
			}{{"spawn", r.spawn}, {"kill -9 + restart", r.restart}, {"delete", r.del}} {
				c, w, n := ph.p.cpu, ph.p.wall, r.size.n
				cpu.Add(fmt.Sprint(n), ph.name, perVM(c.server, n), perVM(c.db, n), perVM(c.worker, n), perVM(c.agent, n), perVM(c.qemu, n), perVM(ph.p.driver, n),
					fmt.Sprintf("%.0f%%", 100*ph.p.machine.busy/max(ph.p.machine.total, 1e-9)), fmt.Sprintf("%.0f%%", 100*ph.p.machine.iowait/max(ph.p.machine.total, 1e-9)),
					fmt.Sprintf("%.2f / %.2f / %.2f / %.2f", cores(c.server, w), cores(c.db, w), cores(c.worker, w), cores(c.agent, w)))
			}
		}
		b.WriteString(cpu.Markdown() + "\n")

		fmt.Fprintf(&b, "Idle: %s with every VM running and nothing asked (CPU as %% of one core; per VM: CPU-milliseconds per minute).\n\n", f.idle)
		idle := Table{Header: []string{"VMs", "agents", "server %", "PostgreSQL %", "worker %", "agents % (all)", "% per agent", "agents' ms per VM per minute", "server ms per agent per minute", "machine busy"}}
		for _, r := range rounds {
			c, w := r.idle.cpu, r.idle.wall
			pct := func(s float64) string { return fmt.Sprintf("%.1f", 100*cores(s, w)) }
			idle.Add(fmt.Sprint(r.size.n), fmt.Sprint(r.size.hosts), pct(c.server), pct(c.db), pct(c.worker), pct(c.agent),
				fmt.Sprintf("%.2f", 100*cores(c.agent, w)/float64(r.size.hosts)),
				fmt.Sprintf("%.2f", 1000*c.agent/float64(r.size.n)/w.Minutes()),
				fmt.Sprintf("%.1f", 1000*c.server/float64(r.size.hosts)/w.Minutes()),
				fmt.Sprintf("%.0f%%", 100*r.idle.machine.busy/max(r.idle.machine.total, 1e-9)))
		}
		b.WriteString(idle.Markdown() + "\n")

		b.WriteString("Memory with every VM running: the machine's MemAvailable before the spawn and after it (its drop per VM counts the stub, its jail — namespaces, mounts, cgroup — and its share of the agents', server's and database's growth), of it the kernel's own (Slab + PageTables + KernelStack + Percpu), the stubs as `/proc` shows them, the agents' VmRSS, the server's VmRSS and PostgreSQL's Pss (postmaster and backends), and the machine's tasks (each thread takes a pid; `kernel.pid_max` is " + fmt.Sprint(pidMax()) + ").\n\n")
		mem := Table{Header: []string{"VMs", "agents", "MemAvailable GiB: before → running", "per VM KiB: all / kernel", "stub: threads, VmRSS / RssAnon / Pss KiB", "agent VmRSS MiB: median / max (VmHWM after delete: max)", "server VmRSS MiB", "PostgreSQL Pss MiB", "tasks: before → running (the agents' threads)"}}
		for _, r := range rounds {
			n := float64(r.size.n)
			mem.Add(fmt.Sprint(r.size.n), fmt.Sprint(r.size.hosts),
				fmt.Sprintf("%.1f → %.1f", r.mem0.available/1024/1024, r.mem1.available/1024/1024),
				fmt.Sprintf("%.0f / %.0f", (r.mem0.available-r.mem1.available)/n, (r.mem1.kernel()-r.mem0.kernel())/n),
				fmt.Sprintf("%.2f, %.0f / %.0f / %.0f", r.stub.threads, r.stub.rssKiB, r.stub.anonKiB, r.stub.pssKiB),
				fmt.Sprintf("%.1f / %.1f (%.1f)", medianKiB(r.agentRSS)/1024, maxKiB(r.agentRSS)/1024, maxKiB(r.agentHWM)/1024),
				fmt.Sprintf("%.0f", float64(r.serverRSS)/1024), fmt.Sprintf("%.0f", float64(r.pgPss)/1024),
				fmt.Sprintf("%d → %d (%d)", r.tasks0, r.tasks1, r.agentThreads))
		}
		b.WriteString(mem.Markdown() + "\n")
		b.WriteString(scaleReading(rounds))
	}
	if run.failed != "" {
		fmt.Fprintf(&b, "\n**The round of %s failed in this run (the rounds after it did not run); see the test log.**\n", run.failed)
	}
	if n := f.s.startRetries.Load(); n > 0 {
		fmt.Fprintf(&b, "\n%d workflow starts hit the SDK's 10 s RPC deadline on the loaded server and were sent again (same workflow id: nothing started twice).\n", n)
	}
	b.WriteString(scaleEnd)
	return b.String()
}

// scaleReading says, from the numbers, what saturated first and how the
// per-VM figures moved from the smallest size to the largest.
func scaleReading(rounds []*scaleRound) string {
	var b strings.Builder
	last := rounds[len(rounds)-1]
	p := last.spawn
	busy := 100 * p.machine.busy / max(p.machine.total, 1e-9)
	iowait := 100 * p.machine.iowait / max(p.machine.total, 1e-9)
	c := p.cpu
	ours := c.server + c.db + c.worker + c.agent + c.qemu + p.driver
	type user struct {
		name string
		sec  float64
	}
	users := []user{{"the Temporal server", c.server}, {"PostgreSQL", c.db}, {"the worker", c.worker}, {"the agents", c.agent}, {"the driver", p.driver}}
	slices.SortFunc(users, func(a, b user) int { return cmp.Compare(b.sec, a.sec) })
	top := users[0]
	fmt.Fprintf(&b, "Reading: spawning %d VMs over %d agents kept the machine's %d cores %.0f%% busy (iowait %.0f%%), %.0f%% of that busy time ours; %s used the most, %.2f cores (%.0f%% of ours). ",
		last.size.n, last.size.hosts, runtime.NumCPU(), busy, iowait, 100*ours/max(p.machine.busy, 1e-9), top.name, cores(top.sec, p.wall), 100*top.sec/max(ours, 1e-9))
	switch {
	case busy >= 85:
		fmt.Fprintf(&b, "The first thing to saturate is the machine's CPU, most of it taken by %s: the control plane's throughput here is what %d cores give it.", top.name, runtime.NumCPU())
	case iowait >= 20:
		b.WriteString("The CPU was not saturated and iowait was high: the first thing to saturate is the disk (PostgreSQL's fsyncs on commit).")
	default:
		fmt.Fprintf(&b, "Neither the CPU nor the disk was saturated: the throughput was bounded by round trips (latency), not load; %s did the most work.", top.name)
	}
	b.WriteString("\n\n")
	if len(rounds) > 1 {
		first := rounds[0]
		perHost := func(r *scaleRound) float64 { return float64(r.size.n) / float64(r.size.hosts) }
		a, z := first.spawn.cpu.agent/float64(first.size.n), last.spawn.cpu.agent/float64(last.size.n)
		if perHost(first) == perHost(last) && a > 0 && z/a > 1.2 {
			// The agents' background (their periodic looks at their own
			// records) runs all through the phase, and a larger size's
			// phase is longer: take it off, at the idle rate with every
			// VM running (an upper bound: the VMs come one by one).
			net := func(r *scaleRound) float64 {
				bg := r.idle.cpu.agent / max(r.idle.wall.Seconds(), 1e-9) * r.spawn.wall.Seconds()
				return max(r.spawn.cpu.agent-bg, 0) / float64(r.size.n)
			}
			na, nz := net(first), net(last)
			fmt.Fprintf(&b, "Each agent held %.0f VMs at both sizes, yet its spawn CPU per VM grew %.2f× from %d to %d VMs on the machine. Less the agents' idle CPU over the phase (%.1f s and %.1f s long), %.1f and %.1f ms per VM: %.2f×. ",
				perHost(last), z/a, first.size.n, last.size.n, first.spawn.wall.Seconds(), last.spawn.wall.Seconds(), 1000*na, 1000*nz, nz/max(na, 1e-9))
			if na > 0 && nz/na <= 1.2 {
				b.WriteString("The growth is the longer phase's background, not what a launch costs.\n\n")
			} else {
				b.WriteString("What a launch costs an agent grows with the machine's processes, not its own VMs.\n\n")
			}
		}
		fmt.Fprintf(&b, "From %d to %d VMs (per VM, the largest size ÷ the smallest):\n\n", first.size.n, last.size.n)
		tab := Table{Header: []string{"figure", fmt.Sprint(first.size.n), fmt.Sprint(last.size.n), "ratio"}}
		row := func(name string, a, z float64, format string) {
			ratio := "n/a"
			if a > 0 {
				ratio = fmt.Sprintf("%.2f×", z/a)
			}
			tab.Add(name, fmt.Sprintf(format, a), fmt.Sprintf(format, z), ratio)
		}
		for _, ph := range []struct {
			name string
			get  func(r *scaleRound) scalePhase
		}{{"spawn", func(r *scaleRound) scalePhase { return r.spawn }}, {"kill -9 + restart", func(r *scaleRound) scalePhase { return r.restart }}, {"delete", func(r *scaleRound) scalePhase { return r.del }}} {
			a, z := ph.get(first), ph.get(last)
			nf, nl := float64(first.size.n), float64(last.size.n)
			row(ph.name+": server CPU ms per VM", 1000*a.cpu.server/nf, 1000*z.cpu.server/nl, "%.1f")
			row(ph.name+": PostgreSQL CPU ms per VM", 1000*a.cpu.db/nf, 1000*z.cpu.db/nl, "%.1f")
			row(ph.name+": worker CPU ms per VM", 1000*a.cpu.worker/nf, 1000*z.cpu.worker/nl, "%.1f")
			row(ph.name+": agents' CPU ms per VM", 1000*a.cpu.agent/nf, 1000*z.cpu.agent/nl, "%.1f")
			if ph.name != "kill -9 + restart" {
				row(ph.name+": VMs per second", nf/a.wall.Seconds(), nl/z.wall.Seconds(), "%.1f")
			}
		}
		row("kill -9 every agent → all serving, s", first.killToServing.Seconds(), last.killToServing.Seconds(), "%.1f")
		row("idle: agents' CPU ms per VM per minute", 1000*first.idle.cpu.agent/float64(first.size.n)/first.idle.wall.Minutes(), 1000*last.idle.cpu.agent/float64(last.size.n)/last.idle.wall.Minutes(), "%.2f")
		row("idle: server CPU % of a core", 100*cores(first.idle.cpu.server, first.idle.wall), 100*cores(last.idle.cpu.server, last.idle.wall), "%.1f")
		row("re-attach ms, slowest agent", float64(maxDur(first.reattach))/1e6, float64(maxDur(last.reattach))/1e6, "%.1f")
		row("memory per VM KiB (MemAvailable)", (first.mem0.available-first.mem1.available)/float64(first.size.n), (last.mem0.available-last.mem1.available)/float64(last.size.n), "%.0f")
		row("agent VmRSS MiB, median", medianKiB(first.agentRSS)/1024, medianKiB(last.agentRSS)/1024, "%.1f")
		b.WriteString(tab.Markdown())
	}
	return b.String()
}
