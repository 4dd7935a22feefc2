// Package proctest makes the real processes that process-level tests need:
// a zombie thread-group leader with a live thread (what a QEMU whose leader
// exited while vhost or KVM workers run looks like), observed as a child or
// from a process that is not its parent.
//
// The test binary re-executes itself: call RunHelperIfRequested first thing
// in TestMain.
package proctest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"vmflow/hostagent/proc"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The test binary re-executes itself as the processes the tests need:
// real zombie leaders with live threads, and their parents.
const (
	helperEnv     = "VMFLOW_PROC_HELPER"
	HoldFileEnv   = "VMFLOW_PROC_HOLD_FILE" // a path the zombie helper keeps open
	helperZombie  = "zombie-leader"         // leader exits with SYS_exit, one thread lives until stdin closes
	helperParent  = "zombie-parent"         // starts a zombie-leader grandchild, prints its pid, reaps it
	helperHolders = "holders"               // prints proc.Holders(os.Args[last]) as seen by this (unprivileged) process
	helperCrowd   = "crowd"                 // CrowdThreadsEnv threads, CrowdFDsEnv open fds, until stdin closes
	// CrowdThreadsEnv and CrowdFDsEnv shape a crowd helper; with
	// HoldFileEnv set, one more thread holds that file in an fd table of
	// its own (unshare(CLONE_FILES)).
	CrowdThreadsEnv = "VMFLOW_PROC_CROWD_THREADS"
	CrowdFDsEnv     = "VMFLOW_PROC_CROWD_FDS"
	exitLinePrefix  = "exit "
)

func init() {
	// Lock the main goroutine to the main thread (the thread group leader)
	// before anything else runs, so the zombie helper can end exactly that
	// thread and no other.
	if os.Getenv(helperEnv) == helperZombie {
		runtime.LockOSThread()
	}
}

// RunHelperIfRequested turns this process into the helper named in its
// environment and never returns; in a normal test run it returns at once.
func RunHelperIfRequested() {
	switch os.Getenv(helperEnv) {
	case "":
		return
	case helperZombie:
		runZombieLeader()
	case helperParent:
		runZombieParent()
	case helperHolders:
		runHolders()
	case helperCrowd:
		runCrowd()
	default:
		fmt.Fprintln(os.Stderr, "unknown helper", os.Getenv(helperEnv))
		os.Exit(2)
	}
}

// runZombieLeader becomes a zombie leader with one live thread, which writes
// the CLOCK_MONOTONIC time and exits the group at stdin's EOF (for benchmarks).
func runZombieLeader() {
	if p := os.Getenv(HoldFileEnv); p != "" {
		if _, err := os.Open(p); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
	}
	go func() {
		runtime.LockOSThread() // a thread of its own, like a vhost worker
		_, _ = io.Copy(io.Discard, os.Stdin)
		var ts unix.Timespec
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
		fmt.Fprintf(os.Stdout, "%s%d\n", exitLinePrefix, ts.Nano())
		os.Exit(0)
	}()
	// End only the leader thread: exit(2), not exit_group(2). syscall.Syscall
	// (not RawSyscall) marks the goroutine as in a syscall, so the runtime on
	// the other threads never waits for this one again.
	_, _, _ = syscall.Syscall(syscall.SYS_EXIT, 0, 0, 0)
	select {} // unreachable
}

func runZombieParent() {
	cmd := exec.Command(os.Args[0], os.Args[1:]...)
	cmd.Env = append(os.Environ(), helperEnv+"="+helperZombie)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	fmt.Fprintf(os.Stdout, "pid %d\n", cmd.Process.Pid)
	_ = cmd.Wait()
	os.Exit(0)
}

func runHolders() {
	hs, err := proc.Holders(context.Background(), os.Args[len(os.Args)-1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	_ = json.NewEncoder(os.Stdout).Encode(hs)
	os.Exit(0)
}

// runCrowd is like a busy QEMU: many threads sharing one fd table, optionally
// one with its own holding HoldFileEnv. Prints "ready", exits when stdin closes.
func runCrowd() {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	threads, err1 := strconv.Atoi(os.Getenv(CrowdThreadsEnv))
	fds, err2 := strconv.Atoi(os.Getenv(CrowdFDsEnv))
	if err := errors.Join(err1, err2); err != nil {
		fail(err)
	}
	for range fds {
		if _, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
			fail(err)
		}
	}
	started := make(chan int)
	for range threads {
		go func() {
			runtime.LockOSThread() // a thread of its own, never given back
			started <- unix.Gettid()
			select {}
		}()
	}
	for range threads {
		<-started
	}
	private := 0
	if p := os.Getenv(HoldFileEnv); p != "" {
		go func() {
			runtime.LockOSThread()
			if err := unix.Unshare(unix.CLONE_FILES); err != nil {
				fail(err)
			}
			if _, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
				fail(err)
			}
			started <- unix.Gettid()
			select {}
		}()
		private = <-started
	}
	fmt.Fprintf(os.Stdout, "ready %d\n", private)
	_, _ = io.Copy(io.Discard, os.Stdin)
	os.Exit(0)
}

// Crowd is a running crowd helper.
type Crowd struct {
	PID int
	// PrivateTID is the thread holding HoldFileEnv in a table of its own
	// (0 without one).
	PrivateTID int
}

// StartCrowd starts a crowd helper with threads threads and fds descriptors,
// ended and reaped at cleanup; extraEnv may add HoldFileEnv.
func StartCrowd(t testing.TB, threads, fds int, extraEnv ...string) Crowd {
	t.Helper()
	cmd := helperCmd(helperCrowd, append([]string{CrowdThreadsEnv + "=" + strconv.Itoa(threads),
		CrowdFDsEnv + "=" + strconv.Itoa(fds)}, extraEnv...)...)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	child, stdout := startWithStdout(t, cmd)
	t.Cleanup(func() {
		_ = stdin.Close()
		<-child.Done()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err)
	tid, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "ready ")))
	require.NoError(t, err, "crowd helper said %q", line)
	return Crowd{PID: child.Identity().PID, PrivateTID: tid}
}

// HoldersAs runs proc.Holders(path) in a copy of the test binary running as
// uid:gid, to see what an unprivileged scanner makes of this process's files.
func HoldersAs(t testing.TB, uid, gid uint32, path string) []proc.Holder {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "holders")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	self, err := os.ReadFile(os.Args[0])
	require.NoError(t, err)
	bin := filepath.Join(dir, "helper.test")
	require.NoError(t, os.WriteFile(bin, self, 0o755))

	cmd := exec.Command(bin, "-test.run=^$", path)
	cmd.Env = append(os.Environ(), helperEnv+"="+helperHolders)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	require.NoError(t, err)
	var hs []proc.Holder
	require.NoError(t, json.Unmarshal(out, &hs), "%s", out)
	return hs
}

// Zombie is a running zombie-leader helper.
type Zombie struct {
	PID    int // the helper: a zombie leader until Release
	stdin  io.WriteCloser
	stdout *bufio.Reader
	child  *proc.Child // set when this test process is the parent
}

// Release lets the helper's last thread exit and returns the CLOCK_MONOTONIC
// time at which it did.
func (z *Zombie) Release(t testing.TB) time.Duration {
	t.Helper()
	require.NoError(t, z.stdin.Close())
	for {
		line, err := z.stdout.ReadString('\n')
		require.NoError(t, err, "reading helper's exit line")
		if ns, ok := strings.CutPrefix(strings.TrimSpace(line), exitLinePrefix); ok {
			v, err := strconv.ParseInt(ns, 10, 64)
			require.NoError(t, err)
			return time.Duration(v)
		}
	}
}

// Child is the helper as this process's child, nil for a foreign zombie.
func (z *Zombie) Child() *proc.Child { return z.child }

func helperCmd(mode string, extraEnv ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	// Under -race the runtime sleeps 1 s at exit (TSAN's atexit_sleep_ms),
	// which would pass for slow exit detection.
	cmd.Env = append(append(os.Environ(), helperEnv+"="+mode, "GORACE=atexit_sleep_ms=0"), extraEnv...)
	cmd.Stderr = os.Stderr
	return cmd
}

// ZombieCommand is StartZombie's unstarted command, for callers without a
// testing.TB (rapid): start it with proc.Start and a stdin pipe, close to end.
func ZombieCommand(extraEnv ...string) *exec.Cmd { return helperCmd(helperZombie, extraEnv...) }

// StartZombie starts a zombie-leader helper as a child of this process and
// waits until its leader is a zombie.
func StartZombie(t testing.TB, extraEnv ...string) *Zombie {
	t.Helper()
	cmd := helperCmd(helperZombie, extraEnv...)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	child, stdout := startWithStdout(t, cmd)
	z := &Zombie{PID: child.Identity().PID, stdin: stdin, stdout: bufio.NewReader(stdout), child: child}
	t.Cleanup(func() {
		_ = stdin.Close()
		select {
		case <-child.Done():
		case <-time.After(10 * time.Second):
			t.Errorf("zombie helper %d not reaped", z.PID)
		}
	})
	waitZombieLeader(t, z.PID)
	return z
}

// StartForeignZombie starts a zombie-leader helper as a grandchild, so this
// process is not its parent and wait(2) on it would fail with ECHILD.
func StartForeignZombie(t testing.TB) *Zombie {
	t.Helper()
	cmd := helperCmd(helperParent)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	parent, stdout := startWithStdout(t, cmd)
	t.Cleanup(func() {
		_ = stdin.Close()
		<-parent.Done()
	})
	r := bufio.NewReader(stdout)
	line, err := r.ReadString('\n')
	require.NoError(t, err)
	pid, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "pid ")))
	require.NoError(t, err, "parent helper said %q", line)
	waitZombieLeader(t, pid)
	return &Zombie{PID: pid, stdin: stdin, stdout: r}
}

// startWithStdout starts cmd with its stdout on a pipe of this process's,
// so the exit line stays readable after reaping.
func startWithStdout(t testing.TB, cmd *exec.Cmd) (*proc.Child, *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	cmd.Stdout = w
	child, err := proc.Start(cmd)
	w.Close() // the child has its own copy now
	require.NoError(t, err)
	return child, r
}

func waitZombieLeader(t testing.TB, pid int) {
	t.Helper()
	require.Eventually(t, func() bool {
		st, err := proc.ReadStat(pid)
		return err == nil && st.State == 'Z'
	}, 10*time.Second, time.Millisecond, "pid %d never became a zombie leader", pid)
}

// LiveTasks lists the tasks of pid's group that are not zombies.
func LiveTasks(pid int) []string {
	var live []string
	paths, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		st, err := proc.ParseStat(b)
		if err == nil && st.State != 'Z' && st.State != 'X' {
			live = append(live, fmt.Sprintf("%d(%s,%c)", st.PID, st.Comm, st.State))
		}
	}
	return live
}

func MonotonicNow() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return time.Duration(ts.Nano())
}

// Status returns the fields of /proc/<pid>/status by name, each value with
// its runs of blanks made single spaces.
func Status(tb testing.TB, pid int) map[string]string {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		tb.Fatal(err)
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			out[k] = strings.Join(strings.Fields(v), " ")
		}
	}
	return out
}

// KillGroupOnCleanup kills c's process group when tb ends and reaps what this
// subreaper inherits of it (a dead wrapper's QEMU).
func KillGroupOnCleanup(tb testing.TB, c *proc.Child) {
	tb.Cleanup(func() {
		_ = syscall.Kill(-c.Identity().PID, syscall.SIGKILL)
		<-c.Done()
		for {
			var ws unix.WaitStatus
			if _, err := unix.Wait4(-c.Identity().PID, &ws, 0, nil); err != nil {
				return // ECHILD: none left (or not ours)
			}
		}
	})
}
