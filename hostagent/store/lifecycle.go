package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/proc"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The instance's lifecycle as named steps: every change of a field the
// lifecycle owns (the state, the launch marker, the process, the stop step,
// the exit, the restart count, needs-attention, last_error, the leases, the
// disk base) is one of these, applied with Locked.Apply, and each checks its
// own precondition and refuses what it does not allow with a *StepError.
// Update's backstop (the state table, the marker rule, validation) still
// checks every write. Code outside this package never sets those fields
// (the import-rule test in hostagent/ walks for assignments).
//
// A launch:  BeginLaunch → Forked → Running, or → LaunchFailed
// An exit:   Gone (or LostProcess for a Running record with no process)
// A stop:    StopStepTaken … (with Gone at the last step), or NothingRuns
// A delete:  Locked.BeginDelete → the leases' LeaseReleasing →
//            LeaseReleased | LeaseReleaseFailed → Locked.Delete
// A lease:   LeaseIntent → VGPUActive or NetworkActive → LeaseReleasing → LeaseReleased

// A Step is one named transition of an instance record.
type Step struct {
	name  string
	apply func(r *vmflowv1.InstanceRecord) error
}

// StepError is a step its precondition refused. It wraps Err, the sentinel
// callers branch on (ErrIllegalTransition, ErrConflict, ErrDeleting).
type StepError struct {
	Step   string
	State  vmflowv1.InstanceState
	Reason string
	Err    error
}

func (e *StepError) Error() string {
	return fmt.Sprintf("%s: %s refused in state %s: %s", e.Err, e.Step, StateName(e.State), e.Reason)
}

// Unwrap makes errors.Is see Err.
func (e *StepError) Unwrap() error { return e.Err }

func refuse(step string, r *vmflowv1.InstanceRecord, sentinel error, format string, args ...any) error {
	return &StepError{Step: step, State: r.GetState(), Reason: fmt.Sprintf(format, args...), Err: sentinel}
}

// Apply applies steps in order to the record and writes the result once
// (nothing when they change nothing). A refused step writes nothing.
func (l *Locked) Apply(steps ...Step) (*vmflowv1.InstanceRecord, error) {
	return l.update(applySteps(steps), false)
}

// Apply is Locked.Apply under instance id's lock.
func (s *Store) Apply(ctx context.Context, id string, steps ...Step) (rec *vmflowv1.InstanceRecord, err error) {
	err = s.withLock(ctx, id, func(l *Locked) error {
		rec, err = l.Apply(steps...)
		return err
	})
	return rec, err
}

func applySteps(steps []Step) func(*vmflowv1.InstanceRecord) error {
	return func(r *vmflowv1.InstanceRecord) error {
		for _, s := range steps {
			if err := s.apply(r); err != nil {
				return err
			}
		}
		return nil
	}
}

// Exit is how a QEMU ended, as the record keeps it.
type Exit struct {
	At     time.Time
	Status string // "exit status 1", "signal: killed", "unknown (...)"
	Code   int32  // -1 for a signal or an unknown status
}

// TakeBack returns VFIO group nodes a QEMU's uid was given to root and
// returns the ones it could not (they stay listed for the next try). The
// steps that record a QEMU gone call it with the record's nodes.
type TakeBack func(nodes []string) (left []string)

func ts(t time.Time) *timestamppb.Timestamp { return timestamppb.New(t) }

// MayQEMULive returns nil when no QEMU of rec can run, else why: a launch
// marker, or a process alive or unreadable (invariant 2). With unproven, also
// a record naming none whose absence no stop confirmed, if launched says it
// ever launched (an agent older than the marker killed between fork and pid).
func MayQEMULive(rec *vmflowv1.InstanceRecord, unproven bool, launched func() (bool, error)) error {
	if at := rec.GetLaunchStartedAt(); at != nil && rec.GetProcess() == nil {
		return fmt.Errorf("a launch began at %s and its QEMU is not recorded yet", at.AsTime().UTC().Format(time.RFC3339Nano))
	}
	if p := rec.GetProcess(); p != nil {
		st := proc.Inspect(IdentityOf(p))
		if st.Alive {
			detail := fmt.Sprintf("%d tasks", st.Tasks)
			if st.Err != "" {
				detail = st.Err
			}
			return fmt.Errorf("%v is %s (%s)", st.Identity, st.State, detail)
		}
		return nil
	}
	if !unproven || rec.GetStopStep() == vmflowv1.StopStep_STOP_STEP_GONE {
		return nil
	}
	if rec.GetLastStart() == nil && rec.GetLastExit() == nil {
		ok, err := launched()
		if err != nil {
			return fmt.Errorf("cannot tell whether a QEMU was started: %w", err)
		}
		if !ok {
			return nil
		}
	}
	return fmt.Errorf("no process recorded and no stop has confirmed that none runs (stop step %s)", rec.GetStopStep())
}

// BeginLaunch writes the launch marker before the fork (invariant 11), with the
// VFIO nodes its uid is about to get, so whoever records it gone takes them
// back. Refused while deleting or while a process is recorded.
func BeginLaunch(at time.Time, vfioNodes []string) Step {
	const name = "begin launch"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if IsDeleting(r) {
			return refuse(name, r, ErrDeleting, "a delete has begun")
		}
		if r.GetProcess() != nil {
			return refuse(name, r, ErrIllegalTransition, "a QEMU is recorded")
		}
		r.LaunchStartedAt, r.LaunchNonce = ts(at), ""
		for _, n := range vfioNodes {
			if !slices.Contains(r.VfioGroupNodes, n) {
				r.VfioGroupNodes = append(r.VfioGroupNodes, n)
			}
		}
		return nil
	}}
}

// Forked replaces the launch marker with the forked QEMU in one write, and
// clears an earlier refusal. Refused unless a launch began with no process.
func Forked(pid proc.Identity, at time.Time) Step {
	const name = "forked"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if r.GetLaunchStartedAt() == nil || r.GetProcess() != nil {
			return refuse(name, r, ErrIllegalTransition, "no launch marker, or a QEMU already recorded")
		}
		r.Process = ProcessRecord(pid)
		r.LaunchStartedAt, r.LaunchNonce = nil, ""
		r.LastStart = ts(at)
		r.StopStep, r.StopStepAt, r.StopStepBoot = vmflowv1.StopStep_STOP_STEP_NONE, nil, nil
		r.LastError = ""
		r.NeedsAttention, r.NeedsAttentionAt = "", nil
		return nil
	}}
}

// Adopted records an unrecorded QEMU the supervisor found and clears the
// marker. Refused while a process is recorded.
func Adopted(pid proc.Identity) Step {
	const name = "adopted"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if r.GetProcess() != nil {
			return refuse(name, r, ErrIllegalTransition, "a QEMU is recorded")
		}
		r.Process = ProcessRecord(pid)
		if r.GetLaunchStartedAt() != nil {
			r.LastStart = r.GetLaunchStartedAt()
		}
		r.LaunchStartedAt, r.LaunchNonce = nil, ""
		r.StopStep, r.StopStepAt, r.StopStepBoot = vmflowv1.StopStep_STOP_STEP_NONE, nil, nil
		return nil
	}}
}

// ClearLaunchMarker removes the launch marker (and an older agent's nonce):
// no QEMU of the launch runs, or the recorded process rules.
func ClearLaunchMarker() Step {
	return Step{"clear launch marker", func(r *vmflowv1.InstanceRecord) error {
		r.LaunchStartedAt, r.LaunchNonce = nil, ""
		return nil
	}}
}

// Running moves the record to Running once QMP says so. Refused without a
// recorded process; a record already Running is left as it is.
func Running() Step {
	const name = "running"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if r.GetProcess() == nil {
			return refuse(name, r, ErrIllegalTransition, "no QEMU recorded")
		}
		if r.GetState() != running {
			r.State = running
		}
		return nil
	}}
}

// LaunchFailed undoes a launch whose QEMU is confirmed gone or never started:
// pid and marker cleared, exit and cause kept, VFIO nodes taken back.
func LaunchFailed(pid proc.Identity, ex Exit, cause string, takeBack TakeBack) Step {
	return Step{"launch failed", func(r *vmflowv1.InstanceRecord) error {
		if pid.Valid() && r.GetProcess() != nil && IdentityOf(r.GetProcess()) == pid {
			r.Process = nil
			setExit(r, ex)
		}
		r.LaunchStartedAt, r.LaunchNonce = nil, ""
		r.VfioGroupNodes = takeBack(r.GetVfioGroupNodes())
		r.LastError = cause
		return nil
	}}
}

// Gone records pid's thread group gone: process cleared, exit kept, VFIO nodes
// taken back, Running to Exited, restart count reset after a stable run. A
// record no longer naming pid is left alone.
func Gone(pid proc.Identity, ex Exit, takeBack TakeBack) Step {
	return Step{"gone", func(r *vmflowv1.InstanceRecord) error {
		if r.GetProcess() == nil || IdentityOf(r.GetProcess()) != pid {
			return nil
		}
		r.VfioGroupNodes = takeBack(r.GetVfioGroupNodes())
		r.Process = nil
		setExit(r, ex)
		if r.GetState() == running {
			r.State = exited
		}
		// Decided here, at the exit, from the recorded start: no timer,
		// and the same answer after an agent restart.
		if st := r.GetRestartStableAfterSeconds(); st > 0 && r.GetLastStart() != nil &&
			ex.At.Sub(r.GetLastStart().AsTime()) >= time.Duration(st)*time.Second {
			r.RestartCount = 0
		}
		return nil
	}}
}

// LostProcess ends a Running record that names no process; its QEMU ended
// unseen. Refused while a process is recorded.
func LostProcess(at time.Time) Step {
	const name = "lost process"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if r.GetProcess() != nil {
			return refuse(name, r, ErrIllegalTransition, "a QEMU is recorded")
		}
		if r.GetState() != running {
			return nil
		}
		r.State = exited
		setExit(r, Exit{At: at, Status: "unknown (no process recorded)", Code: -1})
		return nil
	}}
}

func setExit(r *vmflowv1.InstanceRecord, ex Exit) {
	r.LastExit, r.LastExitBoot = ts(ex.At), BootMomentNow()
	r.LastExitStatus, r.LastExitCode = ex.Status, ex.Code
}

// StopStepTaken records how far the stop ladder got, so a restarted agent
// resumes it.
func StopStepTaken(step vmflowv1.StopStep, at time.Time) Step {
	return Step{"stop step", func(r *vmflowv1.InstanceRecord) error {
		r.StopStep, r.StopStepAt, r.StopStepBoot = step, ts(at), BootMomentNow()
		return nil
	}}
}

// NothingRuns records that a stop found no QEMU: stop step gone, Running to
// Exited. Refused while a process is recorded.
func NothingRuns(at time.Time) Step {
	const name = "nothing runs"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if r.GetProcess() != nil {
			return refuse(name, r, ErrIllegalTransition, "a QEMU is recorded")
		}
		if r.GetStopStepAt() == nil || r.GetStopStep() != vmflowv1.StopStep_STOP_STEP_GONE {
			r.StopStepAt, r.StopStepBoot = ts(at), BootMomentNow()
		}
		r.StopStep = vmflowv1.StopStep_STOP_STEP_GONE
		if r.GetState() == running {
			r.State = exited
		}
		return nil
	}}
}

// NewRestartStreak resets the restart count: an explicit launch supersedes
// the restart policy's streak.
func NewRestartStreak() Step {
	return Step{"new restart streak", func(r *vmflowv1.InstanceRecord) error {
		r.RestartCount = 0
		return nil
	}}
}

// RestartAttempt records the restart policy's attempt n before it launches;
// only an Exited record with no QEMU.
func RestartAttempt(n uint32) Step {
	const name = "restart attempt"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if r.GetState() != exited || r.GetProcess() != nil {
			return refuse(name, r, ErrIllegalTransition, "not an exited VM")
		}
		r.RestartCount = n
		return nil
	}}
}

// RestartRefused records a restart the host's configuration refused: count
// restored (nothing started), needs attention.
func RestartRefused(count uint32, reason string, at time.Time) Step {
	return Step{"restart refused", func(r *vmflowv1.InstanceRecord) error {
		r.RestartCount = count
		r.NeedsAttention, r.NeedsAttentionAt = reason, ts(at)
		return nil
	}}
}

// NeedsAttention says an operator must look, and why; the first-needed time is
// kept while the reason stays, or while keepSince's kind is replaced.
func NeedsAttention(reason string, at time.Time, keepSince bool) Step {
	return Step{"needs attention", func(r *vmflowv1.InstanceRecord) error {
		if r.GetNeedsAttention() == reason {
			return nil
		}
		if !keepSince || r.GetNeedsAttention() == "" {
			r.NeedsAttentionAt = ts(at)
		}
		r.NeedsAttention = reason
		return nil
	}}
}

// RecordError keeps the last failure worth showing an operator.
func RecordError(text string) Step {
	return Step{"record error", func(r *vmflowv1.InstanceRecord) error {
		r.LastError = text
		return nil
	}}
}

// DiskBaseSeen records the disk's base image the overlay was first made on.
// Refused (ErrConflict) when another base is recorded.
func DiskBaseSeen(id *vmflowv1.FileIdentity) Step {
	const name = "disk base seen"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if was := r.GetDiskBase(); was != nil && !proto.Equal(was, id) {
			return refuse(name, r, ErrConflict, "another base image is recorded")
		}
		r.DiskBase = id
		return nil
	}}
}

// The delete.

// Spawn names a spawn workflow execution: a failed spawn's clean-up deletes
// only what that spawn created (invariant 9). The zero Spawn is a delete
// asked for by anyone.
type Spawn struct{ WorkflowID, RunID string }

// DeleteBegun is what Locked.BeginDelete did.
type DeleteBegun struct {
	// Record as it now is (nil when Absent or NotOwned).
	Record *vmflowv1.InstanceRecord
	// Absent: there was no record.
	Absent bool
	// NotOwned: the clean-up's spawn did not create the record; nothing
	// was written. CreatedBy says who did.
	NotOwned  bool
	CreatedBy string
}

// BeginDelete writes the manual-stop marker, then Deleting (invariant 6). A
// clean-up (by set) touches only its own spawn's record (NotOwned otherwise,
// an error if unreadable, invariant 9); with by zero the marker goes first
// even on an unreadable record. A missing record is Absent.
func (l *Locked) BeginDelete(by Spawn) (DeleteBegun, error) {
	if err := l.held(); err != nil {
		return DeleteBegun{}, err
	}
	rec, err := l.Get()
	if errors.Is(err, ErrNotFound) {
		return DeleteBegun{Absent: true}, nil
	}
	if by.WorkflowID != "" {
		if err != nil {
			return DeleteBegun{}, fmt.Errorf("begin delete: whose record is unknown, nothing written: %w", err)
		}
		if !CreatedBy(rec, by.WorkflowID, by.RunID) {
			return DeleteBegun{NotOwned: true, CreatedBy: CreatorOf(rec)}, nil
		}
	}
	if err := l.MarkManualStop(); err != nil {
		return DeleteBegun{}, fmt.Errorf("write manual-stop marker: %w", err)
	}
	rec, err = l.Apply(Step{"begin delete", func(r *vmflowv1.InstanceRecord) error {
		if !isDeleting(r.GetState()) {
			r.State = deleting
		}
		return nil
	}})
	if err != nil {
		return DeleteBegun{}, fmt.Errorf("begin delete: %w", err)
	}
	return DeleteBegun{Record: rec}, nil
}

// Leases.

// LeaseIntent records a lease before its resource exists (INTENT); ErrDeleting
// once a delete began, ErrConflict for a lease of that name. How many of a
// kind an instance may hold is its claimer's to decide.
func LeaseIntent(lease *vmflowv1.Lease, at time.Time) Step {
	const name = "lease intent"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		if IsDeleting(r) {
			return refuse(name, r, ErrDeleting, "a delete has begun")
		}
		n := LeaseName(lease)
		for _, have := range r.GetLeases() {
			if LeaseName(have) == n || (lease.GetNetwork() != nil && have.GetNetwork() != nil) {
				return refuse(name, r, ErrConflict, "the record already has %s", DescribeLease(have))
			}
		}
		l := proto.CloneOf(lease)
		l.Phase, l.ClaimedAt = vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, ts(at)
		r.Leases = append(r.Leases, l)
		return nil
	}}
}

// VGPUActive records that the vGPU lease name's device exists (phase
// ACTIVE), with the device id and parent the driver reports.
func VGPUActive(name, deviceID, parent string) Step {
	const step = "vgpu active"
	return Step{step, func(r *vmflowv1.InstanceRecord) error {
		l, err := heldLease(step, r, name)
		if err != nil {
			return err
		}
		v := l.GetVgpu()
		if v == nil {
			return refuse(step, r, ErrIllegalTransition, "lease %s is no vgpu lease", name)
		}
		v.DeviceId, l.Phase = deviceID, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		if parent != "" {
			v.Parent = parent
		}
		return nil
	}}
}

// PassthroughActive records that lease name's IOMMU group is bound to
// vfio-pci (phase ACTIVE); the functions and their previous drivers were
// written with its intent.
func PassthroughActive(name string) Step {
	const step = "passthrough active"
	return Step{step, func(r *vmflowv1.InstanceRecord) error {
		l, err := heldLease(step, r, name)
		if err != nil {
			return err
		}
		if l.GetGpuPassthrough() == nil {
			return refuse(step, r, ErrIllegalTransition, "lease %s is no passthrough lease", name)
		}
		l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		return nil
	}}
}

// NetworkActive records that the network lease's TAP exists (phase
// ACTIVE).
func NetworkActive() Step {
	const name = "network active"
	return Step{name, func(r *vmflowv1.InstanceRecord) error {
		l := Network(r)
		if !LeaseHeld(l) {
			return refuse(name, r, ErrIllegalTransition, "no held network lease")
		}
		if l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING {
			return refuse(name, r, ErrIllegalTransition, "the network lease is being released")
		}
		l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		return nil
	}}
}

// CapacityPlaced records the share of the host a launch holds (phase
// ACTIVE, no expiry): c replaces a held INTENT (its placement chosen, or
// an expired one reserved again), or is added to a record that holds none
// (written before the ledger). Refused once the record's capacity lease is
// being released or released: a delete has it.
func CapacityPlaced(c *vmflowv1.CapacityLease, at time.Time) Step {
	const step = "capacity placed"
	return Step{step, func(r *vmflowv1.InstanceRecord) error {
		if IsDeleting(r) {
			return refuse(step, r, ErrDeleting, "a delete has begun")
		}
		placed := proto.CloneOf(c)
		placed.ExpiresAt = nil
		l := Capacity(r)
		switch {
		case l == nil:
			r.Leases = append(r.Leases, &vmflowv1.Lease{Phase: vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, ClaimedAt: ts(at),
				Resource: &vmflowv1.Lease_Capacity{Capacity: placed}})
			return nil
		case !LeaseHeld(l) || l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING:
			return refuse(step, r, ErrIllegalTransition, "its %s is being released", DescribeLease(l))
		}
		l.Resource = &vmflowv1.Lease_Capacity{Capacity: placed}
		l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		return nil
	}}
}

// NeverLaunched reports whether no QEMU of rec was ever started or begun:
// a Creating record with no launch marker, process, start or exit. Only
// then may a claim undo its own leases without a delete: no VM can have
// been given their resources.
func NeverLaunched(r *vmflowv1.InstanceRecord) bool {
	return r.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_CREATING && r.GetLaunchStartedAt() == nil &&
		r.GetProcess() == nil && r.GetLastStart() == nil && r.GetLastExit() == nil
}

// unlaunchedLease is the held lease name of a record that never launched,
// or a refusal of step: the precondition of a claim's rollback.
func unlaunchedLease(step string, r *vmflowv1.InstanceRecord, name string) (*vmflowv1.Lease, error) {
	if !NeverLaunched(r) {
		return nil, refuse(step, r, ErrIllegalTransition, "the record is not a creating one that never launched")
	}
	return heldLease(step, r, name)
}

// LeaseRollingBack marks lease name's undo under way (phase RELEASING),
// written before the resource is released: a claim of several that failed
// part-way undoes what it made. Refused unless the record never launched
// (NeverLaunched; a delete releases through LeaseReleasing instead).
func LeaseRollingBack(name string) Step {
	const step = "lease rolling back"
	return Step{step, func(r *vmflowv1.InstanceRecord) error {
		l, err := unlaunchedLease(step, r, name)
		if err != nil {
			return err
		}
		l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING
		return nil
	}}
}

// LeaseRolledBack drops lease name, whose resource is confirmed released,
// from a record that never launched: the claim it belonged to is undone as
// if never made, so a later claim may place on the same resource. Refused
// unless LeaseRollingBack was written.
func LeaseRolledBack(name string) Step {
	const step = "lease rolled back"
	return Step{step, func(r *vmflowv1.InstanceRecord) error {
		l, err := unlaunchedLease(step, r, name)
		if err != nil {
			return err
		}
		if l.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING {
			return refuse(step, r, ErrIllegalTransition, "lease %s is %s, not rolling back", name, l.GetPhase())
		}
		r.Leases = slices.DeleteFunc(r.Leases, func(x *vmflowv1.Lease) bool { return x == l })
		return nil
	}}
}

// heldLease is the held lease named name in r, or a refusal of step.
func heldLease(step string, r *vmflowv1.InstanceRecord, name string) (*vmflowv1.Lease, error) {
	for _, l := range r.GetLeases() {
		if LeaseName(l) == name && LeaseHeld(l) {
			return l, nil
		}
	}
	return nil, refuse(step, r, ErrIllegalTransition, "no held lease %s", name)
}

// LeaseReleasing marks lease name's release under way, before the kernel
// write. Only a held lease of a deleting record.
func LeaseReleasing(name string) Step {
	const step = "lease releasing"
	return Step{step, func(r *vmflowv1.InstanceRecord) error {
		if !IsDeleting(r) {
			return refuse(step, r, ErrIllegalTransition, "no delete has begun")
		}
		l, err := heldLease(step, r, name)
		if err != nil {
			return err
		}
		l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING
		return nil
	}}
}

// leaseLabel is a kind's name in an operator's message.
func leaseLabel(l *vmflowv1.Lease) string {
	switch {
	case l.GetVgpu() != nil:
		return "vGPU"
	case l.GetGpuPassthrough() != nil:
		return "whole GPU"
	}
	return LeaseKind(l)
}

// LeaseReleaseFailed keeps lease name held (invariant 1) with the attempt and
// error, back from releasing to active; a deleting record shows ReleaseFailed.
func LeaseReleaseFailed(name, cause string) Step {
	return Step{"lease release failed", func(r *vmflowv1.InstanceRecord) error {
		label := "lease"
		if l, err := heldLease("", r, name); err == nil {
			l.ReleaseAttempts++
			l.LastReleaseError = cause
			if l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING {
				l.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
			}
			label = leaseLabel(l)
		}
		r.LastError = "release " + label + ": " + cause
		if r.GetState() == deleting {
			r.State = releaseFailed
		}
		return nil
	}}
}

// LeaseReleased records lease name's resource released at; ReleaseFailed with
// no lease left returns to Deleting, from where it may be removed.
func LeaseReleased(name string, at time.Time) Step {
	return Step{"lease released", func(r *vmflowv1.InstanceRecord) error {
		if l, err := heldLease("", r, name); err == nil {
			l.ReleasedAt, l.LastReleaseError = ts(at), ""
		}
		readyToRemove(r)
		return nil
	}}
}

// readyToRemove returns a record in ReleaseFailed to Deleting, the only
// state Delete removes, once it holds no lease.
func readyToRemove(r *vmflowv1.InstanceRecord) {
	if r.GetState() == releaseFailed && !AnyLeaseHeld(r) {
		r.State = deleting
	}
}

// MayRemove returns nil when the record may be removed now, else ErrClaimHeld
// (invariant 1), ErrProcessMayLive (invariant 11) or ErrIllegalTransition.
func MayRemove(rec *vmflowv1.InstanceRecord) error {
	// Leases first, whatever the state: a held GPU is the reason an
	// operator most needs to read.
	if held := HeldLeases(rec); len(held) > 0 {
		return fmt.Errorf("%w: %s; release it first", ErrClaimHeld, DescribeLease(held[0]))
	}
	if err := MayQEMULive(rec, false, nil); err != nil {
		return fmt.Errorf("%w: %w; stop it and wait for its exit first", ErrProcessMayLive, err)
	}
	if s := rec.GetState(); s != deleting && s != releaseFailed {
		return fmt.Errorf("%w: %s -> deleted (only a record being deleted can be removed)", ErrIllegalTransition, StateName(s))
	}
	return nil
}
