package vmm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
)

// These tests are package vmm's own and cannot import vmmtest (it imports
// vmm): what they share with it lives in proctest.

// requiresQEMU skips the test when qemu-system-x86_64 is not installed.
func requiresQEMU(tb testing.TB) string {
	tb.Helper()
	return proctest.RequiresBinary(tb, DefaultBinary, "make qemu installs it")
}

// testAccel is vmmtest.Accel (proctest.Accel).
func testAccel() Accel { return Accel(proctest.Accel(CheckKVM("").Err)) }

// testDir is a short directory under /tmp (proctest.ShortDir).
func testDir(tb testing.TB) string { return proctest.ShortDir(tb, "vm") }

var (
	ctxT                   = proctest.Context
	assertNoZombieChildren = proctest.AssertNoZombieChildren
)

func testLaunchConfig(tb testing.TB, name string) LaunchConfig {
	d := testDir(tb)
	return LaunchConfig{
		Spec: VMSpec{Name: name, UUID: "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab",
			VCPUs: 1, MemoryMiB: 64, Machine: MachineNone, Accel: testAccel()},
		Paths: Paths{
			QMPSocket: filepath.Join(d, "qemu.sock"),
			PIDFile:   filepath.Join(d, "qemu.pid"),
			Log:       filepath.Join(d, "qemu.log"),
		},
		Confine:      Confinement{UID: testUID(), KVM: CheckKVM("")},
		ReadyTimeout: proctest.ScaleDeadline(string(testAccel()), DefaultReadyTimeout),
	}
}

// assertRunsThenStops: vm answers QMP as running, and the stop ladder
// takes its whole group to gone.
func assertRunsThenStops(t *testing.T, vm *VM) {
	t.Helper()
	s, err := vm.Status(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	assert.True(t, s.Running)
	res, err := vm.Stop(ctxT(t, 30*time.Second), StopConfig{GracefulTimeout: time.Millisecond})
	require.NoError(t, err)
	assert.Equal(t, StepGone, res.Reached)
	assertGone(t, vm.Identity())
}

// killOnCleanup makes sure a failing test leaves no QEMU behind.
func killOnCleanup(tb testing.TB, vm *VM) {
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = Stop(ctx, StopConfig{Identity: vm.Identity(), Child: vm.Child(), From: StepKillSent, KillTimeout: 5 * time.Second})
		vm.Close()
	})
}

// assertGone checks that the process named by id has left /proc entirely:
// not alive, and no <defunct> entry (reaped).
func assertGone(t *testing.T, id proc.Identity) {
	t.Helper()
	st, err := proc.ReadStat(id.PID)
	if err == nil && st.StartTime == id.StartTime {
		t.Errorf("%v still in /proc in state %c", id, st.State)
	}
	assert.Equal(t, proc.StateExited, proc.Inspect(id).State)
	assertNoZombieChildren(t)
}

type hookLog struct {
	mu      sync.Mutex
	started []proc.Identity
	failed  []proc.Identity
	causes  []error
	steps   []StopStep
}

func (h *hookLog) onStarted(id proc.Identity) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.started = append(h.started, id)
	return nil
}

func (h *hookLog) onFailed(id proc.Identity, cause error) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failed = append(h.failed, id)
	h.causes = append(h.causes, cause)
	return nil
}

func (h *hookLog) onStep(s StopStep) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.steps = append(h.steps, s)
	return nil
}

func stepsOf(r StopResult) []StopStep {
	var out []StopStep
	for _, s := range r.Steps {
		out = append(out, s.Step)
	}
	return out
}

func TestLaunchRunningThenStopLadder(t *testing.T) {
	requiresQEMU(t)
	var hooks hookLog
	cfg := testLaunchConfig(t, "ladder")
	cfg.OnStarted, cfg.OnFailed = hooks.onStarted, hooks.onFailed

	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)
	id := vm.Identity()
	require.Equal(t, []proc.Identity{id}, hooks.started, "OnStarted gets the identity right after the fork")
	assert.Empty(t, hooks.failed)

	st, err := vm.Status(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	assert.Equal(t, StatusInfo{Status: "running", Running: true}, st)
	assert.NoFileExists(t, cfg.Paths.PIDFile) // QEMU writes nothing by path

	// -machine none has no ACPI: system_powerdown is accepted and ignored,
	// so the ladder must escalate to quit after the graceful timeout.
	res, err := vm.Stop(ctxT(t, 30*time.Second), StopConfig{
		GracefulTimeout: 200 * time.Millisecond, OnStep: hooks.onStep,
	})
	require.NoError(t, err)
	assert.Equal(t, StepGone, res.Reached)
	assert.False(t, res.AlreadyGone)
	assert.False(t, res.QMPUnreachable)
	require.Equal(t, []StopStep{StepPowerdownSent, StepQuitSent}, stepsOf(res))
	assert.False(t, res.Steps[0].Exited, "machine none ignores the power button")
	assert.GreaterOrEqual(t, res.Steps[0].Duration, 200*time.Millisecond)
	assert.Equal(t, "qmp", res.Steps[1].Via)
	assert.True(t, res.Steps[1].Exited, "quit ends QEMU")
	assert.Equal(t, []StopStep{StepPowerdownSent, StepQuitSent, StepGone}, hooks.steps)
	require.NotNil(t, res.Exit)
	assert.Equal(t, 0, res.Exit.Code)

	assertGone(t, id)
	assert.NoFileExists(t, cfg.Paths.QMPSocket)
	assert.NoFileExists(t, cfg.Paths.PIDFile)
	t.Logf("stop: %+v", res)
}

func TestLaunchBadOptionFailsFast(t *testing.T) {
	qemu := requiresQEMU(t)
	// A wrapper is the only way to hand QEMU an option Argv would never
	// produce: the QEMU that runs is real and prints its own message.
	wrapDir := testDir(t)
	require.NoError(t, os.Chmod(wrapDir, 0o755)) // QEMU's uid execs it
	wrapper := filepath.Join(wrapDir, "qemu-bogus")
	require.NoError(t, os.WriteFile(wrapper, []byte("#!/bin/sh\nexec "+qemu+" -bogus \"$@\"\n"), 0o755))

	// Not a kernel: QEMU reads the inherited fd and refuses its header.
	junk := filepath.Join(wrapDir, "junk")
	require.NoError(t, os.WriteFile(junk, bytes.Repeat([]byte{0xa5}, 4096), 0o644))
	badKernel := testLaunchConfig(t, "badkernel")
	badKernel.Spec.Machine, badKernel.Spec.Accel = MachineQ35, AccelTCG
	kf, err := os.Open(junk)
	require.NoError(t, err)
	badKernel.Spec.Kernel = kf

	bogus := testLaunchConfig(t, "bogus")
	bogus.Binary = wrapper

	for _, tt := range []struct {
		name string
		cfg  LaunchConfig
		want string
	}{
		{"invalid option", bogus, "-bogus: invalid option"},
		{"bad kernel", badKernel, "invalid kernel header"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var hooks hookLog
			cfg := tt.cfg
			cfg.ReadyTimeout = 20 * time.Second
			cfg.OnStarted = hooks.onStarted
			var goneAtOnFailed bool
			var socketAtOnFailed error
			cfg.OnFailed = func(id proc.Identity, cause error) error {
				// Invariant 5: by the time the caller clears the pid,
				// QEMU is reaped and the socket is gone.
				_, statErr := proc.ReadStat(id.PID)
				goneAtOnFailed = errors.Is(statErr, proc.ErrNotFound) || proc.Inspect(id).State == proc.StateExited
				_, socketAtOnFailed = os.Lstat(cfg.Paths.QMPSocket)
				return hooks.onFailed(id, cause)
			}
			start := time.Now()
			vm, err := Launch(ctxT(t, 30*time.Second), cfg)
			took := time.Since(start)
			require.Error(t, err)
			assert.Nil(t, vm)
			assert.ErrorIs(t, err, ErrLaunchExited)
			assert.Contains(t, err.Error(), tt.want, "QEMU's own message is in the error")
			assert.Less(t, took, 3*time.Second, "fails at QEMU's exit, not at the 20s ready timeout")
			require.Len(t, hooks.started, 1)
			require.Len(t, hooks.failed, 1)
			assert.Equal(t, hooks.started[0], hooks.failed[0])
			assert.Equal(t, err, hooks.causes[0])
			assert.True(t, goneAtOnFailed)
			assert.True(t, errors.Is(socketAtOnFailed, fs.ErrNotExist), "socket at OnFailed: %v", socketAtOnFailed)
			assertGone(t, hooks.started[0])
			assert.NoFileExists(t, cfg.Paths.QMPSocket)
			t.Logf("failed in %s: %v", took, err)
		})
	}
}

func TestLaunchOnStartedErrorLeavesNothing(t *testing.T) {
	requiresQEMU(t)
	var hooks hookLog
	cfg := testLaunchConfig(t, "hookfail")
	boom := errors.New("record write failed")
	cfg.OnStarted = func(id proc.Identity) error {
		_ = hooks.onStarted(id)
		return boom
	}
	cfg.OnFailed = hooks.onFailed
	_, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.ErrorIs(t, err, boom)
	require.ErrorIs(t, err, ErrHook)
	require.Len(t, hooks.failed, 1)
	assertGone(t, hooks.started[0])
	assert.NoFileExists(t, cfg.Paths.QMPSocket)
}

func TestLaunchRetryRemovesStaleSocket(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "stale")
	// A socket file left by a killed QEMU: nobody listens on it.
	l, err := net.Listen("unix", cfg.Paths.QMPSocket)
	require.NoError(t, err)
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	require.NoError(t, l.Close())
	_, err = os.Lstat(cfg.Paths.QMPSocket)
	require.NoError(t, err)

	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)
	_, err = vm.Stop(ctxT(t, 30*time.Second), StopConfig{SkipPowerdown: true})
	require.NoError(t, err)
	assertGone(t, vm.Identity())
}

func TestLaunchRefusesLiveSocket(t *testing.T) {
	requiresQEMU(t)
	var hooks hookLog
	cfg := testLaunchConfig(t, "live")
	cfg.OnStarted, cfg.OnFailed = hooks.onStarted, hooks.onFailed
	l, err := net.Listen("unix", cfg.Paths.QMPSocket)
	require.NoError(t, err)
	defer l.Close()

	_, err = Launch(ctxT(t, 30*time.Second), cfg)
	require.ErrorIs(t, err, ErrSocketInUse)
	assert.Empty(t, hooks.started, "nothing was started")
	assert.Len(t, hooks.failed, 1)
	_, err = os.Lstat(cfg.Paths.QMPSocket)
	assert.NoError(t, err, "someone else's live socket is left alone")
}

// startPlain starts QEMU the way an earlier agent did: a plain exec in its
// own session. The test reaps it (PID 1 here does not reap orphans), but
// Stop sees only the identity, as after an agent restart.
func startPlain(t *testing.T, cfg LaunchConfig) (proc.Identity, <-chan struct{}) {
	t.Helper()
	argv, err := Argv(cfg.Spec, cfg.Paths)
	require.NoError(t, err)
	cmd := exec.Command(requiresQEMU(t), argv...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	qmp, err := listenQMP(cfg.Paths.QMPSocket)
	require.NoError(t, err)
	cmd.ExtraFiles = []*os.File{qmp} // QMPFD
	require.NoError(t, cmd.Start())
	qmp.Close()
	reaped := make(chan struct{})
	go func() { _ = cmd.Wait(); close(reaped) }()
	id, err := proc.ReadIdentity(cmd.Process.Pid)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = proc.Signal(id, syscall.SIGKILL)
		<-reaped
	})
	// Ready when QMP answers (condition with a deadline, no sleep).
	deadline := time.Now().Add(10 * time.Second)
	for {
		m, err := DialQMP(ctxT(t, time.Second), cfg.Paths.QMPSocket)
		if err == nil {
			m.Close()
			break
		}
		require.True(t, time.Now().Before(deadline), "qmp never came up: %v", err)
		select {
		case <-reaped:
			t.Fatalf("qemu exited: %v", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	return id, reaped
}

func TestStopNonChild(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "nonchild")
	id, reaped := startPlain(t, cfg)

	var hooks hookLog
	res, err := Stop(ctxT(t, 30*time.Second), StopConfig{
		Identity: id, Paths: cfg.Paths, SkipPowerdown: true, OnStep: hooks.onStep,
	})
	require.NoError(t, err)
	assert.Equal(t, StepGone, res.Reached)
	assert.Equal(t, []StopStep{StepQuitSent}, stepsOf(res))
	assert.Equal(t, "qmp", res.Steps[0].Via)
	assert.Nil(t, res.Exit, "not our child: no exit status")
	assert.Equal(t, []StopStep{StepQuitSent, StepGone}, hooks.steps)
	assert.Equal(t, proc.StateExited, proc.Inspect(id).State)
	select {
	case <-reaped:
	case <-time.After(10 * time.Second):
		t.Fatal("the test's reaper never saw the exit")
	}
	assertGone(t, id)
	assert.NoFileExists(t, cfg.Paths.QMPSocket)
}

func TestStopNonChildWithoutQMPUsesSignals(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "noqmp")
	id, reaped := startPlain(t, cfg)
	// The socket is gone (say, deleted by hand): the ladder goes straight
	// to signals.
	require.NoError(t, os.Remove(cfg.Paths.QMPSocket))

	var hooks hookLog
	res, err := Stop(ctxT(t, 30*time.Second), StopConfig{
		Identity: id, Paths: cfg.Paths, OnStep: hooks.onStep,
	})
	require.NoError(t, err)
	assert.True(t, res.QMPUnreachable)
	require.Equal(t, []StopStep{StepPowerdownSent, StepQuitSent}, stepsOf(res))
	assert.Equal(t, "skipped", res.Steps[0].Via)
	assert.Less(t, res.Steps[0].Duration, DefaultGracefulTimeout, "no graceful wait for a button never pressed")
	assert.Equal(t, "sigterm", res.Steps[1].Via)
	assert.True(t, res.Steps[1].Exited)
	assert.Equal(t, []StopStep{StepPowerdownSent, StepQuitSent, StepGone}, hooks.steps)
	<-reaped
	assertGone(t, id)
}

func TestStopResumesFromQuitSent(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "resume")
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)

	// The record says quit was sent before the agent restarted (here it
	// was not, so QEMU is still up): wait QuitTimeout, then SIGKILL.
	var hooks hookLog
	res, err := vm.Stop(ctxT(t, 30*time.Second), StopConfig{
		From: StepQuitSent, QuitTimeout: 100 * time.Millisecond, OnStep: hooks.onStep,
	})
	require.NoError(t, err)
	assert.Equal(t, []StopStep{StepQuitSent, StepKillSent}, stepsOf(res))
	assert.Equal(t, "resumed", res.Steps[0].Via)
	assert.True(t, res.Steps[1].Exited)
	assert.Equal(t, []StopStep{StepKillSent, StepGone}, hooks.steps, "no quit is sent again")
	require.NotNil(t, res.Exit)
	assert.Equal(t, "killed", res.Exit.Signal)
	assertGone(t, vm.Identity())
	assert.NoFileExists(t, cfg.Paths.QMPSocket)
	assert.NoFileExists(t, cfg.Paths.PIDFile)
}

func TestStopStillAliveIsAnErrorAndResumable(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "alive")
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)

	// A kill cap that has passed before the wait starts: the group cannot
	// be confirmed gone, and Stop must say so rather than guess.
	res, err := vm.Stop(ctxT(t, 30*time.Second), StopConfig{From: StepKillSent, KillTimeout: time.Nanosecond})
	var alive *StillAliveError
	require.ErrorAs(t, err, &alive)
	require.ErrorIs(t, err, ErrStillAlive)
	assert.Equal(t, vm.Identity(), alive.Identity)
	assert.Equal(t, StepKillSent, res.Reached)

	res, err = vm.Stop(ctxT(t, 30*time.Second), StopConfig{From: StepKillSent})
	require.NoError(t, err)
	assert.Equal(t, StepGone, res.Reached)
	assertGone(t, vm.Identity())
}

func TestStopAlreadyGone(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "gone")
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)
	_, err = vm.Stop(ctxT(t, 30*time.Second), StopConfig{SkipPowerdown: true})
	require.NoError(t, err)

	var hooks hookLog
	start := time.Now()
	res, err := Stop(ctxT(t, 30*time.Second), StopConfig{Identity: vm.Identity(), Paths: cfg.Paths, OnStep: hooks.onStep})
	require.NoError(t, err)
	assert.Less(t, time.Since(start), time.Second)
	assert.True(t, res.AlreadyGone)
	assert.Empty(t, res.Steps)
	assert.Equal(t, []StopStep{StepGone}, hooks.steps)
}

func TestStopRejectsIncompleteIdentity(t *testing.T) {
	_, err := Stop(ctxT(t, time.Second), StopConfig{Identity: proc.Identity{PID: 1}})
	require.ErrorIs(t, err, ErrInvalidIdentity)
	_, err = Stop(ctxT(t, time.Second), StopConfig{Identity: proc.Identity{PID: 1, StartTime: 1, BootID: "x"}, From: "bogus"})
	require.Error(t, err)
}

func TestAttachMismatchedIdentity(t *testing.T) {
	self, err := proc.ReadIdentity(os.Getpid())
	require.NoError(t, err)
	self.StartTime++
	_, err = Attach(self, Paths{})
	require.ErrorIs(t, err, proc.ErrIdentityMismatch)
	// and Stop treats the recorded process as gone, signalling nothing
	res, err := Stop(ctxT(t, time.Second), StopConfig{Identity: self})
	require.NoError(t, err)
	assert.True(t, res.AlreadyGone)
}

func TestAttachThenStop(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "attach")
	id, reaped := startPlain(t, cfg)
	vm, err := Attach(id, cfg.Paths)
	require.NoError(t, err)
	defer vm.Close()
	st, err := vm.Status(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	assert.True(t, st.Running)
	// The VM's open monitor is reused: a second QMP client would wait.
	res, err := vm.Stop(ctxT(t, 30*time.Second), StopConfig{SkipPowerdown: true, QMPTimeout: 500 * time.Millisecond})
	require.NoError(t, err)
	assert.False(t, res.QMPUnreachable)
	assert.Equal(t, "qmp", res.Steps[0].Via)
	<-reaped
	assertGone(t, id)
}

func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vm, err := Launch(ctx, LaunchConfig{
		Spec:      VMSpec{Name: "demo", VCPUs: 1, MemoryMiB: 64, Machine: MachineNone, Accel: AccelKVM},
		Paths:     Paths{QMPSocket: "/tmp/demo.sock", PIDFile: "/tmp/demo.pid", Log: "/tmp/demo.log"},
		OnStarted: func(id proc.Identity) error { return nil }, // persist id into the record
		OnFailed:  func(id proc.Identity, cause error) error { return nil },
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	res, err := vm.Stop(ctx, StopConfig{OnStep: func(s StopStep) error { return nil }})
	fmt.Println(res.Reached, err)
}

// requiresKVM skips when /dev/kvm cannot be opened: the test is about a
// task only KVM creates.
func requiresKVM(tb testing.TB) {
	tb.Helper()
	proctest.RequiresKVM(tb, CheckKVM("").Err)
}

// taskNames lists the comm of every task in pid's thread group.
func taskNames(pid int) []string {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/comm", pid, e.Name()))
		if err == nil {
			out = append(out, string(bytes.TrimSpace(b)))
		}
	}
	return out
}

// TestStopWaitsForKVMTask: a q35 guest under KVM has the kernel's
// kvm-nx-lpage-re task in QEMU's thread group (measured here; -machine none
// has none). The ladder reports gone only when that task is gone too.
func TestStopWaitsForKVMTask(t *testing.T) {
	requiresQEMU(t)
	requiresKVM(t)
	cfg := testLaunchConfig(t, "q35kvm")
	cfg.Spec.Machine, cfg.Spec.Accel, cfg.Spec.UUID = MachineQ35, AccelKVM, ""
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)
	id := vm.Identity()

	// The task appears once the guest runs: wait for it with a deadline.
	deadline := time.Now().Add(10 * time.Second)
	for !slices.Contains(taskNames(id.PID), "kvm-nx-lpage-re") {
		require.True(t, time.Now().Before(deadline), "no kvm-nx-lpage-re task in %v", taskNames(id.PID))
		time.Sleep(5 * time.Millisecond) // polling /proc: there is no event for a new task
	}

	res, err := vm.Stop(ctxT(t, 30*time.Second), StopConfig{GracefulTimeout: 200 * time.Millisecond})
	require.NoError(t, err)
	// SeaBIOS with no OS has nobody to handle the ACPI button.
	assert.Equal(t, []StopStep{StepPowerdownSent, StepQuitSent}, stepsOf(res))
	assertGone(t, id)
	t.Logf("stop: %+v", res)
}

// TestLaunchReadyTimeoutLeavesNothing: a "QEMU" that never opens its QMP
// socket (sleep stands in for a hung one) fails at the ready timeout, and
// is killed and reaped before OnFailed runs.
func TestLaunchReadyTimeoutLeavesNothing(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	require.NoError(t, err)
	dir := testDir(t)
	require.NoError(t, os.Chmod(dir, 0o755)) // QEMU's uid execs it
	hung := filepath.Join(dir, "hung-qemu")
	require.NoError(t, os.WriteFile(hung, []byte("#!/bin/sh\nexec "+sleep+" 600\n"), 0o755))

	var hooks hookLog
	cfg := testLaunchConfig(t, "hung")
	cfg.Binary, cfg.ReadyTimeout = hung, 200*time.Millisecond
	cfg.OnStarted = hooks.onStarted
	var aliveAtOnFailed bool
	cfg.OnFailed = func(id proc.Identity, cause error) error {
		aliveAtOnFailed = proc.Inspect(id).Alive
		return hooks.onFailed(id, cause)
	}
	_, err = Launch(ctxT(t, 30*time.Second), cfg)
	require.ErrorIs(t, err, ErrLaunchTimeout)
	require.Len(t, hooks.failed, 1)
	assert.False(t, aliveAtOnFailed)
	assertGone(t, hooks.started[0])
}

func TestLaunchCancelledContextNeverForks(t *testing.T) {
	var hooks hookLog
	cfg := testLaunchConfig(t, "cancelled")
	cfg.OnStarted, cfg.OnFailed = hooks.onStarted, hooks.onFailed
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := Launch(ctx, cfg)
	require.ErrorIs(t, err, context.Canceled)
	assert.Empty(t, hooks.started)
	assert.Equal(t, []proc.Identity{{}}, hooks.failed)
}
