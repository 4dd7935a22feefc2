package vmm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/internal/crashpoint"
)

// Defaults for LaunchConfig.
const (
	DefaultBinary         = "qemu-system-x86_64"
	DefaultReadyTimeout   = 10 * time.Second
	DefaultCleanupTimeout = 30 * time.Second
)

// logTailBytes is how much of qemu.log a launch error quotes.
const logTailBytes = 2048

// socketPollInterval is how often Launch looks for the QMP socket. QEMU
// creates it ~40-150 ms after the fork; there is no event for "a socket
// appeared", and an exit ends the wait at once through the reaper.
const socketPollInterval = 5 * time.Millisecond

// exitGrace is how long a launch whose QMP handshake broke waits for QEMU's
// exit before it reports the QMP error instead.
const exitGrace = 500 * time.Millisecond

// LaunchConfig is what Launch needs.
type LaunchConfig struct {
	// Spec is QEMU's spec. Launch owns its files (kernel, initrd, disk)
	// and closes them before it returns, whatever happens.
	Spec  VMSpec
	Paths Paths // Log is required

	// Binary is the QEMU executable; DefaultBinary looked up in PATH when empty.
	Binary string
	// ReadyTimeout bounds the wait from the fork to QMP reporting
	// "running" (socket, greeting, capabilities, query-status).
	ReadyTimeout time.Duration
	// CleanupTimeout bounds kill-and-reap of a failed launch.
	CleanupTimeout time.Duration

	// Confine is how QEMU is confined: its own uid (required), /dev/kvm's
	// group. See confine.go.
	Confine Confinement

	// OnStarted is called right after the fork, before anything waits on
	// QEMU, so the caller can record the pid and start time: an agent
	// killed at any later instant leaves no QEMU that no record knows. An
	// error fails the launch (QEMU is killed and reaped).
	OnStarted func(proc.Identity) error
	// OnFailed is called once on every failed launch, after QEMU has been
	// killed and reaped and the socket removed, and before Launch returns,
	// so the caller clears the recorded pid (invariant 5). id is zero when
	// QEMU never started. cause is the error Launch is about to return. It is
	// NOT called when QEMU could not be confirmed gone (*StillAliveError):
	// then the record must keep the pid so a stop can finish the job.
	OnFailed func(id proc.Identity, cause error) error
	// FDStore, when set, keeps a copy of the log pipe's read end for the
	// next agent (systemd's fd store) under LogFDName(Spec.Name,
	// Confine.UID), so a restart loses nothing the pipe holds.
	FDStore FDStore
	// Mark, when set, is called as the launch enters each of its timed
	// steps (LaunchStep*), for the caller's timeline of where a launch's
	// time goes; OnStarted's work falls between clone and the next mark.
	Mark func(step string)
}

// The steps LaunchConfig.Mark names, in order; each lasts until the next
// mark (the caller's, after OnStarted, included).
const (
	// LaunchStepClone: the fork (clone with its pidfd) of the jail's
	// setup stage or the rlimit wrapper.
	LaunchStepClone = "clone"
	// LaunchStepCgroup: the VM's cgroup made, limited and given the pid.
	LaunchStepCgroup = "cgroup"
	// LaunchStepToQMP: the go-ahead to the jail's setup stage (its root
	// built, QEMU exec'd), QEMU's start until its QMP greeting and
	// qmp_capabilities answered.
	LaunchStepToQMP = "exec to QMP"
	// LaunchStepStatus: query-status.
	LaunchStepStatus = "query-status"
)

// mark tells cfg.Mark that step begins.
func (cfg *LaunchConfig) mark(step string) {
	if cfg.Mark != nil {
		cfg.Mark(step)
	}
}

// VM is a running QEMU: either one this process launched (a child it reaps)
// or one it attached to after a restart (only its identity known).
type VM struct {
	id    proc.Identity
	child *proc.Child // nil when attached
	h     *proc.Handle
	paths Paths

	mu   sync.Mutex
	mon  *Monitor
	glog *GuestLog // the guest-output pump; nil when not capturing

	violations chan error    // QMP protocol violations not yet taken (QMPViolation)
	closed     chan struct{} // closed by Close
	closeOnce  sync.Once

	// fdStore and fdName: where a copy of the log pipe's read end is kept
	// for the next agent (UseFDStore, LaunchConfig.FDStore); nil for none.
	fdStore FDStore
	fdName  string
}

func newVM(id proc.Identity, child *proc.Child, h *proc.Handle, paths Paths, violations chan error) *VM {
	if violations == nil {
		violations = make(chan error, 1)
	}
	return &VM{id: id, child: child, h: h, paths: paths, violations: violations, closed: make(chan struct{})}
}

// reportTo is a Monitor's onViolation that leaves the violation in ch
// unless one is already waiting there: one is enough to mark the VM.
func reportTo(ch chan error) func(error) {
	return func(err error) {
		select {
		case ch <- err:
		default:
		}
	}
}

// Launch starts QEMU for cfg.Spec in its own session, output through a pipe
// into the bounded log, and returns once QMP says running; on failure nothing
// remains (invariant 5). Retryable with the same paths. QEMU outlives ctx.
func Launch(ctx context.Context, cfg LaunchConfig) (*VM, error) {
	// The agent's copies of the images are not needed past the fork (QEMU
	// has its own) nor by a launch that never forks.
	defer cfg.Spec.Close()
	l := &launch{cfg: cfg}
	vm, err := l.run(ctx)
	if err != nil {
		return nil, l.fail(err)
	}
	return vm, nil
}

type launch struct {
	cfg   LaunchConfig
	child *proc.Child
	h     *proc.Handle
	mon   *Monitor
	glog  *GuestLog
	// violations receives QMP protocol violations of the launch's
	// monitor; the VM takes it over.
	violations chan error
	// socketOwned: the socket path was free (or stale) when the launch
	// began, so whatever is there at failure time belongs to this QEMU.
	socketOwned bool
	// cgroupPlaced: Place was called; a failed launch removes the cgroup.
	cgroupPlaced bool
	// goAhead and syncRead are the jail's sync pipe: the setup stage reads
	// one byte from its copy of syncRead before it builds the root; closing
	// goAhead without writing stops it.
	goAhead, syncRead *os.File
}

func (l *launch) run(ctx context.Context) (*VM, error) {
	cfg := l.cfg
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("launch: %w", err) // never fork for a caller that gave up
	}
	// Every file QEMU gets by number is in fds: ExtraFiles[i] is its fd 3+i.
	fds := &FDTable{}
	defer fds.Close()
	argv, err := BuildArgv(cfg.Spec, cfg.Paths, fds)
	if err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	if cfg.Paths.Log == "" {
		return nil, fmt.Errorf("launch: %w", invalid("log path is required"))
	}
	if err := cfg.Confine.check(cfg.Spec.Accel); err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	bin, err := resolveBinary(cfg.Binary)
	if err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	if err := RemoveStaleSocket(ctx, cfg.Paths.QMPSocket); err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	l.socketOwned = true
	qmpListener, err := viaShortPath(cfg.Paths.QMPSocket, listenQMP)
	if err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	// From here the table owns the listener (closed with it, on every path).
	if err := fds.Fill(QMPFD, qmpListener); err != nil {
		qmpListener.Close()
		return nil, fmt.Errorf("launch: %w", err)
	}
	limits, err := LimitsFor(cfg.Spec)
	if err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	cgLimits, err := cgroupLimitsOf(cfg.Spec)
	if err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	if len(cgLimits.IODevices) > 0 && cfg.Confine.Cgroups == nil {
		return nil, fmt.Errorf("launch: %w: no cgroup per VM on this host", ErrIOUnbounded)
	}
	var cmd *exec.Cmd
	if j := cfg.Confine.Jail; j != nil {
		// QEMU is exec'd by the setup stage (jail.go) in its namespaces
		// and root, which waits for l.goAhead.
		if cmd, err = l.jailCmd(*j, bin, argv, limits, fds.Files()); err != nil {
			return nil, fmt.Errorf("launch: %w", err)
		}
	} else {
		// QEMU is exec'd by the rlimit wrapper, which is exec'd as QEMU's
		// uid: the process is the wrapper for the time of one exec, then
		// QEMU with its own argv[0] and argv (FindUnrecorded looks for
		// both).
		wrapper, err := exec.LookPath(LimitWrapper)
		if err != nil {
			return nil, fmt.Errorf("launch: %w", err)
		}
		cmd = &exec.Cmd{Path: wrapper, Args: wrapperArgs(limits, bin, argv)}
		confineCmd(cmd, cfg.Confine, cfg.Spec.Accel, fds.Files())
	}
	out, err := l.setGuestOutput(cmd)
	if err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	if err := closeInheritedOnExec(); err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	crashpoint.Hit(crashpoint.LaunchBeforeFork)
	cfg.mark(LaunchStepClone)
	var child *proc.Child
	start := func() (err error) { child, err = proc.Start(cmd); return err }
	if cfg.Confine.Jail == nil {
		// The jail's setup stage installs the seccomp allowlist itself;
		// unjailed, the fork inherits it from a filtered thread.
		err = startConfined(start)
	} else {
		err = start()
	}
	out.Close() // QEMU holds the write end now; the pump sees EOF when QEMU is gone
	// QEMU has its own copies from the fork on (the QMP listener among
	// them: a QEMU that dies leaves no listener behind a pending dial): the
	// agent must not hold every VM's images for its life.
	_ = fds.Close()
	if l.syncRead != nil {
		l.syncRead.Close() // the setup stage has its own
	}
	if err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	l.child = child
	id := child.Identity()
	crashpoint.Hit(crashpoint.LaunchForked)

	if cfg.OnStarted != nil {
		if err := cfg.OnStarted(id); err != nil {
			return nil, fmt.Errorf("launch %v: OnStarted: %w: %w", id, ErrHook, err)
		}
	}

	crashpoint.Hit(crashpoint.LaunchPIDRecorded)
	if cg := cfg.Confine.Cgroups; cg != nil {
		cfg.mark(LaunchStepCgroup)
		// After the pid is recorded, before QEMU has built its machine:
		// the wrapper's exec and QEMU's first instructions run in the
		// agent's cgroup, guest RAM is allocated in the VM's.
		l.cgroupPlaced = true
		if err := cg.Place(ctx, CgroupName(cfg.Spec.Name, cfg.Confine.UID), id.PID, cgLimits); err != nil {
			return nil, l.failedOrExited(id, fmt.Errorf("launch %v: %w", id, err))
		}
	}
	cfg.mark(LaunchStepToQMP)
	if l.goAhead != nil {
		// Recorded and placed: the setup stage may build the root and
		// exec QEMU.
		_, err := l.goAhead.Write([]byte{1})
		l.goAhead.Close()
		l.goAhead = nil
		if err != nil {
			return nil, l.failedOrExited(id, fmt.Errorf("launch %v: tell the jail's setup stage to go on: %w", id, err))
		}
	}
	h, err := proc.Open(id)
	if err != nil {
		// Gone already (reaped by proc's reaper, the pid maybe even
		// reused): report how it ended.
		if errors.Is(err, proc.ErrNotFound) || errors.Is(err, proc.ErrIdentityMismatch) {
			return nil, l.exitedError(id)
		}
		return nil, fmt.Errorf("launch %v: %w", id, err)
	}
	l.h = h

	timeout := cfg.ReadyTimeout
	if timeout <= 0 {
		timeout = DefaultReadyTimeout
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	mon, err := l.waitQMP(rctx)
	if err != nil {
		return nil, err
	}
	l.mon = mon
	cfg.mark(LaunchStepStatus)
	st, err := mon.Status(rctx)
	if err != nil {
		if l.exited() {
			return nil, l.exitedError(id)
		}
		return nil, fmt.Errorf("launch %v: %w", id, err)
	}
	if !st.Running {
		return nil, fmt.Errorf("launch %v: query-status is %q: %w", id, st.Status, ErrNotRunning)
	}
	crashpoint.Hit(crashpoint.LaunchQMPReady)
	vm := newVM(id, child, h, cfg.Paths, l.violations)
	vm.mon, vm.glog = mon, l.glog
	if cfg.FDStore != nil {
		vm.fdStore, vm.fdName = cfg.FDStore, LogFDName(cfg.Spec.Name, cfg.Confine.UID)
	}
	return vm, nil
}

// setGuestOutput pipes QEMU's stdout and stderr into the bounded log
// (guestOutput) and returns the parent's write end to close after the fork;
// the pump is l's to stop on failure.
func (l *launch) setGuestOutput(cmd *exec.Cmd) (*os.File, error) {
	w, g, err := guestOutput(l.cfg.Paths.Log)
	if err != nil {
		return nil, err
	}
	l.glog = g
	if st := l.cfg.FDStore; st != nil {
		// Before the fork: a QEMU never runs without a stored reader.
		if err := st.Store(LogFDName(l.cfg.Spec.Name, l.cfg.Confine.UID), g.r); err != nil {
			w.Close()
			return nil, fmt.Errorf("keep the guest log pipe: %w", err)
		}
	}
	cmd.Stdout, cmd.Stderr = w, w
	return w, nil
}

// confineCmd sets QEMU's confinement on cmd (confine.go): environment, uid,
// groups, files by number, and / as working directory (QEMU's uid cannot read
// the instance directory).
func confineCmd(cmd *exec.Cmd, c Confinement, accel Accel, files []*os.File) {
	cmd.Env = qemuEnv()
	cmd.Dir = "/"
	cmd.SysProcAttr = c.sysProcAttr(accel)
	cmd.ExtraFiles = files
}

// failedOrExited is err, or how the process ended when it ends meanwhile:
// the jail's setup stage builds QEMU's root before its go-ahead and exits
// at a failure there, and its own words say more than the write that
// found it gone.
func (l *launch) failedOrExited(id proc.Identity, err error) error {
	t := time.NewTimer(exitGrace)
	defer t.Stop()
	select {
	case <-l.child.Done():
		return l.exitedError(id)
	case <-t.C:
		return err
	}
}

func (l *launch) exited() bool {
	select {
	case <-l.child.Done():
		return true
	default:
		return false
	}
}

// waitQMP waits for the socket to accept and QMP to finish its handshake,
// or for QEMU to exit, whichever comes first.
func (l *launch) waitQMP(ctx context.Context) (*Monitor, error) {
	id := l.child.Identity()
	t := time.NewTicker(socketPollInterval)
	defer t.Stop()
	l.violations = make(chan error, 1)
	for {
		mon, err := dialQMP(ctx, l.cfg.Paths.QMPSocket, reportTo(l.violations))
		if err == nil {
			return mon, nil
		}
		if l.exited() {
			return nil, l.exitedError(id)
		}
		if !notYetListening(err) && ctx.Err() == nil {
			// The socket answered but QMP failed: usually QEMU dying
			// mid-handshake, its EOF arriving just before the reaper
			// sees the exit. Give the exit a moment to show.
			grace := time.NewTimer(exitGrace)
			defer grace.Stop()
			select {
			case <-l.child.Done():
				return nil, l.exitedError(id)
			case <-grace.C:
			case <-ctx.Done():
			}
			return nil, fmt.Errorf("launch %v: %w", id, err)
		}
		select {
		case <-l.child.Done():
			return nil, l.exitedError(id)
		case <-ctx.Done():
			return nil, fmt.Errorf("launch %v: waiting for qmp on %s: %w: %w",
				id, l.cfg.Paths.QMPSocket, ErrLaunchTimeout, ctx.Err())
		case <-t.C:
		}
	}
}

// notYetListening: QEMU has not listened yet. A dial at the launch deadline
// counts too, so the loop's ctx.Done case is where ErrLaunchTimeout comes from.
func notYetListening(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED) ||
		errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded)
}

func (l *launch) exitedError(id proc.Identity) error {
	// Callers saw the exit (pidfd, EOF, ESRCH) possibly a moment before the
	// reaper published the status.
	t := time.NewTimer(exitGrace)
	defer t.Stop()
	select {
	case <-l.child.Done():
	case <-t.C:
	}
	exit := "exit status not yet known"
	if e, ok := l.child.Exit(); ok {
		exit = e.String()
	}
	// QEMU's last words (its error message) are in the pipe until the
	// pump reads its EOF.
	l.glog.waitEOF(exitGrace)
	return fmt.Errorf("launch %v: %w (%s): %s", id, ErrLaunchExited, exit, QuoteLog(l.glog.Tail()))
}

// fail undoes a launch: kill through the pidfd, reap, remove the socket,
// tell the caller. It returns the error Launch returns.
func (l *launch) fail(cause error) error {
	if l.goAhead != nil {
		l.goAhead.Close() // a setup stage still waiting exits without QEMU
	}
	if l.mon != nil {
		l.mon.Close()
	}
	var id proc.Identity
	if l.child != nil {
		id = l.child.Identity()
		if err := l.killAndReap(); err != nil {
			// Not confirmed gone: keep the pid in the record (no OnFailed).
			return errors.Join(cause, err)
		}
	}
	if l.h != nil {
		l.h.Close()
	}
	if l.cgroupPlaced {
		// QEMU is reaped: its cgroup is empty.
		ctx, cancel := context.WithTimeout(context.Background(), DefaultQMPTimeout)
		if err := l.cfg.Confine.Cgroups.Remove(ctx, CgroupName(l.cfg.Spec.Name, l.cfg.Confine.UID)); err != nil {
			cause = errors.Join(cause, err)
		}
		cancel()
	}
	if l.glog != nil {
		// QEMU is gone (or never started): whatever it wrote is in the pipe.
		l.glog.Stop(guestLogDrain)
		if st := l.cfg.FDStore; st != nil {
			if err := st.Remove(LogFDName(l.cfg.Spec.Name, l.cfg.Confine.UID)); err != nil {
				cause = errors.Join(cause, err)
			}
		}
	}
	if l.socketOwned {
		if err := os.Remove(l.cfg.Paths.QMPSocket); err != nil && !errors.Is(err, fs.ErrNotExist) {
			cause = errors.Join(cause, fmt.Errorf("remove qmp socket: %w", err))
		}
	}
	if l.cfg.OnFailed != nil {
		if err := l.cfg.OnFailed(id, cause); err != nil {
			cause = errors.Join(cause, fmt.Errorf("OnFailed: %w: %w", ErrHook, err))
		}
	}
	return cause
}

func (l *launch) killAndReap() error {
	id := l.child.Identity()
	if !l.exited() {
		var err error
		if l.h != nil {
			err = l.h.Signal(syscall.SIGKILL)
		} else {
			// No handle (pidfd_open failed): proc.Signal verifies the
			// identity first. The pid cannot be reused while the child is
			// unreaped, and it is ours to reap.
			err = proc.Signal(id, syscall.SIGKILL)
		}
		if err != nil && !errors.Is(err, proc.ErrNotFound) {
			return fmt.Errorf("kill failed launch %v: %w", id, err)
		}
	}
	timeout := l.cfg.CleanupTimeout
	if timeout <= 0 {
		timeout = DefaultCleanupTimeout
	}
	// Not the caller's context: it may be the very reason the launch
	// failed, and the cleanup must still finish.
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-l.child.Done(): // reaped, so the whole group is gone (waitid semantics)
		return nil
	case <-t.C:
		return &StillAliveError{Identity: id, Step: StepKillSent, Waited: timeout, Status: proc.Inspect(id)}
	}
}

// RemoveStaleSocket removes a socket file nobody listens on. A socket that
// accepts a connection belongs to a live QEMU: ErrSocketInUse.
func RemoveStaleSocket(ctx context.Context, path string) error {
	if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	dctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	c, err := dialSocket(dctx, path)
	if err == nil {
		c.Close()
		return fmt.Errorf("%s: %w", path, ErrSocketInUse)
	}
	if !notYetListening(err) {
		return fmt.Errorf("probe stale socket %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	return nil
}

// Attach returns a VM for a QEMU this process did not start, by a pidfd
// re-verified against id (proc.ErrNotFound, proc.ErrIdentityMismatch); QMP
// connects on demand.
func Attach(id proc.Identity, paths Paths) (*VM, error) {
	if !id.Valid() {
		return nil, fmt.Errorf("attach %v: %w", id, ErrInvalidIdentity)
	}
	h, err := proc.Open(id)
	if err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	return newVM(id, nil, h, paths, nil), nil
}

// Identity is QEMU's identity, read right after the fork.
func (v *VM) Identity() proc.Identity { return v.id }

// Child is the reaped child, or nil for an attached VM.
func (v *VM) Child() *proc.Child { return v.child }

// Paths are the VM's socket, pidfile and log.
func (v *VM) Paths() Paths { return v.paths }

// Monitor returns the VM's QMP connection, reconnecting if it ended; QEMU
// serves one client per socket, so never dial a second.
func (v *VM) Monitor(ctx context.Context) (*Monitor, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.mon != nil {
		select {
		case <-v.mon.Done():
			v.mon.Close()
			v.mon = nil
		default:
			return v.mon, nil
		}
	}
	m, err := dialQMP(ctx, v.paths.QMPSocket, reportTo(v.violations))
	if err != nil {
		return nil, err
	}
	v.mon = m
	return m, nil
}

// QMPViolation receives a QMP protocol violation (ErrQMPProtocol) of any of
// the VM's monitors: the QEMU behind it is not to be trusted.
func (v *VM) QMPViolation() <-chan error { return v.violations }

// Closed is closed once Close was called.
func (v *VM) Closed() <-chan struct{} { return v.closed }

// Status runs query-status over the VM's monitor.
func (v *VM) Status(ctx context.Context) (StatusInfo, error) {
	m, err := v.Monitor(ctx)
	if err != nil {
		return StatusInfo{}, err
	}
	return m.Status(ctx)
}

// Exited reports, without blocking, whether QEMU's whole thread group is gone.
func (v *VM) Exited() (bool, error) { return v.h.Exited() }

// Wait blocks until QEMU's whole thread group is gone (and, for a child,
// reaped) or ctx is done.
func (v *VM) Wait(ctx context.Context) error {
	if err := v.h.Wait(ctx); err != nil {
		return fmt.Errorf("wait for %v: %w", v.id, err)
	}
	if v.child != nil {
		select {
		case <-v.child.Done():
		case <-ctx.Done():
			return fmt.Errorf("wait for %v to be reaped: %w", v.id, ctx.Err())
		}
	}
	return nil
}

// Stop runs the stop ladder on this VM (see Stop), reusing its QMP
// connection. cfg's Identity, Child, Paths and Monitor are filled in.
func (v *VM) Stop(ctx context.Context, cfg StopConfig) (StopResult, error) {
	cfg.Identity = v.id
	cfg.Child = v.child
	cfg.Paths = v.paths
	v.mu.Lock()
	cfg.Monitor = v.mon
	v.mu.Unlock()
	res, err := Stop(ctx, cfg)
	if err == nil {
		v.mu.Lock()
		if v.mon != nil {
			v.mon.Close()
			v.mon = nil
		}
		v.mu.Unlock()
	}
	return res, err
}

// CaptureLog starts pumping an attached VM's output into its bounded log via
// /proc/<pid>/fd/1 (a launched VM captures already). ErrLogNotPipe: an older
// QEMU writing qemu.log itself.
func (v *VM) CaptureLog() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.glog != nil {
		return nil
	}
	var r *os.File
	if v.fdStore != nil {
		// The copy the previous agent stored: the same pipe, with every
		// byte QEMU wrote meanwhile (up to its capacity), also for a
		// zombie leader whose /proc/<pid>/fd is empty.
		r = v.fdStore.Take(v.fdName)
	}
	if r == nil {
		var err error
		if r, err = openStdoutPipe(v.id.PID); err != nil {
			return fmt.Errorf("capture guest log of %v: %w", v.id, err)
		}
		if v.fdStore != nil {
			// Stored now, for the agent after this one.
			if err := v.fdStore.Store(v.fdName, r); err != nil {
				r.Close()
				return fmt.Errorf("capture guest log of %v: %w", v.id, err)
			}
		}
	}
	// The pidfd was opened and verified before the open: while that process
	// lives its pid cannot name another, so alive now means the pipe is its.
	if gone, err := v.h.Exited(); err != nil || gone {
		r.Close()
		if err == nil {
			err = proc.ErrNotFound
		}
		return fmt.Errorf("capture guest log of %v: %w", v.id, err)
	}
	v.glog = startGuestLog(r, v.paths.Log)
	return nil
}

// UseFDStore makes an attached VM take its log pipe from st (stored under
// LogFDName(id, uid) by the agent before) at CaptureLog, and keep it there.
func (v *VM) UseFDStore(st FDStore, id string, uid uint32) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.fdStore, v.fdName = st, LogFDName(id, uid)
}

// LogStats says what the guest-output pump read and dropped; ok is false
// when the VM has none (an attached VM without CaptureLog).
func (v *VM) LogStats() (st LogStats, ok bool) {
	v.mu.Lock()
	g := v.glog
	v.mu.Unlock()
	if g == nil {
		return LogStats{}, false
	}
	return g.Stats(), true
}

// Close releases the monitor, the output pump (draining an exited QEMU's
// output first) and the pidfd; QEMU keeps running.
func (v *VM) Close() error {
	v.closeOnce.Do(func() { close(v.closed) })
	v.mu.Lock()
	if v.mon != nil {
		v.mon.Close()
		v.mon = nil
	}
	g := v.glog
	v.mu.Unlock()
	var errs []error
	if g != nil {
		var drain time.Duration
		gone, err := v.h.Exited()
		if err == nil && gone {
			drain = guestLogDrain
		}
		g.Stop(drain)
		if err == nil && gone && v.fdStore != nil {
			// Drained: nobody will read this pipe again.
			errs = append(errs, v.fdStore.Remove(v.fdName))
		}
	}
	return errors.Join(append(errs, v.h.Close())...)
}
