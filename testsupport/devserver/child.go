package devserver

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// child is one long-running process a test server owns (the Temporal
// server, PostgreSQL): started with its output in a log file, reaped by one
// goroutine, stopped with a signal and a grace period.
type child struct {
	name string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has been reaped
	werr error         // cmd.Wait's result, valid after done
	log  *os.File
}

// startChild starts cmd, output appended to logPath, so it dies with the test
// binary (PR_SET_PDEATHSIG, which Go sets after cred's change of user) rather
// than hold ports and files for the next run.
func startChild(name string, cmd *exec.Cmd, logPath string, cred *syscall.Credential) (*child, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Credential: cred}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, done: make(chan struct{}), log: logf}
	go func() {
		err := cmd.Wait()
		c.mu.Lock()
		c.werr = err
		c.mu.Unlock()
		close(c.done)
	}()
	return c, nil
}

// exited is closed once the process has been reaped.
func (c *child) exited() <-chan struct{} { return c.done }

// waitErr is cmd.Wait's result once exited is closed.
func (c *child) waitErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.werr
}

// pid is the process id.
func (c *child) pid() int { return c.cmd.Process.Pid }

// running reports whether the process is still alive (not yet reaped).
func (c *child) running() bool {
	select {
	case <-c.done:
		return false
	default:
		return true
	}
}

// stop sends sig, then SIGKILL if the process has not exited within grace,
// and waits until it is reaped. Stopping a stopped child is a no-op.
func (c *child) stop(sig syscall.Signal, grace time.Duration) error {
	c.mu.Lock()
	logf := c.log
	c.log = nil
	c.mu.Unlock()
	if logf == nil {
		return nil
	}
	defer func() { _ = logf.Close() }()
	if !c.running() {
		return nil
	}
	if err := c.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("%s: signal %v: %w", c.name, sig, err)
	}
	timer := time.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-c.done:
		return nil
	case <-timer.C:
	}
	if err := c.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("%s: SIGKILL: %w", c.name, err)
	}
	reap := time.NewTimer(15 * time.Second)
	defer reap.Stop()
	select {
	case <-c.done:
		return nil
	case <-reap.C:
		return fmt.Errorf("%s pid %d not reaped 15 s after SIGKILL", c.name, c.pid())
	}
}
