package store

import (
	"strings"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The instance state machine, in one place (containerd's initState idea).
// The stop ladder's progress is the record's stop_step field, not a state:
// a VM being stopped is still Running until its thread group is gone.
//
//	(none) ──Create──► Creating ──► Running ⇄ Exited
//	Creating | Running | Exited ──► Deleting   (manual-stop marker first)
//	Deleting ⇄ ReleaseFailed
//	Deleting | ReleaseFailed ──Delete──► (record removed; only with no lease held)
//
// Creating is entered only by Create and the record leaves the machine only
// by Delete; neither is a transition Update can make. The named steps that
// move a record along it are in lifecycle.go.
var transitions = map[vmflowv1.InstanceState][]vmflowv1.InstanceState{
	creating: {running, deleting},
	running:  {exited, deleting},
	exited:   {running, deleting},
	deleting: {releaseFailed},
	// Back to Deleting to retry the release.
	releaseFailed: {deleting},
}

const (
	creating      = vmflowv1.InstanceState_INSTANCE_STATE_CREATING
	running       = vmflowv1.InstanceState_INSTANCE_STATE_RUNNING
	exited        = vmflowv1.InstanceState_INSTANCE_STATE_EXITED
	deleting      = vmflowv1.InstanceState_INSTANCE_STATE_DELETING
	releaseFailed = vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED
)

// CheckTransition returns nil if the state machine allows from -> to, else a
// *TransitionError (ErrIllegalTransition); staying put is refused here, and
// Update asks only on a change.
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

// IsDeleting reports whether a delete began for rec (Deleting or
// ReleaseFailed): nothing may launch, restart or claim for it any more.
func IsDeleting(rec *vmflowv1.InstanceRecord) bool {
	return isDeleting(rec.GetState())
}
