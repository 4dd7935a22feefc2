package supervise

import (
	"context"
	"errors"
	"fmt"
	"os"
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

// The launch's stages by name, in the order launchStages runs them.
const (
	stageAdmit    = "admit"
	stageCapacity = "capacity"
	stageSlot     = "start slot"
	stageLeases   = "ensure leases"
	stageUID      = "uid"
	stageVFIO     = "VFIO nodes"
	stageNetwork  = "network"
	stageFork     = "fork"
	stageRecord   = "record"
	stageQMPReady = "QMP ready"
)

// launchStage is one step of a launch, on the model of firecracker-go-sdk's
// handler lists (defaultFcInitHandlerList): a name a test finds, cuts or
// replaces the list by, what the stage does, and what a failure in it or
// after it takes back.
type launchStage struct {
	name string
	// crash are the crash points reached inside the stage (some in the
	// packages it calls), where the e2e crash matrix kills the agent. They
	// are listed to be read; the stages hit them where they always were.
	crash []string
	do    func(r *launchRun, ctx context.Context) error
	// undo takes back what do made, also when do stopped halfway; cause is
	// the failing stage's error. nil: nothing to take back.
	undo func(r *launchRun, cause error) error
}

// launchStages is the launch, in order. A failure at a stage runs the undos
// of that stage and of every stage before it, in reverse. What a failure
// leaves: the record says no QEMU may live (marker and pid cleared, VFIO
// nodes taken back, the error recorded), no process, no TAP, no file open;
// the leases (vGPU, whole GPU, network address) stay the instance's, for the
// next launch.
var launchStages = []launchStage{
	{name: stageAdmit, do: (*launchRun).admit},
	{name: stageCapacity, crash: []string{crashpoint.CapacityPlaced}, do: (*launchRun).placeCapacity},
	{name: stageSlot, do: (*launchRun).takeSlot},
	{name: stageLeases, do: (*launchRun).ensureLeases, undo: (*launchRun).closeSpec},
	{name: stageUID, crash: []string{crashpoint.StoreUIDLedgerWritten}, do: (*launchRun).assignUID, undo: (*launchRun).letGo},
	{name: stageVFIO, do: (*launchRun).giveVFIO, undo: (*launchRun).letGo},
	{name: stageNetwork, crash: []string{crashpoint.NetIntentWritten, crashpoint.NetTAPCreated, crashpoint.NetActivated},
		do: (*launchRun).attachNetwork, undo: (*launchRun).detachNetwork},
	{name: stageFork, crash: []string{crashpoint.LaunchBeforeFork, crashpoint.LaunchForked, crashpoint.LaunchQMPReady},
		do: (*launchRun).fork, undo: (*launchRun).kill},
	{name: stageRecord, crash: []string{crashpoint.LaunchPIDRecorded}, do: (*launchRun).recordPID},
	{name: stageQMPReady, crash: []string{crashpoint.LaunchRunningRecorded}, do: (*launchRun).recordRunning},
}

// launchRun is one launch of the locked instance: what its stages made so
// far, for the next stages and for the undos.
type launchRun struct {
	s      *Supervisor
	l      *store.Locked
	in     *instance
	rec    *vmflowv1.InstanceRecord
	log    *zap.Logger
	start  time.Time
	stages []launchStage
	// entered counts the stages whose do has begun: a failure takes back
	// stages[:entered].
	entered int

	spec  vmm.VMSpec
	nodes []string
	uid   uint32
	// marked: the record holds this launch's marker (the uid stage wrote
	// it); settled: the record has let go of it or a later stage owns that
	// write (from the fork on, vmm.Launch's OnFailed or kill). letGo writes
	// only when marked and not settled, so a failure is recorded once.
	marked, settled bool
	// releaseSlot gives back the start slot the launch holds (nil: none).
	releaseSlot func()
	// vmPID is the forked QEMU, for the record stage; vm, once QMP answered.
	vmPID proc.Identity
	vm    *vmm.VM
	// clk is told each stage as it begins (nil: not timed).
	clk *clock
}

// run runs r.stages in order; on a failure, the undos. The start slot is
// held to the end of the run: QMP ready, or the undos done.
func (r *launchRun) run(ctx context.Context) error {
	defer func() {
		if r.releaseSlot != nil {
			r.releaseSlot()
		}
	}()
	for r.entered < len(r.stages) {
		if err := r.next(ctx); err != nil {
			return r.takeBack(err)
		}
	}
	return nil
}

// next runs the next stage. The fork calls it too, for the stage after it,
// between the fork and the wait for QMP (vmm.Launch's OnStarted): that is
// where the pid is recorded.
func (r *launchRun) next(ctx context.Context) error {
	st := r.stages[r.entered]
	r.entered++
	r.clk.mark(st.name)
	return st.do(r, ctx)
}

// takeBack runs the undos of the stages entered, the failed one first, and
// returns cause with their errors.
func (r *launchRun) takeBack(cause error) error {
	errs := []error{cause}
	for i := r.entered - 1; i >= 0; i-- {
		if u := r.stages[i].undo; u != nil {
			if err := u(r, cause); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if len(errs) == 1 {
		return cause
	}
	return errors.Join(errs...)
}

// admit: a uid range the host also hands out (a user's subordinate range, an
// account) would let someone else's processes run as this VM's uid; and the
// record must still be admitted by this host's policy (Config.Admit). A
// refusal is recorded; nothing is opened or held.
func (r *launchRun) admit(ctx context.Context) error {
	if err := store.CheckUIDRange(r.s.cfg.QEMUUIDs, r.s.cfg.EtcDir); err != nil {
		return refuseLaunchLocked(r.l, err)
	}
	if r.s.cfg.Admit != nil {
		if err := r.s.cfg.Admit(ctx, r.rec); err != nil {
			return refuseLaunchLocked(r.l, fmt.Errorf("prepare launch: %w", err))
		}
	}
	return nil
}

// placeCapacity: the instance's share of the host active in its record
// (Config.PlaceCapacity), or a refusal recorded and nothing held. No undo:
// like its devices, the share stays the instance's for its next launch
// until the delete releases it.
func (r *launchRun) placeCapacity(ctx context.Context) error {
	if r.s.cfg.PlaceCapacity == nil {
		return nil
	}
	rec, err := r.s.cfg.PlaceCapacity(ctx, r.l)
	if err != nil {
		return refuseLaunchLocked(r.l, err)
	}
	r.rec = rec
	return nil
}

// ensureLeases: the held devices made sure of and QEMU's spec assembled
// (Config.PrepareLaunch); the spec holds the images the agent opened.
func (r *launchRun) ensureLeases(ctx context.Context) error {
	spec, err := r.s.cfg.PrepareLaunch(ctx, r.l, r.rec)
	if err != nil {
		return refuseLaunchLocked(r.l, fmt.Errorf("prepare launch: %w", err))
	}
	r.spec = spec
	// The guest name is the instance id: with the uid, it is what finds a
	// QEMU whose pid never made it into the record (resolveLaunchLocked).
	r.spec.Name = r.in.id
	return nil
}

// closeSpec closes the images (vmm.Launch closes its own after the fork;
// this covers the failures before it). The leases stay.
func (r *launchRun) closeSpec(error) error {
	_ = r.spec.Close()
	return nil
}

// assignUID writes the launch marker before the fork: an agent killed
// between the fork and the pid's write leaves a record that says "a QEMU of
// mine may exist", which the next agent resolves (resolveLaunchLocked)
// instead of finding nothing. The instance's own uid is assigned in the
// same write (under the store's host-wide uid lock): what proves later that
// a process is this instance's QEMU, as only the agent can start a process
// with it. The VFIO nodes the launch gives are in the write too, so a crash
// after it takes them back.
func (r *launchRun) assignUID(ctx context.Context) error {
	nodes, err := r.s.vfioNodes(r.spec)
	if err != nil {
		return err
	}
	r.nodes = nodes
	rec, err := r.l.AssignQEMUUID(ctx, r.s.cfg.QEMUUIDs, r.s.uidsInUse, store.BeginLaunch(r.s.cfg.Now(), nodes))
	if err != nil {
		return fmt.Errorf("record launch marker: %w", err)
	}
	r.marked = true
	r.rec, r.uid = rec, rec.GetQemuUid()
	r.log = r.log.With(zap.Uint32("qemu_uid", r.uid))
	return nil
}

// letGo is the undo of uid and VFIO nodes: the record stops saying a QEMU
// may exist (marker cleared), the nodes given are taken back, the cause is
// recorded, in one write. The uid stays the instance's (its ledger entry
// names the instance; the next launch gets it again).
func (r *launchRun) letGo(cause error) error {
	if !r.marked || r.settled {
		return nil
	}
	r.settled = true
	_, err := r.l.Apply(store.LaunchFailed(proc.Identity{}, store.Exit{}, cause.Error(), takeBackVFIO))
	return err
}

// giveVFIO gives the VM's VFIO group nodes to its uid.
func (r *launchRun) giveVFIO(context.Context) error {
	for _, n := range r.nodes {
		if err := vmm.GiveVFIOGroup(n, r.uid); err != nil {
			return fmt.Errorf("give vfio group: %w", err)
		}
	}
	return nil
}

// attachNetwork gives the launch its NIC when the record asks for a network:
// the network lease (written ahead when new), its TAP made and opened for
// the uid, and the guest's address on the kernel command line (direct
// kernel boot; a disk image's guest configures itself from the same lease).
func (r *launchRun) attachNetwork(ctx context.Context) error {
	if r.rec.GetSpec().GetNetwork() == "" {
		return nil
	}
	if r.s.cfg.Network == nil {
		return fmt.Errorf("attach network: %w", network.ErrNoNetwork)
	}
	a, err := r.s.cfg.Network.AttachLocked(ctx, r.l, r.uid)
	if err != nil {
		return err
	}
	r.spec.NIC = &vmm.NIC{TAP: a.TAP, MAC: a.MAC, Address: a.Address.String()}
	if r.spec.Kernel != nil {
		r.spec.Cmdline = strings.TrimSpace(r.spec.Cmdline + " " + a.KernelParam())
	}
	r.log = r.log.With(zap.String("address", r.spec.NIC.Address), zap.String("mac", r.spec.NIC.MAC))
	return nil
}

// detachNetwork removes the TAP of a launch that failed; the lease stays
// (the next launch makes the TAP again). The record lets go first: a TAP is
// removed only once the record no longer says a QEMU may live, which
// DetachLocked checks.
func (r *launchRun) detachNetwork(cause error) error {
	err := r.letGo(cause)
	if r.s.cfg.Network == nil {
		return err
	}
	return errors.Join(err, r.s.cfg.Network.DetachLocked(r.l))
}

// fork starts QEMU, runs the next stage (record) right after the fork, and
// returns once QMP says running. A failure inside is taken back by
// vmm.Launch itself: QEMU killed and reaped, then OnFailed clears the pid
// and the marker; a QEMU not confirmed gone stays in the record for a Stop.
func (r *launchRun) fork(ctx context.Context) error {
	s, l := r.s, r.l
	r.settled = true
	r.spec.IO = r.spec.IO.Tighter(s.cfg.VMIO)
	r.log.Info("launching qemu", zap.String("machine", string(r.spec.Machine)), zap.String("accel", string(r.spec.Accel)))
	vm, err := vmm.Launch(ctx, vmm.LaunchConfig{
		Spec:           r.spec,
		Paths:          vmmPaths(l.Paths()),
		Binary:         s.cfg.QEMU,
		Confine:        vmm.Confinement{UID: r.uid, KVM: s.kvm, Cgroups: s.cfg.Cgroups, Jail: s.jail(l.Paths())},
		FDStore:        s.cfg.FDStore,
		ReadyTimeout:   s.cfg.ReadyTimeout,
		CleanupTimeout: s.cfg.GroupExitCap,
		Mark:           r.clk.mark,
		OnStarted: func(pid proc.Identity) error {
			r.vmPID = pid
			if s.hooks.beforeRecorded != nil {
				s.hooks.beforeRecorded(r.in.id, pid)
			}
			if r.entered < len(r.stages) {
				if err := r.next(ctx); err != nil {
					return err
				}
			}
			if s.hooks.afterStarted != nil {
				s.hooks.afterStarted(r.in.id, pid)
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
		// it (a Launch, to its activity).
		return err
	}
	r.vm = vm
	return nil
}

// takeSlot waits for one of the host's LaunchConcurrency start slots (ctx
// bounds the wait), held until the run ends. The wait comes before the
// launch marker, the uid and the fork: a queued launch holds nothing, and
// its ReadyTimeout counts from its own fork.
func (r *launchRun) takeSlot(ctx context.Context) error {
	starts := r.s.starts
	release := func() { <-starts }
	select {
	case starts <- struct{}{}:
		r.releaseSlot = release
		return nil
	default:
	}
	t0 := time.Now()
	r.log.Info("waiting for a launch slot", zap.Int("launches_in_flight", len(starts)))
	select {
	case starts <- struct{}{}:
		r.releaseSlot = release
		r.log.Info("launch slot taken", zap.Duration("waited", time.Since(t0)))
		return nil
	case <-ctx.Done():
		return fmt.Errorf("wait for a launch slot (%d in flight): %w", cap(starts), ctx.Err())
	}
}

// kill undoes a fork that returned a VM: QEMU stopped and reaped, then the
// record cleared of its pid and marker (VFIO nodes taken back, the cause
// recorded); its QMP socket goes with it. A QEMU not confirmed gone keeps
// its pid in the record for a Stop.
func (r *launchRun) kill(cause error) error {
	if r.vm == nil {
		return nil
	}
	return r.s.undoLaunchLocked(r.l, r.vm, cause)
}

// recordPID: right after the fork, the pid replaces the marker in one write,
// so the record always names the QEMU or says one may exist. Its undo is
// the fork's (the pid is cleared with the exit, in one write).
func (r *launchRun) recordPID(context.Context) error {
	if _, err := r.l.Apply(store.Forked(r.vmPID, r.s.cfg.Now())); err != nil {
		return err
	}
	r.log.Info("qemu started", zap.Int("pid", r.vmPID.PID), zap.Uint64("start_time", r.vmPID.StartTime))
	return nil
}

// recordRunning: QMP said running (vmm.Launch waited for it); the record
// says so. If it cannot, the launch is undone rather than leave a VM the
// record does not describe (invariant 5).
func (r *launchRun) recordRunning(context.Context) error {
	if _, err := r.l.Apply(store.Running()); err != nil {
		return fmt.Errorf("record running: %w", err)
	}
	crashpoint.Hit(crashpoint.LaunchRunningRecorded)
	r.log.Info("running", zap.Int("pid", r.vm.Identity().PID), zap.Duration("took", time.Since(r.start)))
	return nil
}

// refuseLaunchLocked records why a launch was refused before anything was
// opened or started, and returns that error.
func refuseLaunchLocked(l *store.Locked, err error) error {
	if _, uerr := l.Apply(store.RecordError(err.Error())); uerr != nil {
		err = errors.Join(err, uerr)
	}
	return err
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
