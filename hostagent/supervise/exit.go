package supervise

import (
	"context"
	"errors"
	"strconv"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/internal/fsx"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// exitPollInterval is the fallback when a pidfd wait fails for a reason
// other than the context (it should not): look at /proc instead.
const exitPollInterval = time.Second

// exitOf describes vm's end: the reaper's status for a child, "unknown"
// otherwise (a pidfd tells that the group is gone, not how).
func (s *Supervisor) exitOf(vm *vmm.VM) store.Exit {
	if c := vm.Child(); c != nil {
		if e, ok := c.Exit(); ok {
			return exitFromProc(e)
		}
	}
	return store.Exit{At: s.cfg.Now(), Status: "unknown (not the agent's child)", Code: -1}
}

func exitFromProc(e proc.Exit) store.Exit {
	switch {
	case e.Signal != "":
		return store.Exit{At: e.At, Status: "signal: " + e.Signal, Code: -1}
	case e.Err != nil:
		return store.Exit{At: e.At, Status: "unknown (" + e.Err.Error() + ")", Code: -1}
	default:
		return store.Exit{At: e.At, Status: "exit status " + strconv.Itoa(e.Code), Code: int32(e.Code)}
	}
}

// takeBackVFIO gives a gone QEMU's VFIO group nodes back to root and returns
// those it could not chown, for the next exit or launch to retry.
func takeBackVFIO(nodes []string) []string {
	var left []string
	for _, n := range nodes {
		if err := vmm.TakeBackVFIOGroup(n); err != nil {
			left = append(left, n)
		}
	}
	return left
}

// watch records vm's exit when it comes: a child through its reaper, a
// re-attached VM through its pidfd, so no periodic scan.
func (s *Supervisor) watch(in *instance, vm *vmm.VM) {
	s.goBackground(func() { s.watchQMP(in, vm) }) // ends with vm.Close below
	ok := s.goBackground(func() {
		defer func() {
			vm.Close()
			if st, ok := vm.LogStats(); ok && st.Dropped > 0 {
				in.log.Warn("guest output dropped: the log's disk was full, failing or behind",
					zap.Int("pid", vm.Identity().PID), zap.Uint64("dropped_bytes", st.Dropped),
					zap.Uint64("read_bytes", st.Read), zap.String("last_error", st.LastErr))
				if s.cfg.OnGuestLogDropped != nil {
					s.cfg.OnGuestLogDropped(st.Dropped)
				}
			}
		}()
		if !s.waitGone(in, vm) {
			return
		}
		s.handleExit(in, vm, s.detectedAt(vm))
	})
	if !ok {
		_ = vm.Close()
	}
}

// waitGone blocks until vm's group is gone (true) or the supervisor closes
// or another path took the VM over (false).
func (s *Supervisor) waitGone(in *instance, vm *vmm.VM) bool {
	if c := vm.Child(); c != nil {
		select {
		case <-c.Done():
			return true
		case <-s.ctx.Done():
			return false
		}
	}
	err := vm.Wait(s.ctx)
	if err == nil {
		return true
	}
	if s.ctx.Err() != nil || !in.isCurrent(vm) {
		return false
	}
	// The pidfd wait broke: fall back to /proc, where unknown is alive.
	in.log.Warn("pidfd wait failed, polling /proc", zap.Error(err))
	t := time.NewTicker(exitPollInterval)
	defer t.Stop()
	for {
		if !proc.Inspect(vm.Identity()).Alive {
			return true
		}
		select {
		case <-s.ctx.Done():
			return false
		case <-t.C:
		}
	}
}

// detectedAt is when vm's exit became observable: the reaper's Exit.At for a
// child, otherwise now (the pidfd or /proc just said the group is gone).
func (s *Supervisor) detectedAt(vm *vmm.VM) time.Time {
	if c := vm.Child(); c != nil {
		if e, ok := c.Exit(); ok && !e.At.IsZero() {
			return e.At
		}
	}
	return time.Now()
}

// handleExit records an exit nobody asked for (crash, outside kill, guest
// power-off) and applies the restart policy.
func (s *Supervisor) handleExit(in *instance, vm *vmm.VM, detected time.Time) {
	ex := s.exitOf(vm)
	if err := in.acquire(s.ctx); err != nil {
		return // closing
	}
	defer in.release()
	if !in.isCurrent(vm) {
		return // a Stop or a Launch already dealt with it
	}
	in.clearVM(vm)
	log := in.log.With(zap.Int("pid", vm.Identity().PID))
	log.Info("vm exited", zap.String("exit", ex.Status), zap.Int32("exit_code", ex.Code))

	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.LockTimeout)
	defer cancel()
	l, err := s.st.Lock(ctx, in.id)
	if err != nil {
		// The pid stays in the record; whoever next looks (Launch, Stop,
		// the next Start) finds it gone and clears it.
		log.Error("record exit: cannot lock the instance", zap.Error(err))
		return
	}
	defer unlock(l, log)
	rec, err := s.recordGoneLocked(ctx, l, vm.Identity(), ex)
	if err != nil {
		log.Error("record exit", zap.Error(err))
		return
	}
	if s.cfg.OnExitRecorded != nil {
		// time.Since: monotonic, unlike the wall-clock exit time recorded.
		s.cfg.OnExitRecorded(time.Since(detected))
	}
	s.applyPolicyLocked(l, in, rec, time.Time{})
}

// recordGoneLocked writes that the process id is gone (if the record still
// names it) and removes what a killed QEMU leaves: its socket and pidfile.
func (s *Supervisor) recordGoneLocked(ctx context.Context, l *store.Locked, id proc.Identity, ex store.Exit) (*vmflowv1.InstanceRecord, error) {
	rec, err := l.Apply(store.Gone(id, ex, takeBackVFIO))
	if err != nil {
		return nil, err
	}
	cleanupFiles(ctx, vmmPaths(l.Paths()), id.PID)
	return rec, nil
}

// applyPolicyLocked decides whether rec's VM comes back and schedules it. The
// backoff counts from since, or when zero from the recorded exit, so time the
// agent was down counts too.
func (s *Supervisor) applyPolicyLocked(l *store.Locked, in *instance, rec *vmflowv1.InstanceRecord, since time.Time) bool {
	marked, err := l.ManualStop()
	if err != nil {
		in.log.Error("restart policy: cannot read the manual-stop marker; not restarting", zap.Error(err))
		return false
	}
	d := decide(rec, marked, s.cfg.RestartBackoff, s.cfg.RestartBackoffMax)
	if !d.restart {
		in.log.Info("not restarting", zap.String("reason", d.reason), zap.String("restart_policy", rec.GetRestartPolicy()))
		return false
	}
	// What is left of the backoff since the exit: since is an in-process
	// instant (the monotonic clock); an agent that did not see the exit
	// measures from the recorded one on CLOCK_BOOTTIME. Never longer than
	// the backoff, whatever the wall clock did.
	elapsed := time.Since(since)
	if since.IsZero() {
		elapsed = store.Elapsed(rec.GetLastExit(), rec.GetLastExitBoot(), s.cfg.Now())
	}
	delay := min(d.delay, max(0, d.delay-elapsed))
	s.scheduleRestart(in, delay)
	in.log.Info("restart scheduled", zap.String("reason", d.reason), zap.Duration("backoff", d.delay),
		zap.Duration("delay", delay), zap.Uint32("restart_count", rec.GetRestartCount()))
	return true
}

func (s *Supervisor) scheduleRestart(in *instance, delay time.Duration) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.restartGen++
	gen := in.restartGen
	if in.timer != nil {
		in.timer.Stop()
	}
	in.nextRestart = time.Now().Add(delay)
	in.timer = time.AfterFunc(delay, func() {
		s.goBackground(func() { s.restart(in, gen) })
	})
}

// restart is a restart-policy launch, checked and run under the instance lock
// so a manual-stop marker written meanwhile either stops it or is stopped after.
func (s *Supervisor) restart(in *instance, gen uint64) {
	if err := in.acquire(s.ctx); err != nil {
		return
	}
	defer in.release()
	in.mu.Lock()
	if in.restartGen != gen {
		in.mu.Unlock()
		return // cancelled or superseded while waiting
	}
	in.timer, in.nextRestart = nil, time.Time{}
	in.mu.Unlock()

	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.LockTimeout+s.cfg.ReadyTimeout+s.cfg.GroupExitCap)
	defer cancel()
	lctx, lcancel := context.WithTimeout(ctx, s.cfg.LockTimeout)
	l, err := s.st.Lock(lctx, in.id)
	lcancel()
	if err != nil {
		in.log.Error("restart: cannot lock the instance; not restarting", zap.Error(err))
		return
	}
	defer unlock(l, in.log)
	rec, err := l.Get()
	if err != nil {
		in.log.Error("restart: read record; not restarting", zap.Error(err))
		return
	}
	if rec, _, err = s.resolveLaunchLocked(ctx, l, in, rec, false); err != nil {
		in.log.Error("restart: resolve the launch marker; not restarting", zap.Error(err))
		return
	}
	marked, err := l.ManualStop()
	if err != nil {
		in.log.Error("restart: cannot read the manual-stop marker; not restarting", zap.Error(err))
		return
	}
	// The same decision as at the exit, now under the lock that also
	// guards the launch: only the backoff is not looked at again.
	if d := decide(rec, marked, s.cfg.RestartBackoff, s.cfg.RestartBackoffMax); !d.restart {
		in.log.Info("restart cancelled", zap.String("reason", d.reason))
		return
	}
	attempt := rec.GetRestartCount() + 1
	if rec, err = l.Apply(store.RestartAttempt(attempt)); err != nil {
		in.log.Error("restart: record the attempt; not restarting", zap.Error(err))
		return
	}
	log := in.log.With(zap.Uint32("restart_count", attempt))
	log.Info("restarting")
	vm, err := s.launchLocked(ctx, l, in, rec, nil)
	if errors.Is(err, admission.ErrAdmissionRefused) || errors.Is(err, store.ErrUIDRangeTaken) {
		s.refuseRestartLocked(l, in, attempt-1, err)
		return
	}
	if errors.Is(err, lease.ErrClaimDeviceMissing) {
		s.deviceMissingLocked(l, in, err)
	}
	if err != nil {
		// A failed restart is an attempt: the policy decides again with the
		// higher count (so the backoff doubles), from now.
		log.Warn("restart failed", zap.Error(err))
		if rec, gerr := l.Get(); gerr == nil {
			s.applyPolicyLocked(l, in, rec, time.Now())
		}
		return
	}
	in.setVM(vm)
	s.watch(in, vm)
	log.Info("restarted", zap.Int("pid", vm.Identity().PID))
}

// refuseRestartLocked records a restart admission refused: needs_attention,
// restart count back to count. Nothing is rescheduled: only a new agent's
// configuration could change the answer, and its re-attach tries again.
func (s *Supervisor) refuseRestartLocked(l *store.Locked, in *instance, count uint32, cause error) {
	in.log.Error("restart refused by the host's configuration; not restarting until an agent runs with one that admits it",
		zap.Error(cause))
	if _, err := l.Apply(store.RestartRefused(count, "restart refused: "+cause.Error(), s.cfg.Now())); err != nil {
		in.log.Error("restart refused: cannot record it", zap.Error(err))
	}
	if s.cfg.OnRestartRefused != nil {
		s.cfg.OnRestartRefused()
	}
}

// deviceMissingLocked marks needs_attention for a restart whose vGPU is gone
// and cannot be re-created, which retrying alone may never fix; the restart
// policy keeps trying.
func (s *Supervisor) deviceMissingLocked(l *store.Locked, in *instance, cause error) {
	if _, err := l.Apply(store.NeedsAttention("restart cannot get its vGPU: "+cause.Error(), s.cfg.Now(), true)); err != nil {
		in.log.Error("restart without its vGPU: cannot record it", zap.Error(err))
	}
	if s.cfg.OnRestartDeviceMissing != nil {
		s.cfg.OnRestartDeviceMissing()
	}
}

// cleanupFiles removes a QMP socket nobody listens on and a pidfile still
// naming pid: QEMU unlinks them on an orderly exit but not when killed.
func cleanupFiles(ctx context.Context, p vmm.Paths, pid int) {
	if p.QMPSocket != "" {
		_ = vmm.RemoveStaleSocket(ctx, p.QMPSocket)
	}
	fsx.RemovePIDFile(p.PIDFile, pid)
}
