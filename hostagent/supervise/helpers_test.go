package supervise

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The test binary re-executes itself as the host agent, so a test can
// kill -9 a real agent process with a VM running and start another one.
const (
	agentEnv      = "VMFLOW_SUPERVISE_AGENT"       // state dir; set: run as the agent
	agentIDEnv    = "VMFLOW_SUPERVISE_AGENT_ID"    // the instance to launch
	agentBlockEnv = "VMFLOW_SUPERVISE_AGENT_BLOCK" // "after-started": block between fork and QMP; "before-recorded": between fork and the pid's write
	agentUIDsEnv  = "VMFLOW_SUPERVISE_AGENT_UIDS"  // the env's QEMU uid range
)

// envUIDs counts the envs of this test process: each gets a QEMU uid range
// of its own, disjoint from other test processes' (keyed by pid), as agents
// sharing a machine must have.
var envUIDs atomic.Uint32

// envRanges maps an env's state dir to its uid range, for the helper
// agents started on it.
var envRanges sync.Map

func uidsOf(dir string) store.UIDRange {
	if r, ok := envRanges.Load(dir); ok {
		return r.(store.UIDRange)
	}
	return newUIDRange()
}

func newUIDRange() store.UIDRange {
	first := 3_500_000_000 + uint32(os.Getpid()%50_000)*2_000 + (envUIDs.Add(1)%100)*20
	return store.UIDRange{First: first, Last: first + 19}
}

func TestMain(m *testing.M) {
	if dir := os.Getenv(agentEnv); dir != "" {
		runAgent(dir, os.Getenv(agentIDEnv), os.Getenv(agentBlockEnv), os.Getenv(agentUIDsEnv))
		return
	}
	// A QEMU whose agent was killed is reparented to this process, so the
	// tests can reap it and demand that no zombie is left.
	if err := proctest.BecomeSubreaper(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	os.Exit(m.Run())
}

// runAgent is the helper agent: a Supervisor on dir that launches id,
// prints "running <pid>" (or, blocking in OnStarted, "started <pid>") and
// waits for stdin to close or for the test to kill it.
func runAgent(dir, id, block, uids string) {
	fail := func(err error) {
		fmt.Fprintln(os.Stdout, "error", err)
		os.Exit(1)
	}
	st, err := store.New(dir)
	if err != nil {
		fail(err)
	}
	r, err := store.ParseUIDRange(uids)
	if err != nil {
		fail(err)
	}
	cfg := Config{Store: st, QEMUUIDs: r}
	blockHere := func(word string) func(string, proc.Identity) {
		return func(_ string, pid proc.Identity) {
			fmt.Fprintln(os.Stdout, word, pid.PID)
			_, _ = io.Copy(io.Discard, os.Stdin) // until the test kills us
			os.Exit(3)
		}
	}
	sup, err := New(cfg)
	if err != nil {
		fail(err)
	}
	switch block {
	case "after-started":
		sup.hooks.afterStarted = blockHere("started")
	case "before-recorded":
		sup.hooks.beforeRecorded = blockHere("forked")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := sup.Start(ctx); err != nil {
		fail(err)
	}
	res, err := sup.Launch(ctx, id)
	if err != nil {
		fail(err)
	}
	fmt.Fprintln(os.Stdout, "running", res.Identity.PID)
	_, _ = io.Copy(io.Discard, os.Stdin)
	os.Exit(0)
}

// agent is a running helper agent.
type agent struct {
	child *proc.Child
	out   *bufio.Reader
}

// startAgent runs the helper agent on dir for id and returns once it printed
// the line starting with want ("running" or "started") and the pid in it.
func startAgent(t *testing.T, dir, id, block, want string) (*agent, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), agentEnv+"="+dir, agentIDEnv+"="+id, agentBlockEnv+"="+block, agentUIDsEnv+"="+uidsOf(dir).String())
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	cmd.Stdout = w
	child, err := proc.Start(cmd)
	w.Close()
	require.NoError(t, err)
	t.Cleanup(func() {
		r.Close()
		stdin.Close()
		_ = proc.Signal(child.Identity(), syscall.SIGKILL)
		<-child.Done()
	})
	a := &agent{child: child, out: bufio.NewReader(r)}
	lines := make(chan string, 1)
	go func() {
		line, err := a.out.ReadString('\n')
		if err != nil {
			line = "read error: " + err.Error()
		}
		lines <- strings.TrimSpace(line)
	}()
	var line string
	select {
	case line = <-lines:
	case <-time.After(30 * time.Second):
		t.Fatal("helper agent printed nothing in 30s")
	}
	f := strings.Fields(line)
	require.True(t, len(f) == 2 && f[0] == want, "helper agent said %q, want %q <pid>", line, want)
	pid, err := strconv.Atoi(f[1])
	require.NoError(t, err)
	return a, pid
}

// kill9 kills the helper agent with SIGKILL and waits until it is reaped.
func (a *agent) kill9(t *testing.T) {
	t.Helper()
	require.NoError(t, proc.Signal(a.child.Identity(), syscall.SIGKILL))
	select {
	case <-a.child.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("killed agent not reaped in 10s")
	}
}

func requiresQEMU(tb testing.TB) { vmmtest.RequiresQEMU(tb) }

func testAccel() string { return string(vmmtest.Accel()) }

// testDir is a short directory: a unix socket path holds at most 107 bytes.
func testDir(tb testing.TB) string { return proctest.ShortDir(tb, "sv") }

var assertNoZombieChildren = proctest.AssertNoZombieChildren

// ctxT bounds a test's wait on the supervisor: every one waits on QEMU, so
// under TCG the bound is scaled as QEMU's own deadlines are (a CI run with
// the crash matrix beside it once took over 30 s to get a -machine none
// QEMU's QMP greeting).
func ctxT(tb testing.TB, d time.Duration) context.Context {
	tb.Helper()
	return proctest.Context(tb, vmmtest.QEMUDeadline(d))
}

type env struct {
	t    testing.TB
	dir  string
	uids store.UIDRange // its QEMUs' uids
	st   *store.Store
	logs *observer.ObservedLogs
	sup  *Supervisor
}

// newEnv makes a state dir and store. Every QEMU any record of it names is
// killed (identity verified) at cleanup, also when the test failed.
func newEnv(tb testing.TB) *env {
	tb.Helper()
	requiresQEMU(tb)
	e := &env{t: tb, dir: testDir(tb), uids: newUIDRange()}
	st, err := store.New(e.dir)
	require.NoError(tb, err)
	e.st = st
	envRanges.Store(e.dir, e.uids)
	tb.Cleanup(e.killAll)
	return e
}

// newSupervisor starts a Supervisor on the env's store (not Start-ed). Its
// logs go to the test log and to e.logs.
func (e *env) newSupervisor(mutate func(*Config)) *Supervisor {
	e.t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	e.logs = logs
	var log *zap.Logger
	if tt, ok := e.t.(*testing.T); ok {
		log = zaptest.NewLogger(tt, zaptest.WrapOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
			return zapcore.NewTee(c, core)
		})))
	} else {
		log = zap.New(core)
	}
	// QMP's deadline scaled to the accelerator: a loaded machine without
	// KVM once missed the production 10 s.
	cfg := Config{Store: e.st, Logger: log, QEMUUIDs: e.uids, ReadyTimeout: vmmtest.QEMUDeadline(vmm.DefaultReadyTimeout)}
	if mutate != nil {
		mutate(&cfg)
	}
	sup, err := New(cfg)
	require.NoError(e.t, err)
	e.t.Cleanup(func() { _ = sup.Close() })
	e.sup = sup
	return sup
}

// create records instance id with a -machine none spec and a restart policy.
func (e *env) create(id, policy string, maxAttempts uint32) {
	e.t.Helper()
	_, err := e.st.Create(ctxT(e.t, 10*time.Second), &vmflowv1.InstanceRecord{
		Id: id,
		Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: testAccel(),
			Uuid: "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab"},
		RestartPolicy:      policy,
		RestartMaxAttempts: maxAttempts,
	})
	require.NoError(e.t, err)
}

func (e *env) get(id string) *vmflowv1.InstanceRecord {
	e.t.Helper()
	rec, err := e.st.Get(id)
	require.NoError(e.t, err)
	return rec
}

// killAll kills every QEMU a record names, then reaps those adopted from a
// killed helper agent (children of ours that no proc.Child reaps).
func (e *env) killAll() {
	recs, _ := e.st.List()
	for _, rec := range recs {
		if p := rec.GetProcess(); p != nil {
			killAndReap(e.t, store.IdentityOf(p))
		}
	}
}

// killAndReap SIGKILLs the process id names (only if the identity matches)
// and waits until its group is gone.
func killAndReap(tb testing.TB, id proc.Identity) {
	if err := proc.Signal(id, syscall.SIGKILL); err != nil && !errors.Is(err, proc.ErrNotFound) && !errors.Is(err, proc.ErrIdentityMismatch) {
		tb.Errorf("cleanup: kill %v: %v", id, err)
	}
	h, err := proc.Open(id)
	if err != nil {
		return // gone or a stranger
	}
	defer h.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.Wait(ctx); err != nil {
		tb.Errorf("cleanup: %v outlived SIGKILL: %v", id, err)
	}
}

// reapAdopted reaps the zombie of id, a QEMU adopted by this (subreaper)
// process after its agent was killed, once its whole group is gone.
func reapAdopted(t *testing.T, id proc.Identity) {
	t.Helper()
	require.Eventually(t, func() bool { return !proc.Inspect(id).Alive }, 10*time.Second, 5*time.Millisecond)
	st, err := proc.ReadStat(id.PID)
	if err != nil || st.StartTime != id.StartTime {
		return // already reaped
	}
	require.Equal(t, os.Getpid(), st.PPID, "%v should have been reparented to the test (subreaper)", id)
	var ws unix.WaitStatus
	_, err = unix.Wait4(id.PID, &ws, 0, nil)
	require.NoError(t, err)
}

// adoptOnCleanup makes sure an adopted QEMU is killed and reaped at the end.
func adoptOnCleanup(t *testing.T, id proc.Identity) {
	t.Cleanup(func() {
		killAndReap(t, id)
		if st, err := proc.ReadStat(id.PID); err == nil && st.StartTime == id.StartTime && st.PPID == os.Getpid() {
			var ws unix.WaitStatus
			_, _ = unix.Wait4(id.PID, &ws, 0, nil)
		}
	})
}

// waitLog waits for a log line msg about instance id whose reason field
// contains reason (any reason when empty).
func (e *env) waitLog(id, msg, reason string) observer.LoggedEntry {
	e.t.Helper()
	var found observer.LoggedEntry
	require.Eventually(e.t, func() bool {
		for _, le := range e.logs.FilterMessage(msg).FilterField(zap.String("instance_id", id)).All() {
			r, _ := le.ContextMap()["reason"].(string)
			if strings.Contains(r, reason) {
				found = le
				return true
			}
		}
		return false
	}, 15*time.Second, 5*time.Millisecond, "no log %q (reason %q) for %s", msg, reason, id)
	return found
}
