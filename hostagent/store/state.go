package store

import (
	"strings"

	"google.golang.org/protobuf/types/known/timestamppb"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The instance state machine, in one place (containerd's initState idea).
// The stop ladder's progress is the record's stop_step field, not a state:
// a VM being stopped is still Running until its thread group is gone.
//
//	(none) ──Create──► Creating ──► Running ⇄ Exited
//	Creating | Running | Exited ──► Deleting   (manual-stop marker first)
//	Deleting ⇄ ReleaseFailed
//	Deleting ──Delete──► (record removed; only without a vGPU claim)
//
// Creating is entered only by Create and the record leaves the machine only
// by Delete; neither is a transition Update can make.
var transitions = map[vmflowv1.InstanceState][]vmflowv1.InstanceState{
	creating: {running, deleting},
	running:  {exited, deleting},
	exited:   {running, deleting},
	deleting: {releaseFailed},
	// Back to Deleting to retry the release; only from Deleting may the
	// record be removed.
	releaseFailed: {deleting},
}

const (
	creating      = vmflowv1.InstanceState_INSTANCE_STATE_CREATING
	running       = vmflowv1.InstanceState_INSTANCE_STATE_RUNNING
	exited        = vmflowv1.InstanceState_INSTANCE_STATE_EXITED
	deleting      = vmflowv1.InstanceState_INSTANCE_STATE_DELETING
	releaseFailed = vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED
)

// CheckTransition returns nil if the state machine allows from -> to, and a
// *TransitionError (matching ErrIllegalTransition) otherwise. Staying in the
// same state is not a transition and is refused here; Update only consults
// the state machine when the state actually changes.
func CheckTransition(from, to vmflowv1.InstanceState) error {
	for _, allowed := range transitions[from] {
		if allowed == to {
			return nil
		}
	}
	return &TransitionError{From: from, To: to}
}

// StateName is the short, lower-case name of a state for messages and logs
// ("running", "release_failed"); unknown values print as their number.
func StateName(s vmflowv1.InstanceState) string {
	name, ok := vmflowv1.InstanceState_name[int32(s)]
	if !ok {
		return "state(" + s.String() + ")"
	}
	return strings.ToLower(strings.TrimPrefix(name, "INSTANCE_STATE_"))
}

// isDeleting reports whether a delete has begun for a record in state s.
func isDeleting(s vmflowv1.InstanceState) bool {
	return s == deleting || s == releaseFailed
}

// IsDeleting reports whether a delete has begun for rec (Deleting or
// ReleaseFailed): nothing may launch, restart or claim for it any more. The
// one definition every package asks, so the rule cannot drift.
func IsDeleting(rec *vmflowv1.InstanceRecord) bool {
	return isDeleting(rec.GetState())
}

// The delete's named moves. Each is applied to a record inside an Update
// (so the state machine and the marker rule still check it), and each is the
// only place its rule is written: callers never set Deleting or
// ReleaseFailed by hand.

// BeginDeleting moves rec to Deleting unless a delete already began. The
// manual-stop marker must already be on disk (Update refuses otherwise).
func BeginDeleting(rec *vmflowv1.InstanceRecord) {
	if !isDeleting(rec.GetState()) {
		rec.State = deleting
	}
}

// ReleaseFailed records a failed vGPU release on rec: the claim stays held
// (invariant 1) with its attempt counted and the error kept, a release in
// progress goes back to active, and a deleting record shows ReleaseFailed.
func ReleaseFailed(rec *vmflowv1.InstanceRecord, cause string) {
	if c := rec.GetGpuClaim(); c != nil {
		c.ReleaseAttempts++
		c.LastReleaseError = cause
		if c.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING {
			c.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		}
	}
	rec.LastError = "release vGPU: " + cause
	if rec.GetState() == deleting {
		rec.State = releaseFailed
	}
}

// Released records that rec's vGPU is confirmed released at ts: the claim
// is no longer held, and a record in ReleaseFailed returns to Deleting,
// from where it may be removed.
func Released(rec *vmflowv1.InstanceRecord, ts *timestamppb.Timestamp) {
	if c := rec.GetGpuClaim(); c != nil && c.GetReleasedAt() == nil {
		c.ReleasedAt = ts
		c.LastReleaseError = ""
	}
	ReadyToRemove(rec)
}

// ReadyToRemove returns a record in ReleaseFailed to Deleting, the only
// state Delete removes (a release that succeeded outside the claim layer,
// or a record whose claim was already released).
func ReadyToRemove(rec *vmflowv1.InstanceRecord) {
	if rec.GetState() == releaseFailed && !ClaimHeld(rec) {
		rec.State = deleting
	}
}
