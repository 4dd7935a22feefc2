package supervise

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// LaunchResult is what Launch did.
type LaunchResult struct {
	// Identity is the running QEMU.
	Identity proc.Identity `json:"identity"`
	// AlreadyRunning: a live QEMU with the recorded identity was found and
	// returned; nothing was started.
	AlreadyRunning bool `json:"already_running"`
	// Duration is the whole call, lock waits included.
	Duration time.Duration `json:"duration"`
	// Timeline is where Duration went, for a launch that started QEMU.
	Timeline Timeline `json:"timeline,omitempty"`
}

// Launch starts QEMU for instance id (Creating, or Exited for a restart) and
// returns once QMP says running and the record says Running. Refuses with
// ErrManualStop or store.ErrDeleting; idempotent for a live matching QEMU
// (AlreadyRunning). Keeps invariants 5 and 11; QEMU outlives ctx and the agent.
func (s *Supervisor) Launch(ctx context.Context, id string) (LaunchResult, error) {
	start := time.Now()
	clk := newClock(start, segLock)
	in, err := s.instance(id)
	if err != nil {
		return LaunchResult{}, fmt.Errorf("launch: %w", err)
	}
	if err := in.acquire(ctx); err != nil {
		return LaunchResult{}, fmt.Errorf("launch: %w", err)
	}
	defer in.release()
	l, err := s.st.Lock(ctx, id)
	if err != nil {
		return LaunchResult{}, fmt.Errorf("launch: %w", err)
	}
	defer unlock(l, in.log)

	rec, err := l.Get()
	if err != nil {
		return LaunchResult{}, fmt.Errorf("launch: %w", err)
	}
	if rec, _, err = s.resolveLaunchLocked(ctx, l, in, rec, false); err != nil {
		return LaunchResult{}, fmt.Errorf("launch: %w", err)
	}
	if store.IsDeleting(rec) {
		return LaunchResult{}, fmt.Errorf("launch instance %s: %w (state %s)", id, store.ErrDeleting, store.StateName(rec.GetState()))
	}
	marked, err := l.ManualStop()
	if err != nil {
		return LaunchResult{}, fmt.Errorf("launch: %w", err)
	}
	if marked {
		return LaunchResult{}, fmt.Errorf("launch instance %s: %w", id, ErrManualStop)
	}

	if p := rec.GetProcess(); p != nil {
		pid := store.IdentityOf(p)
		vm, alive, err := s.liveVMLocked(ctx, l, in, pid)
		if err != nil {
			return LaunchResult{}, fmt.Errorf("launch instance %s: %w", id, err)
		}
		if alive {
			st, err := s.waitReady(ctx, vm)
			switch {
			case errors.Is(err, errGone):
				// Died before QMP answered: record it, then launch anew.
				if _, _, err := s.liveVMLocked(ctx, l, in, pid); err != nil {
					return LaunchResult{}, fmt.Errorf("launch instance %s: %w", id, err)
				}
			case err != nil:
				// Alive but QMP does not answer: can't tell it is fine, and
				// a second QEMU must not start beside it.
				return LaunchResult{}, fmt.Errorf("launch instance %s: %v is alive but QMP failed: %w", id, pid, err)
			case !st.Running:
				return LaunchResult{}, fmt.Errorf("launch instance %s: %v is alive with status %q: %w", id, pid, st.Status, vmm.ErrNotRunning)
			default:
				if rec.GetState() != vmflowv1.InstanceState_INSTANCE_STATE_RUNNING {
					// Re-attached while Creating (the previous agent died
					// between fork and QMP ready): QMP now says running.
					if _, err := l.Apply(store.Running()); err != nil {
						return LaunchResult{}, fmt.Errorf("launch instance %s: %w", id, err)
					}
				}
				in.setVM(vm)
				in.log.Info("already running", zap.Int("pid", pid.PID))
				return LaunchResult{Identity: pid, AlreadyRunning: true, Duration: time.Since(start)}, nil
			}
		}
		if rec, err = l.Get(); err != nil {
			return LaunchResult{}, fmt.Errorf("launch: %w", err)
		}
	}
	if rec.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_RUNNING {
		// Running with no process: a record an older agent left half
		// written. It ended somehow; say so before starting anew.
		if rec, err = l.Apply(store.LostProcess(s.cfg.Now())); err != nil {
			return LaunchResult{}, fmt.Errorf("launch instance %s: %w", id, err)
		}
	}
	// An explicit launch supersedes a pending restart and starts a new
	// restart streak.
	in.cancelRestart()
	if rec.GetRestartCount() != 0 {
		if rec, err = l.Apply(store.NewRestartStreak()); err != nil {
			return LaunchResult{}, fmt.Errorf("launch instance %s: %w", id, err)
		}
	}
	vm, err := s.launchLocked(ctx, l, in, rec, clk)
	if err != nil {
		return LaunchResult{}, fmt.Errorf("launch instance %s: %w", id, err)
	}
	in.setVM(vm)
	s.watch(in, vm)
	end := time.Now()
	return LaunchResult{Identity: vm.Identity(), Duration: end.Sub(start), Timeline: clk.timeline(end)}, nil
}

// errGone: the VM's thread group ended while waiting for it.
var errGone = errors.New("vm exited")

// readyPollInterval is how often waitReady retries QMP. A QEMU re-attached
// right after its fork has no socket yet (it appears 40-150 ms later) and
// there is no event for "a socket appeared".
const readyPollInterval = 10 * time.Millisecond

// waitReady asks vm's QMP for its status until it answers, the VM exits
// (errGone) or Config.ReadyTimeout passes.
func (s *Supervisor) waitReady(ctx context.Context, vm *vmm.VM) (vmm.StatusInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReadyTimeout)
	defer cancel()
	t := time.NewTicker(readyPollInterval)
	defer t.Stop()
	for {
		st, err := vm.Status(ctx)
		if err == nil {
			return st, nil
		}
		if gone, gerr := vm.Exited(); gerr == nil && gone {
			return vmm.StatusInfo{}, errGone
		}
		select {
		case <-ctx.Done():
			return vmm.StatusInfo{}, fmt.Errorf("waiting for qmp of %v: %w (last: %w)", vm.Identity(), ctx.Err(), err)
		case <-t.C:
		}
	}
}

// liveVMLocked returns a VM for the recorded pid if its group is alive
// (watched, or newly attached); a gone process or a stranger's pid is recorded
// as gone. "Can't tell" is an error.
func (s *Supervisor) liveVMLocked(ctx context.Context, l *store.Locked, in *instance, pid proc.Identity) (*vmm.VM, bool, error) {
	if vm := in.current(pid); vm != nil {
		if gone, err := vm.Exited(); err == nil && !gone {
			return vm, true, nil
		}
		// Gone while its watcher waits for the slot this call holds:
		// record it here; the watcher then finds it handled.
		in.clearVM(vm)
		if _, err := s.recordGoneLocked(ctx, l, pid, s.exitOf(vm)); err != nil {
			return nil, false, err
		}
		return nil, false, nil
	}
	vm, err := vmm.Attach(pid, vmmPaths(l.Paths()))
	switch {
	case err == nil:
		stored := s.useFDStore(l, vm)
		if gone, err := vm.Exited(); err == nil && gone {
			if stored {
				captureLog(in, vm) // what it wrote before it died; Close drains it and empties the store
			}
			vm.Close()
			break
		}
		captureLog(in, vm)
		in.setVM(vm)
		s.watch(in, vm)
		return vm, true, nil
	case errors.Is(err, proc.ErrNotFound), errors.Is(err, proc.ErrIdentityMismatch):
	default:
		return nil, false, err
	}
	ex := store.Exit{At: s.cfg.Now(), Status: "unknown (gone while not watched)", Code: -1}
	if boot, err := proc.BootID(); err == nil && pid.BootID != boot {
		// Recorded before the host rebooted: that VM ended with the boot.
		// Whatever holds the pid now is a stranger and is never signalled.
		ex.Status = "host rebooted (recorded in boot " + pid.BootID + ")"
	}
	if _, err := s.recordGoneLocked(ctx, l, pid, ex); err != nil {
		return nil, false, err
	}
	return nil, false, nil
}

// useFDStore points an attached VM at the fd store where its launching agent
// kept its log pipe; false without a store or a uid to name it by.
func (s *Supervisor) useFDStore(l *store.Locked, vm *vmm.VM) bool {
	if s.cfg.FDStore == nil {
		return false
	}
	rec, err := l.Get()
	if err != nil || rec.GetQemuUid() == 0 {
		return false
	}
	vm.UseFDStore(s.cfg.FDStore, l.ID(), rec.GetQemuUid())
	return true
}

// captureLog resumes pumping a re-attached VM's guest output into its log; a
// failure costs only the log (invariant 12).
func captureLog(in *instance, vm *vmm.VM) {
	err := vm.CaptureLog()
	switch {
	case err == nil:
	case errors.Is(err, vmm.ErrLogNotPipe):
		in.log.Info("guest log not captured: this QEMU writes qemu.log itself (launched before the bounded log); bounded from its next launch",
			zap.Int("pid", vm.Identity().PID))
	default:
		in.log.Warn("guest log not captured; the VM is supervised all the same", zap.Error(err))
	}
}

// uidsInUse is every uid a new QEMU must not get: held by a process, or
// owning a VFIO node not yet taken back from a gone QEMU.
func (s *Supervisor) uidsInUse(ctx context.Context) (map[uint32]bool, error) {
	return UIDsInUse(s.cfg.DevRoot)(ctx)
}

// UIDsInUse is the scan of the uids a new QEMU must not get, on a host
// whose VFIO nodes are under devRoot ("/dev" when empty): held by a
// process (all of /proc), or owning a VFIO node not yet taken back from a
// gone QEMU. The store's index runs it once, at its seed (OpenIndex).
func UIDsInUse(devRoot string) func(context.Context) (map[uint32]bool, error) {
	if devRoot == "" {
		devRoot = "/dev"
	}
	return func(ctx context.Context) (map[uint32]bool, error) {
		used, err := proc.UIDsInUse(ctx)
		if err != nil {
			return nil, err
		}
		nodes, err := store.OwnersIn(filepath.Join(devRoot, "vfio"))
		if err != nil {
			return nil, fmt.Errorf("scan VFIO group nodes: %w", err)
		}
		for u := range nodes {
			used[u] = true
		}
		return used, nil
	}
}

// launchLocked launches QEMU for the locked rec by running launchStages and
// moves it to Running; on failure nothing remains but the leases (invariant
// 5).
// clk, if set, is told each stage and step as it begins.
func (s *Supervisor) launchLocked(ctx context.Context, l *store.Locked, in *instance, rec *vmflowv1.InstanceRecord, clk *clock) (*vmm.VM, error) {
	r := &launchRun{s: s, l: l, in: in, rec: rec, log: in.log, start: time.Now(), stages: launchStages, clk: clk}
	if s.hooks.launchStages != nil {
		r.stages = s.hooks.launchStages(launchStages)
	}
	if err := r.run(ctx); err != nil {
		return nil, err
	}
	_ = r.spec.Close() // vmm.Launch closed them after the fork; the agent holds no image
	return r.vm, nil
}

// undoLaunchLocked stops vm, a launch that cannot be completed, and clears
// it from the record with cause; it returns only its own failure.
func (s *Supervisor) undoLaunchLocked(l *store.Locked, vm *vmm.VM, cause error) error {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.GroupExitCap+5*time.Second)
	defer cancel()
	defer vm.Close()
	if _, err := vm.Stop(ctx, vmm.StopConfig{From: vmm.StepKillSent, KillTimeout: s.cfg.GroupExitCap}); err != nil {
		// Not confirmed gone: keep the pid in the record for a Stop.
		return fmt.Errorf("undo launch: %w", err)
	}
	pid := vm.Identity()
	if _, err := l.Apply(store.Gone(pid, store.Exit{At: s.cfg.Now(), Status: "launch undone", Code: -1}, takeBackVFIO),
		store.ClearLaunchMarker(), store.RecordError(cause.Error())); err != nil {
		return fmt.Errorf("undo launch: clear pid: %w", err)
	}
	return nil
}
