package vmm

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/internal/contract"
	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
)

// StopStep is how far the stop ladder got. The caller records it (OnStep)
// so a restarted agent resumes the ladder instead of starting over.
type StopStep string

// The ladder's steps, in order.
const (
	StepNone          StopStep = ""               // nothing sent yet
	StepPowerdownSent StopStep = "powerdown_sent" // ACPI power button pressed (QMP system_powerdown)
	StepQuitSent      StopStep = "quit_sent"      // QMP quit, or SIGTERM when QMP is unreachable
	StepKillSent      StopStep = "kill_sent"      // SIGKILL through the pidfd
	StepGone          StopStep = "gone"           // the whole thread group is gone (and reaped, for a child)
)

func (s StopStep) rank() int {
	switch s {
	case StepNone:
		return 0
	case StepPowerdownSent:
		return 1
	case StepQuitSent:
		return 2
	case StepKillSent:
		return 3
	case StepGone:
		return 4
	}
	return -1
}

// Defaults for StopConfig. The graceful timeout and the kill timeout (the
// group exit cap) are contract's: the workflows size their stop activity
// from the same values.
const (
	DefaultGracefulTimeout = contract.DefaultGracefulTimeout
	DefaultQuitTimeout     = 5 * time.Second
	DefaultKillTimeout     = contract.DefaultGroupExitCap
	DefaultStopQMPTimeout  = 2 * time.Second
)

// StopConfig says which QEMU to stop and how patiently.
type StopConfig struct {
	// Identity is the QEMU to stop (required).
	Identity proc.Identity
	// Child is set when this process is QEMU's parent: Stop then also waits
	// until proc's reaper has reaped it, so no <defunct> entry remains.
	Child *proc.Child
	// Paths: QMPSocket for the QMP steps (empty: go straight to signals);
	// the socket and a pidfile an older agent had QEMU write are removed
	// once it is gone.
	Paths Paths
	// Monitor is an open QMP connection to reuse. QEMU serves one QMP client
	// per socket, so a second dial would wait behind this one until
	// QMPTimeout and fall back to signals.
	Monitor *Monitor
	// From is the step the record says was reached; the ladder resumes
	// after it. From powerdown_sent the guest gets its graceful time again
	// (it may be mid-shutdown: quitting it early could lose data); from
	// quit_sent it waits QuitTimeout, then kills; from kill_sent it sends
	// SIGKILL again (harmless) and waits.
	From StopStep

	// SkipPowerdown starts the ladder at quit when From is StepNone: for a
	// guest with no ACPI (machine none ignores system_powerdown) or a
	// caller that wants no graceful wait.
	SkipPowerdown bool

	GracefulTimeout time.Duration // after system_powerdown; DefaultGracefulTimeout
	QuitTimeout     time.Duration // after quit or SIGTERM; DefaultQuitTimeout
	KillTimeout     time.Duration // cap after SIGKILL; DefaultKillTimeout (VFIO teardown can take seconds)
	QMPTimeout      time.Duration // each QMP dial or command; DefaultStopQMPTimeout

	// OnStep is called after each step is taken, and with StepGone once the
	// group is gone. An error aborts the ladder (wrapped with ErrHook): the
	// ladder never runs ahead of what the caller could record, and every
	// step is safe to repeat on resume.
	OnStep func(StopStep) error
}

// StepResult is one step the ladder took.
type StepResult struct {
	Step StopStep `json:"step"`
	// Via is how it was taken: "qmp", "sigterm", "sigkill", or "skipped"
	// (QMP unreachable or the command refused).
	Via string `json:"via"`
	// Started is when the step began; Duration covers issuing it and the
	// wait after it, Wait the wait alone (0: none).
	Started  time.Time     `json:"started"`
	Duration time.Duration `json:"duration"`
	Wait     time.Duration `json:"wait"`
	// Exited: the group was gone by the end of this step's wait.
	Exited bool `json:"exited"`
	// Err is why the step was skipped or failed; the ladder went on.
	Err error `json:"-"`
}

// StopResult reports what the ladder did.
type StopResult struct {
	// Reached is the last step taken; StepGone on success.
	Reached StopStep `json:"reached"`
	// AlreadyGone: the process was gone before the ladder sent anything.
	AlreadyGone bool `json:"already_gone"`
	// QMPUnreachable: the QMP steps were replaced by signals.
	QMPUnreachable bool          `json:"qmp_unreachable"`
	Steps          []StepResult  `json:"steps"`
	Total          time.Duration `json:"total"`
	// Exit is how the child ended; nil for a non-child.
	Exit *proc.Exit `json:"exit,omitempty"`
}

// Stop runs the stop ladder on cfg.Identity's QEMU: powerdown, quit, SIGKILL
// through a verified pidfd (invariant 3), each with its wait. nil only once the
// whole group is gone (never on QMP's EOF), else a *StillAliveError or an
// error that never means "stopped".
func Stop(ctx context.Context, cfg StopConfig) (res StopResult, err error) {
	start := time.Now()
	defer func() { res.Total = time.Since(start) }()
	s := &ladder{cfg: cfg.WithDefaults(), res: &res}
	if !cfg.Identity.Valid() {
		return res, fmt.Errorf("stop %v: %w", cfg.Identity, ErrInvalidIdentity)
	}
	if s.cfg.From.rank() < 0 {
		return res, errdefs.InvalidInput.Errorf("stop %v: unknown step %q", cfg.Identity, cfg.From)
	}
	defer s.closeMonitor()

	h, err := proc.Open(cfg.Identity)
	switch {
	case errors.Is(err, proc.ErrNotFound), errors.Is(err, proc.ErrIdentityMismatch):
		// Gone; a pid now held by another process (other start time or
		// boot) means the recorded one is gone too. Never signal it.
		res.AlreadyGone = true
		return res, s.finish(ctx)
	case err != nil:
		return res, fmt.Errorf("stop %v: %w", cfg.Identity, err) // can't tell: not stopped
	}
	defer h.Close()
	s.h = h
	if gone, err := h.Exited(); err == nil && gone {
		res.AlreadyGone = true
		return res, s.finish(ctx)
	}
	if err := s.run(ctx); err != nil {
		return res, err
	}
	return res, s.finish(ctx)
}

type ladder struct {
	cfg StopConfig
	res *StopResult
	h   *proc.Handle

	mon      *Monitor
	ownMon   bool // dialed here: close it at the end
	noQMP    bool // QMP unreachable: signals instead
	monTried bool
}

// WithDefaults is c with every zero field that has a default set to it.
func (c StopConfig) WithDefaults() StopConfig {
	if c.GracefulTimeout <= 0 {
		c.GracefulTimeout = DefaultGracefulTimeout
	}
	if c.QuitTimeout <= 0 {
		c.QuitTimeout = DefaultQuitTimeout
	}
	if c.KillTimeout <= 0 {
		c.KillTimeout = DefaultKillTimeout
	}
	if c.QMPTimeout <= 0 {
		c.QMPTimeout = DefaultStopQMPTimeout
	}
	return c
}

// errGone ends the ladder early: the group exited during a wait or a
// signal found no process.
var errGone = errors.New("gone")

func (s *ladder) run(ctx context.Context) error {
	rank := s.cfg.From.rank()
	if rank == StepGone.rank() {
		// The record says gone but the identity still matches a live
		// process: never trust the record over the pidfd; kill it.
		rank = StepQuitSent.rank()
	}
	err := s.steps(ctx, rank)
	if errors.Is(err, errGone) {
		return nil
	}
	return err
}

func (s *ladder) steps(ctx context.Context, rank int) error {
	if rank <= StepNone.rank() && !s.cfg.SkipPowerdown {
		t := time.Now()
		r := StepResult{Step: StepPowerdownSent, Via: "qmp", Started: t}
		delivered := false
		if mon := s.monitor(ctx); mon == nil {
			r.Via, r.Err = "skipped", errors.New("qmp unreachable")
		} else if err := s.qmp(ctx, mon.SystemPowerdown); err != nil {
			// Not pressed (refused, or the monitor died): no point
			// waiting for a guest that was never asked.
			r.Via, r.Err = "skipped", err
			var qe *QMPError
			if !errors.As(err, &qe) {
				s.noQMP = true
				s.res.QMPUnreachable = true
			}
		} else {
			delivered = true
		}
		if err := s.record(r, t, StepPowerdownSent); err != nil {
			return err
		}
		if delivered {
			if err := s.waitStep(ctx, t, s.cfg.GracefulTimeout); err != nil {
				return err
			}
		}
	} else if rank == StepPowerdownSent.rank() {
		// Resumed: the button was pressed before the agent restarted.
		t := time.Now()
		r := StepResult{Step: StepPowerdownSent, Via: "resumed", Started: t}
		s.res.Reached = StepPowerdownSent
		s.res.Steps = append(s.res.Steps, r)
		if err := s.waitStep(ctx, t, s.cfg.GracefulTimeout); err != nil {
			return err
		}
	}

	if rank <= StepPowerdownSent.rank() {
		t := time.Now()
		r := StepResult{Step: StepQuitSent, Via: "qmp", Started: t}
		mon := s.monitor(ctx)
		if mon != nil {
			// The reply may be lost to the EOF that follows quit
			// (ErrMonitorClosed): QEMU got it either way.
			err := s.qmp(ctx, mon.Quit)
			var qe *QMPError
			if err != nil && !errors.Is(err, ErrMonitorClosed) {
				r.Err = err
				if !errors.As(err, &qe) {
					s.noQMP = true
					s.res.QMPUnreachable = true
				}
				mon = nil
			}
		}
		if mon == nil {
			// QMP is gone or refused quit: SIGTERM is QEMU's own orderly
			// exit (SHUTDOWN reason host-signal).
			r.Via = "sigterm"
			if err := s.signal(syscall.SIGTERM); err != nil {
				return err
			}
		}
		if err := s.record(r, t, StepQuitSent); err != nil {
			return err
		}
		if err := s.waitStep(ctx, t, s.cfg.QuitTimeout); err != nil {
			return err
		}
	} else if rank == StepQuitSent.rank() {
		t := time.Now()
		s.res.Reached = StepQuitSent
		s.res.Steps = append(s.res.Steps, StepResult{Step: StepQuitSent, Via: "resumed", Started: t})
		if err := s.waitStep(ctx, t, s.cfg.QuitTimeout); err != nil {
			return err
		}
	}

	t := time.Now()
	r := StepResult{Step: StepKillSent, Via: "sigkill", Started: t}
	if err := s.signal(syscall.SIGKILL); err != nil {
		return err
	}
	if err := s.record(r, t, StepKillSent); err != nil {
		return err
	}
	err := s.waitStep(ctx, t, s.cfg.KillTimeout)
	if err == nil {
		return &StillAliveError{
			Identity: s.cfg.Identity, Step: StepKillSent,
			Waited: time.Since(t), Status: s.h.Status(),
		}
	}
	return err
}

// record appends r, marks the step reached and calls OnStep.
func (s *ladder) record(r StepResult, t time.Time, step StopStep) error {
	r.Duration = time.Since(t)
	s.res.Steps = append(s.res.Steps, r)
	s.res.Reached = step
	return s.hook(step)
}

func (s *ladder) hook(step StopStep) error {
	if s.cfg.OnStep == nil {
		return nil
	}
	if err := s.cfg.OnStep(step); err != nil {
		return fmt.Errorf("stop %v: OnStep(%s): %w: %w", s.cfg.Identity, step, ErrHook, err)
	}
	crashpoint.HitStop(string(step))
	return nil
}

// waitStep waits up to d for the group to be gone and accounts the time to
// the last step. It returns errGone when it is, nil when d passed, and the
// caller's context error when that ended first.
func (s *ladder) waitStep(ctx context.Context, t time.Time, d time.Duration) error {
	began := time.Now()
	wctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	err := s.h.Wait(wctx)
	last := &s.res.Steps[len(s.res.Steps)-1]
	last.Duration, last.Wait = time.Since(t), time.Since(began)
	switch {
	case err == nil:
		last.Exited = true
		return errGone
	case ctx.Err() != nil:
		return fmt.Errorf("stop %v after %s: %w", s.cfg.Identity, s.res.Reached, ctx.Err())
	case errors.Is(err, context.DeadlineExceeded):
		return nil
	default:
		return fmt.Errorf("stop %v after %s: %w", s.cfg.Identity, s.res.Reached, err)
	}
}

// signal sends sig through the pidfd; a process already gone is errGone.
func (s *ladder) signal(sig syscall.Signal) error {
	err := s.h.Signal(sig)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, proc.ErrNotFound):
		return errGone
	default:
		return fmt.Errorf("stop %v: %w", s.cfg.Identity, err)
	}
}

// monitor returns a QMP connection, or nil when QMP is unreachable. It
// dials at most once per ladder.
func (s *ladder) monitor(ctx context.Context) *Monitor {
	if s.noQMP {
		return nil
	}
	if s.mon != nil {
		select {
		case <-s.mon.Done():
			s.noQMP = true
			s.res.QMPUnreachable = true
			return nil
		default:
			return s.mon
		}
	}
	if s.cfg.Monitor != nil {
		s.mon = s.cfg.Monitor
		return s.monitor(ctx)
	}
	if s.monTried || s.cfg.Paths.QMPSocket == "" {
		s.noQMP = true
		s.res.QMPUnreachable = true
		return nil
	}
	s.monTried = true
	dctx, cancel := context.WithTimeout(ctx, s.cfg.QMPTimeout)
	defer cancel()
	m, err := DialQMP(dctx, s.cfg.Paths.QMPSocket)
	if err != nil {
		s.noQMP = true
		s.res.QMPUnreachable = true
		return nil
	}
	s.mon, s.ownMon = m, true
	return m
}

func (s *ladder) qmp(ctx context.Context, call func(context.Context) error) error {
	cctx, cancel := context.WithTimeout(ctx, s.cfg.QMPTimeout)
	defer cancel()
	return call(cctx)
}

func (s *ladder) closeMonitor() {
	if s.ownMon && s.mon != nil {
		s.mon.Close()
	}
}

// finish runs once the group is gone: wait for the reaper (a child), remove
// the socket and pidfile, record StepGone.
func (s *ladder) finish(ctx context.Context) error {
	if c := s.cfg.Child; c != nil {
		// The group is gone, so cmd.Wait in proc's reaper returns at once;
		// wait for it so no <defunct> entry outlives Stop (invariant 4).
		t := time.NewTimer(s.cfg.KillTimeout)
		defer t.Stop()
		select {
		case <-c.Done():
			if e, ok := c.Exit(); ok {
				s.res.Exit = &e
			}
		case <-ctx.Done():
			return fmt.Errorf("stop %v: waiting for the reaper: %w", s.cfg.Identity, ctx.Err())
		case <-t.C:
			return errdefs.StillAlive.Errorf("stop %v: gone but not reaped after %s", s.cfg.Identity, s.cfg.KillTimeout)
		}
	}
	s.closeMonitor()
	if p := s.cfg.Paths.QMPSocket; p != "" {
		// QEMU unlinks its socket on an orderly exit, not when killed. A
		// socket that still accepts belongs to someone else: leave it.
		if err := RemoveStaleSocket(ctx, p); err != nil && !errors.Is(err, ErrSocketInUse) {
			return fmt.Errorf("stop %v: %w", s.cfg.Identity, err)
		}
	}
	if p := s.cfg.Paths.PIDFile; p != "" {
		fsx.RemovePIDFile(p, s.cfg.Identity.PID) // only a QEMU an older agent started has one
	}
	s.res.Reached = StepGone
	return s.hook(StepGone)
}
