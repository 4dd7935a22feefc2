package proc

import (
	"errors"
	"fmt"
	"os/exec"
	"sync"
	"syscall"
	"time"
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

// Start starts cmd in its own session (outliving this process and terminal
// signals), records its identity right after the fork and reaps it in a
// goroutine: watch Done, never call cmd.Wait.
func Start(cmd *exec.Cmd) (*Child, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
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
		return nil, fmt.Errorf("identity of started %s: %w", cmd.Path, err)
	}
	c := &Child{id: id, started: started, done: make(chan struct{})}
	go c.reap(cmd)
	return c, nil
}

func (c *Child) reap(cmd *exec.Cmd) {
	// cmd.Wait uses waitid(P_PIDFD) since Go 1.23: like wait4, it does not
	// reap a leader while other tasks of its group live, so it returns when
	// the whole group is gone.
	err := cmd.Wait()
	e := Exit{Code: -1, At: time.Now()}
	e.Ran = e.At.Sub(c.started)
	var exitErr *exec.ExitError
	if err != nil && !errors.As(err, &exitErr) {
		e.Err = err
	}
	// ProcessState is nil when wait itself failed (ECHILD: something else
	// reaped the child).
	if ps := cmd.ProcessState; ps != nil {
		e.Code = ps.ExitCode()
		if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			e.Signal = ws.Signal().String()
		}
	}
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
