package proc_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm/vmmtest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	proctest.RunHelperIfRequested()
	runReuseHelperIfRequested()
	os.Exit(m.Run())
}

func TestParseStat(t *testing.T) {
	tail := " S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 19 20"
	tests := []struct {
		name    string
		in      string
		want    proc.Stat
		wantErr bool
	}{
		{name: "plain", in: "42 (qemu-system-x86)" + tail, want: proc.Stat{PID: 42, Comm: "qemu-system-x86", State: 'S', PPID: 1, StartTime: 777}},
		{name: "spaces and parens in comm", in: "7 (a) (b c)" + tail, want: proc.Stat{PID: 7, Comm: "a) (b c", State: 'S', PPID: 1, StartTime: 777}},
		{name: "comm ends with paren", in: "8 (x))" + tail, want: proc.Stat{PID: 8, Comm: "x)", State: 'S', PPID: 1, StartTime: 777}},
		{name: "empty comm", in: "9 ()" + tail, want: proc.Stat{PID: 9, Comm: "", State: 'S', PPID: 1, StartTime: 777}},
		{name: "zombie", in: "10 (z) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 5 19", want: proc.Stat{PID: 10, Comm: "z", State: 'Z', PPID: 1, StartTime: 5}},
		{name: "trailing newline", in: "11 (n)" + tail + "\n", want: proc.Stat{PID: 11, Comm: "n", State: 'S', PPID: 1, StartTime: 777}},
		{name: "empty", in: "", wantErr: true},
		{name: "no comm", in: "12 S 1 2", wantErr: true},
		{name: "too few fields", in: "13 (x) S 1 2 3", wantErr: true},
		{name: "bad pid", in: "x (x)" + tail, wantErr: true},
		{name: "negative pid", in: "-1 (x)" + tail, wantErr: true},
		{name: "bad start time", in: "14 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 -5 19", wantErr: true},
		{name: "state too long", in: "15 (x) SS 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 5 19", wantErr: true},
		{name: "close before open", in: ") 16 (x" + tail, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := proc.ParseStat([]byte(tt.in))
			if tt.wantErr {
				assert.ErrorIs(t, err, proc.ErrMalformedStat)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestReadIdentitySelf(t *testing.T) {
	id, err := proc.ReadIdentity(os.Getpid())
	require.NoError(t, err)
	assert.Equal(t, os.Getpid(), id.PID)
	assert.NotZero(t, id.StartTime)
	assert.Len(t, id.BootID, 36, "boot id is a UUID")
	assert.NoError(t, proc.Verify(id))
	st := proc.Inspect(id)
	assert.Equal(t, proc.StateRunning, st.State)
	assert.True(t, st.Alive)
	assert.GreaterOrEqual(t, st.Tasks, 1)
}

// waitModes runs a test once with the pidfd and once with the /proc
// polling fallback used on kernels without pidfd_open.
var waitModes = []struct {
	name  string
	opts  []proc.Option
	pidfd bool
}{
	{name: "pidfd", pidfd: true},
	{name: "proc-poll", opts: []proc.Option{proc.WithPolling()}},
}

// TestZombieLeaderIsAlive is the heart of invariant 2: a leader that called
// exit(2) while another thread runs shows Z in /proc/<pid>/stat, yet the
// group is alive, and Wait must not return until the last thread is gone.
func TestZombieLeaderIsAlive(t *testing.T) {
	for _, foreign := range []bool{false, true} {
		for _, mode := range waitModes {
			name := mode.name + "/child"
			if foreign {
				name = mode.name + "/not-our-child"
			}
			t.Run(name, func(t *testing.T) {
				var z *proctest.Zombie
				if foreign {
					z = proctest.StartForeignZombie(t)
				} else {
					z = proctest.StartZombie(t)
				}
				id, err := proc.ReadIdentity(z.PID)
				require.NoError(t, err)

				st := proc.Inspect(id)
				assert.Equal(t, proc.StateZombieLeader, st.State)
				assert.True(t, st.Alive, "a zombie leader with a live thread is alive")
				assert.Greater(t, st.Tasks, 1)

				h, err := proc.Open(id, mode.opts...)
				require.NoError(t, err)
				defer h.Close()
				assert.Equal(t, mode.pidfd, h.UsesPidfd())
				exited, err := h.Exited()
				require.NoError(t, err)
				assert.False(t, exited)

				done := make(chan error, 1)
				go func() { done <- h.Wait(context.Background()) }()
				// Wait must still be blocked while the thread runs. A wrong
				// implementation (leader state, kill(0)) returns at once, so
				// a short look is enough to catch it.
				select {
				case err := <-done:
					t.Fatalf("Wait returned (%v) while a thread of the group still runs: %v", err, proctest.LiveTasks(z.PID))
				case <-time.After(150 * time.Millisecond):
				}
				exitAt := z.Release(t)
				select {
				case err := <-done:
					require.NoError(t, err)
					t.Logf("detected %v after the last thread's exit", proctest.MonotonicNow()-exitAt)
				case <-time.After(10 * time.Second):
					t.Fatal("Wait did not return after the group exited")
				}
				assert.Empty(t, proctest.LiveTasks(z.PID), "Wait returned with live tasks")
				after := proc.Inspect(id)
				assert.False(t, after.Alive, "%+v", after)
				exited, err = h.Exited()
				require.NoError(t, err)
				assert.True(t, exited)
			})
		}
	}
}

func TestWaitHonoursContext(t *testing.T) {
	for _, mode := range waitModes {
		t.Run(mode.name, func(t *testing.T) {
			z := proctest.StartZombie(t)
			id, err := proc.ReadIdentity(z.PID)
			require.NoError(t, err)
			h, err := proc.Open(id, mode.opts...)
			require.NoError(t, err)
			defer h.Close()

			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			err = h.Wait(ctx)
			assert.ErrorIs(t, err, context.DeadlineExceeded)
			// The handle stays usable after a cancelled wait.
			z.Release(t)
			ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel2()
			assert.NoError(t, h.Wait(ctx2))
		})
	}
}

// TestPIDReuseRefused: an identity whose start time or boot id differs names
// another process, which proc.Open and proc.Signal must refuse (invariant 3).
func TestPIDReuseRefused(t *testing.T) {
	sleeper := exec.Command("sleep", "60")
	child, err := proc.Start(sleeper)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proc.Signal(child.Identity(), syscall.SIGKILL); <-child.Done() })
	real := child.Identity()

	otherStart := real
	otherStart.StartTime++
	otherBoot := real
	otherBoot.BootID = "00000000-0000-0000-0000-000000000000"
	for name, id := range map[string]proc.Identity{"start time": otherStart, "boot id": otherBoot} {
		t.Run(name, func(t *testing.T) {
			for _, mode := range waitModes {
				_, err := proc.Open(id, mode.opts...)
				assert.ErrorIs(t, err, proc.ErrIdentityMismatch, mode.name)
			}
			assert.ErrorIs(t, proc.Signal(id, syscall.SIGKILL), proc.ErrIdentityMismatch)
			assert.False(t, proc.Inspect(id).Alive, "the recorded process is gone; a stranger has the pid")
		})
	}
	st := proc.Inspect(real)
	assert.True(t, st.Alive, "the real process must not have been signalled")
	_, done := child.Exit()
	assert.False(t, done)

	_, err = proc.Open(proc.Identity{PID: real.PID})
	assert.ErrorIs(t, err, proc.ErrIncompleteIdentity, "an incomplete identity is never acted on")
	assert.True(t, proc.Inspect(proc.Identity{PID: real.PID}).Alive, "an incomplete identity cannot prove the process gone")
}

func TestSignalThroughHandle(t *testing.T) {
	for _, mode := range waitModes {
		t.Run(mode.name, func(t *testing.T) {
			child, err := proc.Start(exec.Command("sleep", "60"))
			require.NoError(t, err)
			h, err := proc.Open(child.Identity(), mode.opts...)
			require.NoError(t, err)
			defer h.Close()
			require.NoError(t, h.Signal(syscall.SIGTERM))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			require.NoError(t, h.Wait(ctx))
			<-child.Done()
			e, ok := child.Exit()
			require.True(t, ok)
			assert.Equal(t, "terminated", e.Signal)
			// Once reaped the pid is free: a second signal must not land anywhere.
			assert.ErrorIs(t, h.Signal(syscall.SIGTERM), proc.ErrNotFound)
		})
	}
}

// TestChildIsReaped: invariant 4, no zombies of our own making.
func TestChildIsReaped(t *testing.T) {
	child, err := proc.Start(exec.Command("sh", "-c", "exit 7"))
	require.NoError(t, err)
	e := reapedExit(t, child)
	assert.Equal(t, 7, e.Code)
	assert.NoError(t, e.Err)
}

// reapedExit waits until child is reaped and returns its Exit, checking
// that no <defunct> entry of it remains.
func reapedExit(t *testing.T, child *proc.Child) proc.Exit {
	t.Helper()
	select {
	case <-child.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("child not reaped")
	}
	e, ok := child.Exit()
	require.True(t, ok)
	assert.False(t, isOurZombie(child.Identity()), "a <defunct> entry remains")
	return e
}

// TestChildNotDoneWhileAThreadLives: invariant 2 for the reaper. A child
// whose leader exited while another thread of its group runs is a zombie
// leader, alive: not Done, no Exit, until that thread ends too.
func TestChildNotDoneWhileAThreadLives(t *testing.T) {
	z := proctest.StartZombie(t)
	child := z.Child()
	select {
	case <-child.Done():
		t.Fatalf("Done while a thread of the group still runs: %v", proctest.LiveTasks(z.PID))
	case <-time.After(150 * time.Millisecond):
	}
	_, ok := child.Exit()
	assert.False(t, ok, "an Exit while a thread of the group still runs")
	exitAt := z.Release(t)
	e := reapedExit(t, child)
	t.Logf("reaped %v after the last thread's exit", proctest.MonotonicNow()-exitAt)
	assert.Empty(t, proctest.LiveTasks(z.PID), "reaped with live tasks")
	assert.NoError(t, e.Err)
	assert.Equal(t, 0, e.Code)
	assert.Empty(t, e.Signal)
	assert.Positive(t, e.Ran)
}

// TestChildExitReportsTheSignal: a child killed by a signal reports it, and
// code -1, as wait4's status would.
func TestChildExitReportsTheSignal(t *testing.T) {
	child, err := proc.Start(exec.Command("sleep", "60"))
	require.NoError(t, err)
	require.NoError(t, proc.Signal(child.Identity(), syscall.SIGKILL))
	e := reapedExit(t, child)
	assert.Equal(t, -1, e.Code)
	assert.Equal(t, "killed", e.Signal)
	assert.NoError(t, e.Err)
}

// TestStartRefusesWhatNeedsWait: proc.Start never calls cmd.Wait, so a
// command only Wait would finish (a copy goroutine, a context) is refused.
func TestStartRefusesWhatNeedsWait(t *testing.T) {
	cmd := exec.Command("true")
	cmd.Stdout = &strings.Builder{}
	_, err := proc.Start(cmd)
	assert.ErrorIs(t, err, proc.ErrNeedsWait)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err = proc.Start(exec.CommandContext(ctx, "true"))
	assert.ErrorIs(t, err, proc.ErrNeedsWait)
}

func TestChildRunsInOwnSession(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	child, err := proc.Start(cmd)
	require.NoError(t, err)
	defer func() { _ = proc.Signal(child.Identity(), syscall.SIGKILL); <-child.Done() }()
	sid, err := unix.Getsid(child.Identity().PID)
	require.NoError(t, err)
	assert.Equal(t, child.Identity().PID, sid, "the child leads its own session, so it outlives the agent")
}

func TestStartFailure(t *testing.T) {
	_, err := proc.Start(exec.Command("/nonexistent/qemu"))
	assert.Error(t, err)
}

func isOurZombie(id proc.Identity) bool {
	st, err := proc.ReadStat(id.PID)
	return err == nil && st.StartTime == id.StartTime && st.State == 'Z' && st.PPID == os.Getpid()
}

// TestKVMQEMUThreadGroup runs a real QEMU under KVM: its group holds the
// kernel's kvm-nx-lpage-re task, and after SIGKILL, Wait returns only once
// no task of the group is alive.
func TestKVMQEMUThreadGroup(t *testing.T) {
	qemu := vmmtest.RequiresQEMU(t)
	// Under TCG there is no kvm-nx-lpage-re task: the test would pass
	// without testing what it names. CI has /dev/kvm.
	vmmtest.RequiresKVM(t)
	// q35 running its firmware, not -machine none: the kvm-nx-lpage-re
	// worker is created at the first KVM_RUN, which -machine none never does.
	cmd := exec.Command(qemu, "-machine", "q35", "-accel", "kvm", "-nodefaults", "-display", "none", "-m", "64", "-no-user-config")
	cmd.Stderr = os.Stderr
	child, err := proc.Start(cmd)
	require.NoError(t, err)
	id := child.Identity()
	t.Cleanup(func() { _ = proc.Signal(id, syscall.SIGKILL); <-child.Done() })

	require.Eventually(t, func() bool { return hasTask(id.PID, "kvm-nx-lpage-re") }, 20*time.Second, 5*time.Millisecond,
		"QEMU under KVM should have a kvm-nx-lpage-re task in its thread group")
	h, err := proc.Open(id)
	require.NoError(t, err)
	defer h.Close()
	require.NoError(t, h.Signal(syscall.SIGKILL))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, h.Wait(ctx))
	assert.Empty(t, proctest.LiveTasks(id.PID), "Wait returned while tasks of the group were alive")
	select {
	case <-child.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("QEMU not reaped")
	}
	e, _ := child.Exit()
	assert.Equal(t, "killed", e.Signal)
}

func hasTask(pid int, comm string) bool {
	paths, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/comm", pid))
	for _, p := range paths {
		if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == comm {
			return true
		}
	}
	return false
}

func TestHolders(t *testing.T) {
	f := filepath.Join(t.TempDir(), "vfio-12")
	require.NoError(t, os.WriteFile(f, nil, 0o600))

	hs, err := proc.Holders(context.Background(), f)
	require.NoError(t, err)
	assert.Empty(t, proctest.Certain(hs), "nobody holds a new file")
	for _, h := range hs {
		// Processes more privileged than this one (the sandbox's own init,
		// here) cannot be inspected even by root: reported, never skipped.
		assert.Equal(t, -1, h.FD)
		assert.NotEmpty(t, h.Err)
		t.Logf("uninspectable: %v", h)
	}

	// A zombie leader's own fd table reads empty while its live thread still
	// holds the file: only the per-task scan finds it.
	z := proctest.StartZombie(t, proctest.HoldFileEnv+"="+f)
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", z.PID))
	if err == nil {
		t.Logf("/proc/%d/fd of the zombie leader lists %d entries", z.PID, len(entries))
	}
	hs, err = proc.Holders(context.Background(), f)
	require.NoError(t, err)
	hs = proctest.Certain(hs)
	require.Len(t, hs, 1, "%v", hs)
	assert.Equal(t, z.PID, hs[0].PID)
	assert.False(t, hs[0].Uncertain)

	z.Release(t)
	require.Eventually(t, func() bool {
		hs, err := proc.Holders(context.Background(), f)
		return err == nil && len(proctest.Certain(hs)) == 0
	}, 10*time.Second, 5*time.Millisecond, "the file is still reported held after its holder exited")
}

// TestHoldersUnreadableCountsAsHolder: a process whose descriptors cannot be
// read may hold the device, so it is reported, never silently skipped.
func TestHoldersUnreadableCountsAsHolder(t *testing.T) {
	proctest.RequiresRoot(t, "a scan runs as another user")
	target := filepath.Join(t.TempDir(), "dev")
	require.NoError(t, os.WriteFile(target, nil, 0o644))
	f, err := os.Open(target)
	require.NoError(t, err)
	defer f.Close()

	hs := proctest.HoldersAs(t, 65534, 65534, target)
	// This test process runs as root and holds the file: to nobody its
	// descriptors are unreadable, so it must be listed as uncertain.
	var found bool
	for _, h := range hs {
		if h.PID == os.Getpid() {
			found = true
			assert.True(t, h.Uncertain, "%v", h)
		}
	}
	assert.True(t, found, "the uninspectable holder was skipped: %v", hs)
}

func TestSignalGoneProcess(t *testing.T) {
	child, err := proc.Start(exec.Command("true"))
	require.NoError(t, err)
	<-child.Done()
	err = proc.Signal(child.Identity(), syscall.SIGKILL)
	require.Error(t, err)
	assert.True(t, errors.Is(err, proc.ErrNotFound) || errors.Is(err, proc.ErrIdentityMismatch), "%v", err)
}

// startSleep starts `sleep arg` with env as its whole environment, in a
// session of its own (proc.Start) or, with leader false, in this one.
func startSleep(t *testing.T, arg string, leader bool, env ...string) proc.Identity {
	t.Helper()
	cmd := exec.Command("sleep", arg)
	cmd.Env = env
	if leader {
		c, err := proc.Start(cmd)
		require.NoError(t, err)
		t.Cleanup(func() {
			_ = proc.Signal(c.Identity(), syscall.SIGKILL)
			<-c.Done()
		})
		return c.Identity()
	}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	id, err := proc.ReadIdentity(cmd.Process.Pid)
	require.NoError(t, err)
	return id
}

// Find reports a process only when every check passes: the executable
// (device and inode), the session leadership, the exact environment entry
// and the argv; a command line alone never makes a match.
func TestFind(t *testing.T) {
	bin, err := exec.LookPath("sleep")
	require.NoError(t, err)
	sleepExe, err := proc.StatExecutable(bin)
	require.NoError(t, err)
	trueBin, err := exec.LookPath("true")
	require.NoError(t, err)
	trueExe, err := proc.StatExecutable(trueBin)
	require.NoError(t, err)

	comm := proc.CommOf(bin)
	arg := fmt.Sprintf("3601.%d", os.Getpid()) // unique to this test run
	nonce := "VMFLOW_TEST_NONCE=" + arg
	leader := startSleep(t, arg, true, nonce)
	impostor := startSleep(t, arg, true, "VMFLOW_TEST_NONCE=other") // same argv, same exe, same session shape
	member := startSleep(t, arg, false, nonce)                      // the nonce, but not a session leader
	ctx := ctxT(t, 10*time.Second)

	byArg := func(a []string) bool { return len(a) == 2 && a[1] == arg }
	for _, tt := range []struct {
		name string
		q    proc.FindQuery
		want []proc.Identity
	}{
		{"nonce", proc.FindQuery{Exe: sleepExe, Comm: comm, SessionLeader: true, Env: nonce}, []proc.Identity{leader}},
		{"nonce with hint", proc.FindQuery{Exe: sleepExe, Comm: comm, SessionLeader: true, Env: nonce, Hint: leader.PID}, []proc.Identity{leader}},
		{"nonce with a wrong hint", proc.FindQuery{Exe: sleepExe, Comm: comm, SessionLeader: true, Env: nonce, Hint: impostor.PID}, []proc.Identity{leader}},
		{"argv alone matches every copy", proc.FindQuery{Exe: sleepExe, Comm: comm, SessionLeader: true, Argv: byArg}, []proc.Identity{leader, impostor}},
		{"not only leaders", proc.FindQuery{Exe: sleepExe, Comm: comm, Env: nonce}, []proc.Identity{leader, member}},
		{"another executable", proc.FindQuery{Exe: trueExe, Comm: proc.CommOf(trueBin), Env: nonce}, nil},
		{"a nonce nobody has", proc.FindQuery{Exe: sleepExe, Comm: comm, Env: "VMFLOW_TEST_NONCE=nobody"}, nil},
		{"a prefix of the nonce is not the nonce", proc.FindQuery{Exe: sleepExe, Comm: comm, Env: nonce[:len(nonce)-1]}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, err := proc.Find(ctx, tt.q)
			require.NoError(t, err)
			assert.ElementsMatch(t, tt.want, got)
		})
	}

	// The same inode under another path (a hard link) is not the binary
	// the agent launches: the path must match too, then the inode.
	other := sleepExe
	other.Ino++
	got, err := proc.Find(ctx, proc.FindQuery{Exe: other, Comm: comm, Env: nonce})
	require.NoError(t, err)
	assert.Empty(t, got, "same path, another inode: the binary was replaced, and this is not a process of it")

	// A zombie leader with a live thread: exe and environ come from its task.
	self, err := proc.StatExecutable("/proc/self/exe")
	require.NoError(t, err)
	z := proctest.StartZombie(t, "VMFLOW_TEST_NONCE=zombie"+arg)
	zid, err := proc.ReadIdentity(z.PID)
	require.NoError(t, err)
	got, err = proc.Find(ctx, proc.FindQuery{Exe: self, Comm: proc.CommOf(os.Args[0]), SessionLeader: true, Env: "VMFLOW_TEST_NONCE=zombie" + arg})
	require.NoError(t, err)
	assert.Equal(t, []proc.Identity{zid}, got)
	z.Release(t)

	_, err = proc.Find(ctx, proc.FindQuery{})
	assert.Error(t, err, "an executable is required")
	assert.Equal(t, "qemu-system-x86", proc.CommOf("/usr/bin/qemu-system-x86_64"), "cut to 15 bytes")
}

// A candidate whose memory cannot be read (the kernel's read blocks while
// the target's mmap lock is held: VFIO teardown, a fault on a hung mount)
// bounds the search by ctx, answers "can't tell" (never "none"), and the
// blocked read is shared by every search that meets it meanwhile.
func TestFindBlockedReadIsBounded(t *testing.T) {
	bin, err := exec.LookPath("sleep")
	require.NoError(t, err)
	exe, err := proc.StatExecutable(bin)
	require.NoError(t, err)
	arg := fmt.Sprintf("3602.%d", os.Getpid())
	nonce := "VMFLOW_TEST_NONCE=" + arg
	id := startSleep(t, arg, true, nonce)

	unblock := make(chan struct{})
	var reads atomic.Int32
	blocking := func(path string) ([]byte, error) {
		if path == fmt.Sprintf("/proc/%d/environ", id.PID) {
			reads.Add(1)
			<-unblock
		}
		return os.ReadFile(path)
	}
	q := proc.FindQuery{Exe: exe, Comm: proc.CommOf(bin), SessionLeader: true, Env: nonce, ReadMem: blocking}
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		got, err := proc.Find(ctx, q)
		cancel()
		require.ErrorIs(t, err, proc.ErrCannotTell)
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Empty(t, got)
	}
	assert.Equal(t, int32(1), reads.Load(), "one read in flight per process and file, however often asked")
	close(unblock)
	got, err := proc.Find(ctxT(t, 10*time.Second), q)
	require.NoError(t, err)
	assert.Equal(t, []proc.Identity{id}, got, "found once the read can finish")
}

var ctxT = proctest.Context

// Threads sharing one fd table (as QEMU's do) have it read once, not once
// per thread; a thread with a table of its own (unshare(CLONE_FILES)) has
// its table read too, and what it holds is found. Fails on a scan that reads
// every task's table (TablesRead is 17 here: 13 threads and the Go
// runtime's).
func TestScanFDsReadsEachTableOnce(t *testing.T) {
	f := filepath.Join(t.TempDir(), "vfio-7")
	require.NoError(t, os.WriteFile(f, nil, 0o600))
	c := proctest.StartCrowd(t, 12, 30, proctest.HoldFileEnv+"="+f)
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", c.PID))
	require.NoError(t, err)
	require.Greater(t, len(tasks), 13)

	s, err := proc.ScanFDs(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 2, s.TablesRead(c.PID), "the shared table and the private one")
	hs, err := s.Holders(f)
	require.NoError(t, err)
	hs = proctest.Certain(hs)
	require.Len(t, hs, 1, "%v", hs)
	assert.Equal(t, c.PID, hs[0].PID)
	assert.Equal(t, c.PrivateTID, hs[0].TID)

	// A zombie leader's empty table stands for nothing: its live thread's
	// table is read, and holds the file.
	z := proctest.StartZombie(t, proctest.HoldFileEnv+"="+f)
	s, err = proc.ScanFDs(context.Background())
	require.NoError(t, err)
	hs, err = s.Holders(f)
	require.NoError(t, err)
	var pids []int
	for _, h := range proctest.Certain(hs) {
		pids = append(pids, h.PID)
	}
	assert.ElementsMatch(t, []int{c.PID, z.PID}, pids)
}

// TestReapedMidReadIsGone: a /proc file opened before its process was reaped
// reads ESRCH, not ENOENT. ReadStat must call that gone: an "unknown, so
// alive" answer there kept a reaped VM alive for one Inspect (seen in CI as
// TestZombieLeaderIsAlive/proc-poll/not-our-child).
func TestReapedMidReadIsGone(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	require.NoError(t, cmd.Start())
	f, err := os.Open(fmt.Sprintf("/proc/%d/stat", cmd.Process.Pid))
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
	b := make([]byte, 512)
	n, err := f.Read(b)
	require.Error(t, err)
	assert.ErrorIs(t, err, syscall.ESRCH)
	_, err = proc.StatFromRead(cmd.Process.Pid, b[:n], &fs.PathError{Op: "read", Path: f.Name(), Err: err})
	assert.ErrorIs(t, err, proc.ErrNotFound)
}

// A process caught in exec already shows the new binary as exe and comm but
// an empty cmdline until the kernel has set up its arguments (seen for QEMU
// exec'd by prlimit: TestAgentKilledBeforePidRecorded found no QEMU, 4 runs
// in 600). Find waits that out instead of calling it no match; one that
// stays empty is "can't tell", never "none". ReadMem plays the kernel here.
func TestFindWaitsOutAnExecInProgress(t *testing.T) {
	bin, err := exec.LookPath("sleep")
	require.NoError(t, err)
	exe, err := proc.StatExecutable(bin)
	require.NoError(t, err)
	arg := fmt.Sprintf("3603.%d", os.Getpid())
	id := startSleep(t, arg, true)
	cmdline := fmt.Sprintf("/proc/%d/cmdline", id.PID)
	byArg := func(a []string) bool { return len(a) == 2 && a[1] == arg }

	var empty atomic.Int32
	empty.Store(3)
	loading := func(path string) ([]byte, error) {
		if path == cmdline && empty.Add(-1) >= 0 {
			return nil, nil // the new mm has no arguments yet
		}
		return os.ReadFile(path)
	}
	q := proc.FindQuery{Exe: exe, Comm: proc.CommOf(bin), SessionLeader: true, Argv: byArg, ReadMem: loading}
	got, err := proc.Find(ctxT(t, 10*time.Second), q)
	require.NoError(t, err)
	assert.Equal(t, []proc.Identity{id}, got, "found once its exec is done")

	q.ReadMem = func(path string) ([]byte, error) {
		if path == cmdline {
			return nil, nil
		}
		return os.ReadFile(path)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	got, err = proc.Find(ctx, q)
	require.ErrorIs(t, err, proc.ErrCannotTell, "an exec that never finishes")
	assert.Empty(t, got)
}

// TestChildReapHoldsNoThread: a child's reaper parks in the runtime poller on
// a pidfd; it does not hold an OS thread blocked in waitid for the child's
// life (bench-scale found one thread per VM: 5,385 threads at 5,000 VMs).
func TestChildReapHoldsNoThread(t *testing.T) {
	const children = 200
	before := threadCount(t)
	var kids []*proc.Child
	t.Cleanup(func() {
		for _, c := range kids {
			_ = proc.Signal(c.Identity(), syscall.SIGKILL)
		}
		for _, c := range kids {
			<-c.Done()
		}
	})
	for range children {
		c, err := proc.Start(exec.Command("sleep", "600"))
		require.NoError(t, err)
		kids = append(kids, c)
	}
	// The most threads seen over a moment: a reaper blocked in a syscall
	// gets its thread from the runtime's sysmon, not at once.
	after := 0
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		after = max(after, threadCount(t))
	}
	t.Logf("threads: %d before, %d with %d children alive", before, after, children)
	assert.Less(t, after-before, children/10, "threads grew with the children alive")
	for _, c := range kids {
		_, done := c.Exit()
		assert.False(t, done, "a live child reported done")
	}
	fds := fdCount(t)
	for _, c := range kids {
		require.NoError(t, proc.Signal(c.Identity(), syscall.SIGKILL))
	}
	for _, c := range kids {
		<-c.Done()
	}
	// Each child held two pidfds (the reaper's, os/exec's dup): both are
	// closed by the time Done is.
	assert.LessOrEqual(t, fdCount(t), fds-2*children, "pidfds left open after reaping")
}

func fdCount(t *testing.T) int {
	t.Helper()
	names, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(names)
}

// threadCount is this process's thread count (Threads in /proc/self/status).
func threadCount(t *testing.T) int {
	t.Helper()
	n, err := strconv.Atoi(proctest.Status(t, os.Getpid())["Threads"])
	require.NoError(t, err)
	return n
}
