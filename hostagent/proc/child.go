package proc

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
)

// Exit describes how a child ended.
type Exit struct {
	Code   int           // exit code; -1 when killed by a signal
	Signal string        // the signal that killed it, if any
	At     time.Time     // when the reaper saw it
	Err    error         // a wait error other than a non-zero exit
	Ran    time.Duration // from start to reaping
}

func (e Exit) String() string {
	if e.Signal != "" {
		return "killed by " + e.Signal
	}
	if e.Err != nil {
		return "wait failed: " + e.Err.Error()
	}
	return fmt.Sprintf("exit code %d", e.Code)
}

// Child is a process this one started and reaps. ARCHITECTURE invariant 4: every
// process the agent starts is waited for by the agent while it is the parent,
// so it never lingers as a zombie that looks alive to kill(pid, 0).
type Child struct {
	id      Identity
	started time.Time
	done    chan struct{}

	mu   sync.Mutex
	exit Exit
}

// ErrNeedsWait: proc.Start refuses a command that only cmd.Wait would finish
// (a copy goroutine for a non-file stdin, stdout or stderr; a context to
// watch), as it never calls cmd.Wait.
var ErrNeedsWait = errdefs.InvalidInput.New("command needs exec.Cmd.Wait")

// Start starts cmd in its own session (outliving this process and terminal
// signals), records its identity right after the fork and reaps it in a
// goroutine: watch Done, never call cmd.Wait.
//
// The reaper waits in the runtime's poller on a pidfd made by the fork
// itself (CLONE_PIDFD), not in a thread blocked in waitid: a thousand VMs
// are not a thousand threads. cmd.Process is the reaper's from then on
// (it releases it once it has reaped): signal through a Handle or Signal.
// Stdin, Stdout and Stderr must be nil or files (a StdinPipe is the
// caller's to close), and cmd must carry no context: ErrNeedsWait.
func Start(cmd *exec.Cmd) (*Child, error) {
	if err := waitFree(cmd); err != nil {
		return nil, fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	if cmd.SysProcAttr.PidFD != nil {
		return nil, fmt.Errorf("start %s: SysProcAttr.PidFD is set: the reaper's pidfd is its own", cmd.Path)
	}
	pidfd := -1
	cmd.SysProcAttr.PidFD = &pidfd // os/exec keeps a copy of its own (a dup)
	cmd.SysProcAttr.Setsid = true
	started := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	// The child cannot be reaped before the goroutine below runs, so its
	// /proc entry (a zombie at worst) is there to read.
	id, err := ReadIdentity(cmd.Process.Pid)
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if pidfd >= 0 {
			_ = unix.Close(pidfd)
		}
		return nil, fmt.Errorf("identity of started %s: %w", cmd.Path, err)
	}
	c := &Child{id: id, started: started, done: make(chan struct{})}
	// The reaper keeps the Process, not cmd: a VM's argv and environment
	// (the jail's config among them, ~10 KiB) are not held for its life.
	p := cmd.Process
	if pidfd < 0 {
		// A kernel without CLONE_PIDFD (before 5.2): a thread blocked
		// in wait for the child's life.
		go c.reapBlocking(p)
		return c, nil
	}
	f, err := pollable(pidfd, id.PID)
	if err != nil {
		// Not in the poller (a seccomp filter refusing epoll_ctl, say):
		// reaped the old way rather than not at all.
		go c.reapBlocking(p)
		return c, nil
	}
	go c.reap(p, f)
	return c, nil
}

// pollable makes pidfd a file in the runtime's poller, so a read of it parks
// a goroutine, not a thread; on failure pidfd is closed.
func pollable(pidfd, pid int) (*os.File, error) {
	// Non-blocking, so os.NewFile registers it with the poller.
	if err := unix.SetNonblock(pidfd, true); err != nil {
		_ = unix.Close(pidfd)
		return nil, fmt.Errorf("pidfd of %d: %w", pid, err)
	}
	f := os.NewFile(uintptr(pidfd), "pidfd:"+strconv.Itoa(pid))
	// os.NewFile falls back to blocking I/O when the poller refuses the
	// fd; only a polled file takes a deadline.
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		f.Close()
		return nil, fmt.Errorf("pidfd of %d not in the poller: %w", pid, err)
	}
	return f, nil
}

// waitFree refuses what only cmd.Wait ends: os/exec's copy goroutines (a
// stdin, stdout or stderr that is not a file) and its context watcher.
func waitFree(cmd *exec.Cmd) error {
	for name, s := range map[string]any{"stdin": cmd.Stdin, "stdout": cmd.Stdout, "stderr": cmd.Stderr} {
		switch f := s.(type) {
		case nil:
		case *os.File:
			if f == nil {
				return fmt.Errorf("%s is a nil *os.File: %w", name, ErrNeedsWait)
			}
		default:
			return fmt.Errorf("%s is a %T, not a file: %w", name, s, ErrNeedsWait)
		}
	}
	if cmd.Cancel != nil || cmd.WaitDelay != 0 {
		return fmt.Errorf("a context to watch: %w", ErrNeedsWait)
	}
	return nil
}

// reap parks on the pidfd in the runtime's poller until it is readable, then
// reaps with waitid(P_PIDFD, WNOHANG). A pidfd is readable only once the
// leader has exited and its thread group is empty (pidfd_poll in
// fs/pidfs.c), and waitid never reaps a group leader while other threads
// live (kernel/exit.c): a zombie leader with a live thread is not Done
// (invariant 2).
func (c *Child) reap(p *os.Process, pidfd *os.File) {
	var (
		ws      syscall.WaitStatus
		waitErr error
	)
	rc, err := pidfd.SyscallConn()
	if err == nil {
		err = rc.Read(func(fd uintptr) bool {
			var reaped bool
			reaped, ws, waitErr = waitNoHang(int(fd))
			return reaped || waitErr != nil
		})
	}
	pidfd.Close()
	if err != nil {
		// The poller failed, not the wait: the child may live, so it
		// is reaped the old way rather than reported gone.
		c.reapBlocking(p)
		return
	}
	// os/exec's own pidfd (a dup of ours): nothing waits on it, so
	// nothing else reaps; Release closes it.
	_ = p.Release()
	e := Exit{Code: -1, At: time.Now()}
	e.Ran = e.At.Sub(c.started)
	if waitErr != nil {
		// ECHILD: something else reaped the child.
		e.Err = fmt.Errorf("wait for %v: %w", c.id, waitErr)
	} else {
		e.Code, e.Signal = exitOf(ws)
	}
	c.finish(e)
}

// waitNoHang reaps the child behind pidfd if it is waitable now.
func waitNoHang(pidfd int) (reaped bool, ws syscall.WaitStatus, err error) {
	var info siginfoChild
	for {
		err = unix.Waitid(unix.P_PIDFD, pidfd, (*unix.Siginfo)(unsafe.Pointer(&info)), unix.WEXITED|unix.WNOHANG, nil)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		return false, 0, fmt.Errorf("waitid: %w", err)
	}
	if info.Pid == 0 {
		return false, 0, nil // not waitable yet (WNOHANG)
	}
	return true, info.waitStatus(), nil
}

// siginfoChild is siginfo_t as waitid fills it for a child (64-bit layout:
// the union begins after a pad), as internal/syscall/unix has it.
type siginfoChild struct {
	Signo  int32
	Errno  int32
	Code   int32
	_      [is64bit]int32
	Pid    int32
	UID    uint32
	Status int32
	_      [128 - (6+is64bit)*4]byte
}

const is64bit = int(^uintptr(0) >> 63)

// si_code values of SIGCHLD (include/uapi/asm-generic/siginfo.h).
const (
	cldExited = 1
	cldKilled = 2
	cldDumped = 3
)

var _ [128 - unsafe.Sizeof(siginfoChild{})]byte // not larger than siginfo_t
var _ [unsafe.Sizeof(siginfoChild{}) - 128]byte // nor smaller
var _ [unsafe.Sizeof(unix.Siginfo{}) - 128]byte // x/sys's is siginfo_t too

// waitStatus is the status wait4 would have given.
func (s siginfoChild) waitStatus() syscall.WaitStatus {
	switch s.Code {
	case cldExited:
		return syscall.WaitStatus(s.Status << 8)
	case cldKilled:
		return syscall.WaitStatus(s.Status)
	case cldDumped:
		return syscall.WaitStatus(s.Status) | 0x80
	}
	return syscall.WaitStatus(s.Status << 8)
}

// exitOf is Exit's code and signal for a wait status.
func exitOf(ws syscall.WaitStatus) (code int, signal string) {
	if ws.Signaled() {
		return -1, ws.Signal().String()
	}
	return ws.ExitStatus(), ""
}

// reapBlocking is the reaper without a pidfd in the poller: Process.Wait, a
// thread blocked in waitid until the whole group is gone. (waitFree made
// sure cmd.Wait would have had nothing more to do.)
func (c *Child) reapBlocking(p *os.Process) {
	ps, err := p.Wait()
	e := Exit{Code: -1, At: time.Now()}
	e.Ran = e.At.Sub(c.started)
	if err != nil {
		// ECHILD: something else reaped the child.
		e.Err = err
	}
	if ps != nil {
		if ws, ok := ps.Sys().(syscall.WaitStatus); ok {
			e.Code, e.Signal = exitOf(ws)
		}
	}
	c.finish(e)
}

func (c *Child) finish(e Exit) {
	c.mu.Lock()
	c.exit = e
	c.mu.Unlock()
	close(c.done)
}

// Identity returns the child's identity, read right after the fork.
func (c *Child) Identity() Identity { return c.id }

// Done is closed once the child has been reaped.
func (c *Child) Done() <-chan struct{} { return c.done }

// Exit returns how the child ended; ok is false while it has not.
func (c *Child) Exit() (e Exit, ok bool) {
	select {
	case <-c.done:
	default:
		return Exit{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.exit, true
}
