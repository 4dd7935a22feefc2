package proc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultPollInterval is how often the /proc fallback looks again.
const DefaultPollInterval = 10 * time.Millisecond

type options struct {
	forcePoll    bool
	pollInterval time.Duration
	// beforePidfd runs right before pidfd_open: the window in which the
	// recorded process may die and its pid go to a stranger. Tests reuse
	// the pid there to prove Open verifies after opening (export_test.go).
	beforePidfd func()
}

// Option changes how Open watches a process.
type Option func(*options)

// WithPolling makes the handle poll /proc, as it does without pidfd_open, for
// tests of that path.
func WithPolling() Option { return func(o *options) { o.forcePoll = true } }

// WithPollInterval sets the /proc polling interval of the fallback path.
func WithPollInterval(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.pollInterval = d
		}
	}
}

// Handle watches and signals one process, bound to its identity.
//
// With a pidfd (Linux 5.3+) the handle cannot be redirected to a process
// that later reuses the pid: the fd pins the original process, and Open
// re-verifies the identity after opening it. Without one, every Signal
// re-verifies the identity right before kill(2), which narrows the reuse
// race to microseconds but cannot close it.
type Handle struct {
	id   Identity
	opts options

	pidfd  *os.File // nil on the polling path
	waitMu sync.Mutex
}

// Open returns a handle on the process id names: ErrNotFound when gone,
// ErrIdentityMismatch when another holds the pid. It never signals.
func Open(id Identity, opts ...Option) (*Handle, error) {
	h := &Handle{id: id, opts: options{pollInterval: DefaultPollInterval}}
	for _, o := range opts {
		o(&h.opts)
	}
	if !id.Valid() {
		return nil, fmt.Errorf("open %v: %w", id, ErrIncompleteIdentity)
	}
	if !h.opts.forcePoll {
		if h.opts.beforePidfd != nil {
			h.opts.beforePidfd()
		}
		fd, err := unix.PidfdOpen(id.PID, unix.PIDFD_NONBLOCK)
		switch {
		case err == nil:
			// A non-blocking fd is registered with Go's netpoller, so Wait
			// parks on epoll instead of burning a thread.
			h.pidfd = os.NewFile(uintptr(fd), fmt.Sprintf("pidfd:%d", id.PID))
		case errors.Is(err, unix.ESRCH):
			return nil, fmt.Errorf("open %v: %w", id, ErrNotFound)
		case errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL):
			// No pidfds (kernel < 5.3, or PIDFD_NONBLOCK unknown before 5.10):
			// fall back to /proc polling.
		default:
			return nil, fmt.Errorf("pidfd_open %v: %w", id, err)
		}
	}
	// Verify after opening: if the pid was reused between the caller reading
	// the record and pidfd_open, the start time now differs and the fd,
	// bound to a stranger, is closed unused.
	if err := Verify(id); err != nil {
		h.Close()
		return nil, fmt.Errorf("open: %w", err)
	}
	return h, nil
}

// Identity returns the identity the handle is bound to.
func (h *Handle) Identity() Identity { return h.id }

// UsesPidfd reports whether the handle is event driven (pidfd) rather than polling.
func (h *Handle) UsesPidfd() bool { return h.pidfd != nil }

// Close releases the pidfd. It does not affect the process.
func (h *Handle) Close() error {
	if h.pidfd == nil {
		return nil
	}
	return h.pidfd.Close()
}

// Status reports the liveness of the thread group now.
func (h *Handle) Status() Status { return Inspect(h.id) }

// Exited reports, without blocking, whether the whole thread group is gone.
func (h *Handle) Exited() (bool, error) {
	if h.pidfd == nil {
		st := Inspect(h.id)
		return st.State == StateExited, nil
	}
	var ready bool
	var perr error
	rc, err := h.pidfd.SyscallConn()
	if err != nil {
		return false, fmt.Errorf("pidfd of %v: %w", h.id, err)
	}
	if err := rc.Control(func(fd uintptr) { ready, perr = pidfdReady(fd) }); err != nil {
		return false, fmt.Errorf("pidfd of %v: %w", h.id, err)
	}
	return ready, perr
}

// pidfdReady polls a pidfd without blocking; it is readable only once the
// whole thread group is gone (pidfd_poll in fs/pidfs.c): VMM and workers.
func pidfdReady(fd uintptr) (bool, error) {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return false, fmt.Errorf("poll pidfd: %w", err)
		}
		return n > 0 && fds[0].Revents&(unix.POLLIN|unix.POLLHUP) != 0, nil
	}
}

// Wait blocks until the whole thread group exited or ctx is done; it never
// calls wait(2), so it works for non-children and reaps nothing.
func (h *Handle) Wait(ctx context.Context) error {
	h.waitMu.Lock()
	defer h.waitMu.Unlock()
	if h.pidfd == nil {
		return h.waitPoll(ctx)
	}
	return h.waitPidfd(ctx)
}

func (h *Handle) waitPidfd(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	rc, err := h.pidfd.SyscallConn()
	if err != nil {
		return fmt.Errorf("pidfd of %v: %w", h.id, err)
	}
	// A cancelled context moves the read deadline into the past, which wakes
	// the parked Read below with os.ErrDeadlineExceeded.
	if err := h.pidfd.SetReadDeadline(time.Time{}); err != nil {
		return fmt.Errorf("pidfd of %v: %w", h.id, err)
	}
	stop := context.AfterFunc(ctx, func() { _ = h.pidfd.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()

	var perr error
	err = rc.Read(func(fd uintptr) bool {
		var ready bool
		ready, perr = pidfdReady(fd)
		return ready || perr != nil
	})
	if perr != nil {
		return perr
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
	}
	if err != nil {
		return fmt.Errorf("wait on pidfd of %v: %w", h.id, err)
	}
	return nil
}

func (h *Handle) waitPoll(ctx context.Context) error {
	t := time.NewTicker(h.opts.pollInterval)
	defer t.Stop()
	for {
		// Unknown counts as alive: keep looking rather than guess.
		if Inspect(h.id).State == StateExited {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Signal sends sig through the pidfd, which cannot reach a pid's new owner (the
// polling path verifies right before kill); ErrNotFound once exited.
func (h *Handle) Signal(sig syscall.Signal) error {
	if h.pidfd == nil {
		if err := Verify(h.id); err != nil {
			return fmt.Errorf("signal %v: %w", h.id, err)
		}
		if err := unix.Kill(h.id.PID, sig); err != nil {
			if errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("signal %v: %w", h.id, ErrNotFound)
			}
			return fmt.Errorf("signal %v: %w", h.id, err)
		}
		return nil
	}
	rc, err := h.pidfd.SyscallConn()
	if err != nil {
		return fmt.Errorf("signal %v: %w", h.id, err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.PidfdSendSignal(int(fd), sig, nil, 0) }); err != nil {
		return fmt.Errorf("signal %v: %w", h.id, err)
	}
	if errors.Is(serr, unix.ESRCH) {
		return fmt.Errorf("signal %v: %w", h.id, ErrNotFound)
	}
	if serr != nil {
		return fmt.Errorf("pidfd_send_signal %v: %w", h.id, serr)
	}
	return nil
}

// Signal opens a handle on id, sends sig and closes the handle: the one-shot
// form for callers that hold only a record.
func Signal(id Identity, sig syscall.Signal) error {
	h, err := Open(id)
	if err != nil {
		return err
	}
	defer h.Close()
	return h.Signal(sig)
}
