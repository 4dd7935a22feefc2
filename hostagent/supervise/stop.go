package supervise

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
)

// StopReport is what Stop did: the ladder's vmm.StopResult and which QEMU
// it was run on.
type StopReport struct {
	vmm.StopResult
	// Identity is the QEMU that was stopped; zero when none was recorded.
	Identity proc.Identity `json:"identity"`
	// Child: this process was QEMU's parent and reaped it; false for the
	// non-child path (a VM re-attached after an agent restart).
	Child bool `json:"child"`
	// ResumedFrom is the step the record said the ladder had reached.
	ResumedFrom vmm.StopStep `json:"resumed_from"`
}

// Stop runs the stop ladder (powerdown, the graceful wait or Config's for <= 0,
// quit, SIGKILL, the group's exit) from the recorded step, adopting an
// unrecorded QEMU; it refuses without the manual-stop marker (invariant 6).
// nil means stop step gone; retry on store.ErrBusy, ErrStillRunning, vmm.ErrStillAlive.
func (s *Supervisor) Stop(ctx context.Context, id string, graceful time.Duration) (StopReport, error) {
	in, err := s.instance(id)
	if err != nil {
		return StopReport{}, fmt.Errorf("stop: %w", err)
	}
	if !in.stopping.CompareAndSwap(false, true) {
		return StopReport{}, fmt.Errorf("stop instance %s: %w: a stop is already running", id, store.ErrBusy)
	}
	defer in.stopping.Store(false)
	if err := in.acquire(ctx); err != nil {
		return StopReport{}, fmt.Errorf("stop: %w", err)
	}
	defer in.release()
	// The store lock is held for the whole ladder: every step is a
	// check-then-act on the record, and a second agent must not run a
	// ladder of its own meanwhile.
	l, err := s.st.Lock(ctx, id)
	if err != nil {
		return StopReport{}, fmt.Errorf("stop: %w", err)
	}
	defer unlock(l, in.log)

	rec, err := l.Get()
	if err != nil {
		return StopReport{}, fmt.Errorf("stop: %w", err)
	}
	marked, err := l.ManualStop()
	if err != nil {
		return StopReport{}, fmt.Errorf("stop: %w", err)
	}
	if !marked {
		return StopReport{}, fmt.Errorf("stop instance %s: %w", id, store.ErrManualStopMissing)
	}
	in.cancelRestart()
	// Before concluding "nothing runs": a QEMU forked by an agent that died
	// before recording it is adopted here and stopped like any other.
	if rec, _, err = s.resolveLaunchLocked(ctx, l, in, rec, true); err != nil {
		return StopReport{}, fmt.Errorf("stop: %w", err)
	}

	from := stepFromProto(rec.GetStopStep())
	if rec.GetProcess() == nil {
		// Nothing runs: make the record say so (idempotent).
		if _, err := l.Apply(store.NothingRuns(s.cfg.Now())); err != nil {
			return StopReport{}, fmt.Errorf("stop instance %s: %w", id, err)
		}
		return StopReport{StopResult: vmm.StopResult{Reached: vmm.StepGone, AlreadyGone: true}, ResumedFrom: from}, nil
	}

	pid := store.IdentityOf(rec.GetProcess())
	log := in.log.With(zap.Int("pid", pid.PID))
	if graceful <= 0 {
		graceful = s.cfg.GracefulTimeout
	}
	if from == vmm.StepPowerdownSent && (rec.GetStopStepAt() != nil || rec.GetStopStepBoot() != nil) {
		// Resumed after the button was pressed: only what is left of the
		// graceful time (vmm would give it all again), measured on
		// CLOCK_BOOTTIME so a clock stepped back cannot stretch it.
		graceful = resumedWait(graceful, store.Elapsed(rec.GetStopStepAt(), rec.GetStopStepBoot(), s.cfg.Now()))
	}
	vm := in.current(pid)
	child := vm != nil && vm.Child() != nil
	log.Info("stopping", zap.String("from", string(from)), zap.Bool("child", child), zap.Duration("graceful", graceful))
	cfg := vmm.StopConfig{
		From:            from,
		GracefulTimeout: graceful,
		KillTimeout:     s.cfg.GroupExitCap,
		OnStep: func(step vmm.StopStep) error {
			steps := []store.Step{store.StopStepTaken(stepToProto(step), s.cfg.Now())}
			if step == vmm.StepGone {
				ex := store.Exit{At: s.cfg.Now(), Status: "unknown (not the agent's child)", Code: -1}
				if vm != nil {
					ex = s.exitOf(vm)
				}
				steps = append(steps, store.Gone(pid, ex, takeBackVFIO))
			}
			_, err := l.Apply(steps...)
			if err == nil {
				log.Info("stop step", zap.String("step", string(step)))
			}
			return err
		},
	}
	var res vmm.StopResult
	if vm != nil {
		res, err = vm.Stop(ctx, cfg)
	} else {
		cfg.Identity, cfg.Paths = pid, vmmPaths(l.Paths())
		res, err = vmm.Stop(ctx, cfg)
	}
	traceLadder(ctx, res)
	out := StopReport{StopResult: res, Identity: pid, Child: child, ResumedFrom: from}
	if err != nil {
		// Returned, not logged (its caller, the StopVM activity, returns
		// it); the record's last_error keeps it too.
		if _, uerr := l.Apply(store.RecordError("stop: " + err.Error())); uerr != nil {
			err = errors.Join(err, uerr)
		}
		return out, fmt.Errorf("stop instance %s: %w", id, err)
	}
	if vm != nil {
		in.clearVM(vm) // its watcher wakes on the exit, finds it handled, closes it
	}
	log.Info("stopped", zap.Duration("took", res.Total), zap.Bool("already_gone", res.AlreadyGone))
	return out, nil
}

// resumedWait is what remains of a configured wait after elapsed, floored
// above zero since vmm reads <= 0 as "default".
func resumedWait(configured, elapsed time.Duration) time.Duration {
	return max(configured-elapsed, time.Millisecond)
}

// WaitExit returns nil once instance id's whole thread group is gone (a
// zombie leader with live tasks is alive), or ctx's error. progress, if set,
// is called every Config.ProgressInterval on the caller's goroutine.
func (s *Supervisor) WaitExit(ctx context.Context, id string, progress func(proc.Status)) error {
	rec, err := s.st.Get(id)
	if err != nil {
		return fmt.Errorf("wait exit: %w", err)
	}
	if rec.GetLaunchStartedAt() != nil && rec.GetProcess() == nil {
		// A QEMU may run that the record does not name yet.
		if rec, err = s.resolve(ctx, id); err != nil {
			return fmt.Errorf("wait exit: %w", err)
		}
	}
	if rec.GetProcess() == nil {
		return nil
	}
	pid := store.IdentityOf(rec.GetProcess())
	var child *proc.Child
	if in := s.lookup(id); in != nil {
		if vm := in.current(pid); vm != nil {
			child = vm.Child()
		}
	}
	h, err := proc.Open(pid)
	switch {
	case errors.Is(err, proc.ErrNotFound), errors.Is(err, proc.ErrIdentityMismatch):
		return waitReaped(ctx, id, child)
	case err != nil:
		return fmt.Errorf("wait exit of instance %s: %w", id, err) // can't tell: not gone
	}
	defer h.Close()
	log := s.log.With(zap.String("instance_id", id), zap.Int("pid", pid.PID))
	for {
		wctx, cancel := context.WithTimeout(ctx, s.cfg.ProgressInterval)
		err := h.Wait(wctx)
		cancel()
		if err == nil {
			return waitReaped(ctx, id, child)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("wait exit of instance %s (%v): %w", id, pid, ctx.Err())
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("wait exit of instance %s: %w", id, err)
		}
		st := h.Status()
		log.Info("waiting for the thread group to exit", zap.String("state", string(st.State)), zap.Int("tasks", st.Tasks))
		if progress != nil {
			progress(st)
		}
	}
}

func waitReaped(ctx context.Context, id string, c *proc.Child) error {
	if c == nil {
		return nil
	}
	select {
	case <-c.Done():
		return nil
	case <-ctx.Done():
		return fmt.Errorf("wait exit of instance %s: waiting for the reaper: %w", id, ctx.Err())
	}
}
