package supervise

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/network"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/internal/crashpoint"
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
}

// Launch starts QEMU for instance id (Creating, or Exited for a restart) and
// returns once QMP says running and the record says Running. Refuses with
// ErrManualStop or store.ErrDeleting; idempotent for a live matching QEMU
// (AlreadyRunning). Keeps invariants 5 and 11; QEMU outlives ctx and the agent.
func (s *Supervisor) Launch(ctx context.Context, id string) (LaunchResult, error) {
	start := time.Now()
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
	vm, err := s.launchLocked(ctx, l, in, rec)
	if err != nil {
		return LaunchResult{}, fmt.Errorf("launch instance %s: %w", id, err)
	}
	in.setVM(vm)
	s.watch(in, vm)
	return LaunchResult{Identity: vm.Identity(), Duration: time.Since(start)}, nil
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

// refuseLaunchLocked records why a launch was refused before anything was
// opened or started, and returns that error.
func refuseLaunchLocked(l *store.Locked, err error) error {
	if _, uerr := l.Apply(store.RecordError(err.Error())); uerr != nil {
		err = errors.Join(err, uerr)
	}
	return err
}

// uidsInUse is every uid a new QEMU must not get: held by a process, or
// owning a VFIO node not yet taken back from a gone QEMU.
func (s *Supervisor) uidsInUse(ctx context.Context) (map[uint32]bool, error) {
	used, err := proc.UIDsInUse(ctx)
	if err != nil {
		return nil, err
	}
	nodes, err := store.OwnersIn(filepath.Join(s.cfg.DevRoot, "vfio"))
	if err != nil {
		return nil, fmt.Errorf("scan VFIO group nodes: %w", err)
	}
	for u := range nodes {
		used[u] = true
	}
	return used, nil
}

// launchLocked launches QEMU for the locked rec and moves it to Running; on
// failure nothing remains (invariant 5).
func (s *Supervisor) launchLocked(ctx context.Context, l *store.Locked, in *instance, rec *vmflowv1.InstanceRecord) (*vmm.VM, error) {
	// Before anything is opened: a uid range the host also hands out (a
	// user's subordinate range, an account) would let someone else's
	// processes run as this VM's uid.
	if err := store.CheckUIDRange(s.cfg.QEMUUIDs, s.cfg.EtcDir); err != nil {
		return nil, refuseLaunchLocked(l, err)
	}
	spec, err := s.cfg.PrepareLaunch(ctx, l, rec)
	if err != nil {
		return nil, refuseLaunchLocked(l, fmt.Errorf("prepare launch: %w", err))
	}
	// The spec holds the images the agent opened: vmm.Launch closes them
	// after the fork; this covers the returns before it.
	defer spec.Close()
	// The guest name is the instance id: with the uid, it is what finds a
	// QEMU whose pid never made it into the record (resolveLaunchLocked).
	spec.Name = in.id
	log := in.log
	start := time.Now()
	// The launch marker goes to disk before the fork: an agent killed
	// between the fork and the pid's write leaves a record that says "a
	// QEMU of mine may exist", which the next agent resolves
	// (resolveLaunchLocked) instead of finding nothing. The instance's own
	// uid is assigned in the same write (under the store's host-wide uid
	// lock): what proves later that a process is this instance's QEMU, as
	// only the agent can start a process with it.
	nodes, err := s.vfioNodes(spec)
	if err != nil {
		return nil, err
	}
	rec, err = l.AssignQEMUUID(ctx, s.cfg.QEMUUIDs, s.uidsInUse, store.BeginLaunch(s.cfg.Now(), nodes))
	if err != nil {
		return nil, fmt.Errorf("record launch marker: %w", err)
	}
	uid := rec.GetQemuUid()
	log = log.With(zap.Uint32("qemu_uid", uid))
	for _, n := range nodes {
		if err := vmm.GiveVFIOGroup(n, uid); err != nil {
			err = fmt.Errorf("give vfio group: %w", err)
			_, uerr := l.Apply(store.LaunchFailed(proc.Identity{}, store.Exit{}, err.Error(), takeBackVFIO))
			return nil, errors.Join(err, uerr)
		}
	}
	if rec.GetSpec().GetNetwork() != "" {
		if err := s.attachNetworkLocked(ctx, l, uid, &spec); err != nil {
			_, uerr := l.Apply(store.LaunchFailed(proc.Identity{}, store.Exit{}, err.Error(), takeBackVFIO))
			return nil, errors.Join(err, uerr, s.detachNetworkLocked(l))
		}
		log = log.With(zap.String("address", spec.NIC.Address), zap.String("mac", spec.NIC.MAC))
	}
	spec.IO = spec.IO.Tighter(s.cfg.VMIO)
	log.Info("launching qemu", zap.String("machine", string(spec.Machine)), zap.String("accel", string(spec.Accel)))
	vm, err := vmm.Launch(ctx, vmm.LaunchConfig{
		Spec:           spec,
		Paths:          vmmPaths(l.Paths()),
		Binary:         s.cfg.QEMU,
		Confine:        vmm.Confinement{UID: uid, KVM: s.kvm, Cgroups: s.cfg.Cgroups, Jail: s.jail(l.Paths())},
		FDStore:        s.cfg.FDStore,
		ReadyTimeout:   s.cfg.ReadyTimeout,
		CleanupTimeout: s.cfg.GroupExitCap,
		OnStarted: func(pid proc.Identity) error {
			if s.hooks.beforeRecorded != nil {
				s.hooks.beforeRecorded(in.id, pid)
			}
			// Right after the fork: the pid replaces the marker in one
			// write, so the record always names the QEMU or says one may
			// exist.
			if _, err := l.Apply(store.Forked(pid, s.cfg.Now())); err != nil {
				return err
			}
			log.Info("qemu started", zap.Int("pid", pid.PID), zap.Uint64("start_time", pid.StartTime))
			if s.hooks.afterStarted != nil {
				s.hooks.afterStarted(in.id, pid)
			}
			return nil
		},
		OnFailed: func(pid proc.Identity, cause error) error {
			// Called only once QEMU is confirmed gone (or never started):
			// the marker has nothing left to stand for.
			_, err := l.Apply(store.LaunchFailed(pid, store.Exit{At: s.cfg.Now(), Status: "launch failed", Code: -1}, cause.Error(), takeBackVFIO))
			return err
		},
	})
	if err != nil {
		// Returned, not logged: the caller logs it (a restart) or returns
		// it (a Launch, to its activity). A failed launch leaves no TAP.
		return nil, errors.Join(err, s.detachNetworkLocked(l))
	}
	pid := vm.Identity()
	if _, err := l.Apply(store.Running()); err != nil {
		// QEMU runs but the record cannot say so: undo the launch rather
		// than leave a VM the record does not describe (invariant 5).
		return nil, errors.Join(s.undoLaunchLocked(l, vm, fmt.Errorf("record running: %w", err)), s.detachNetworkLocked(l))
	}
	crashpoint.Hit(crashpoint.LaunchRunningRecorded)
	log.Info("running", zap.Int("pid", pid.PID), zap.Duration("took", time.Since(start)))
	return vm, nil
}

// attachNetworkLocked gives the locked instance's launch its NIC: the
// network lease (written ahead when new), its TAP made and opened for uid,
// and the guest's address on the kernel command line (direct kernel boot;
// a disk image's guest configures itself from the same lease).
func (s *Supervisor) attachNetworkLocked(ctx context.Context, l *store.Locked, uid uint32, spec *vmm.VMSpec) error {
	if s.cfg.Network == nil {
		return fmt.Errorf("attach network: %w", network.ErrNoNetwork)
	}
	a, err := s.cfg.Network.AttachLocked(ctx, l, uid)
	if err != nil {
		return err
	}
	spec.NIC = &vmm.NIC{TAP: a.TAP, MAC: a.MAC, Address: a.Address.String()}
	if spec.Kernel != nil {
		spec.Cmdline = strings.TrimSpace(spec.Cmdline + " " + a.KernelParam())
	}
	return nil
}

// detachNetworkLocked removes the TAP of a launch that failed (the lease
// stays: the next launch makes the TAP again). Nothing without a network,
// and nothing while the record says a QEMU may live.
func (s *Supervisor) detachNetworkLocked(l *store.Locked) error {
	if s.cfg.Network == nil {
		return nil
	}
	return s.cfg.Network.DetachLocked(l)
}

// vfioNodes are the VFIO group nodes of spec's devices that exist (the
// vGPU simulator's devices have none).
func (s *Supervisor) vfioNodes(spec vmm.VMSpec) ([]string, error) {
	var nodes []string
	for _, dev := range spec.VFIO {
		n, err := vmm.VFIOGroupNode(s.cfg.DevRoot, dev)
		if err != nil {
			return nil, fmt.Errorf("prepare launch: %w", err)
		}
		if n != "" {
			if _, err := os.Lstat(n); err == nil {
				nodes = append(nodes, n)
			}
		}
	}
	return nodes, nil
}

func (s *Supervisor) undoLaunchLocked(l *store.Locked, vm *vmm.VM, cause error) error {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.GroupExitCap+5*time.Second)
	defer cancel()
	defer vm.Close()
	if _, err := vm.Stop(ctx, vmm.StopConfig{From: vmm.StepKillSent, KillTimeout: s.cfg.GroupExitCap}); err != nil {
		// Not confirmed gone: keep the pid in the record for a Stop.
		return errors.Join(cause, fmt.Errorf("undo launch: %w", err))
	}
	pid := vm.Identity()
	if _, err := l.Apply(store.Gone(pid, store.Exit{At: s.cfg.Now(), Status: "launch undone", Code: -1}, takeBackVFIO),
		store.ClearLaunchMarker(), store.RecordError(cause.Error())); err != nil {
		return errors.Join(cause, fmt.Errorf("undo launch: clear pid: %w", err))
	}
	return cause
}
