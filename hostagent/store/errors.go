package store

import (
	"fmt"

	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Sentinel errors callers branch on with errors.Is. Every error the store
// returns wraps one of these (or an os/syscall error) with context.
var (
	// ErrInvalidID: the instance id does not match contract.IDPattern.
	ErrInvalidID = errdefs.InvalidInput.New("invalid instance id")
	// ErrNotFound: no record exists for the instance.
	ErrNotFound = errdefs.NotFound.New("instance record not found")
	// ErrConflict: a record exists for the id with a different spec.
	ErrConflict = errdefs.Conflict.New("instance exists with a different spec")
	// ErrDeleting: the instance is being deleted (Deleting or ReleaseFailed);
	// it cannot be created again until the delete finishes.
	ErrDeleting = errdefs.Deleting.New("instance is being deleted")
	// ErrClaimHeld: the record still holds a vGPU claim, so it must not be
	// deleted (ARCHITECTURE invariant 1).
	ErrClaimHeld = errdefs.ClaimHeld.New("instance still holds a vGPU claim")
	// ErrProcessMayLive: the record names a QEMU not confirmed gone (alive,
	// or its liveness cannot be read), or a launch marker with no process
	// yet, so it must not be deleted: the QEMU would be left without an
	// owner and its uid free (ARCHITECTURE invariant 11).
	ErrProcessMayLive = errdefs.StillAlive.New("instance's QEMU may still run")
	// ErrIllegalTransition: the state change is not in the state machine.
	ErrIllegalTransition = errdefs.Internal.New("illegal state transition")
	// ErrManualStopMissing: a delete may only begin after the manual-stop
	// marker is written (ARCHITECTURE invariant 6).
	ErrManualStopMissing = errdefs.ManualStopMissing.New("manual-stop marker not written")
	// ErrInvalidRecord: a record failed to decode or breaks a rule of the
	// store (wrong id, unknown enum value, missing spec, ...).
	ErrInvalidRecord = errdefs.Unreadable.New("invalid instance record")
	// ErrRecordTooLarge: a write was refused, with nothing written, because
	// the encoded record would be larger than the store reads back: a
	// record written anyway could never be read again, and its instance
	// never deleted.
	ErrRecordTooLarge = errdefs.InvalidInput.New("instance record too large")
	// ErrBusy: the instance's lock could not be taken before the context
	// ended; another goroutine or agent is working on it. The error also
	// wraps the context's error.
	ErrBusy = errdefs.Busy.New("instance is locked by another operation")
	// ErrUnlocked: a Locked handle was used after Unlock.
	ErrUnlocked = errdefs.Internal.New("instance lock already released")
)

// TransitionError is the error for a state change the state machine does not
// allow. It matches ErrIllegalTransition with errors.Is.
type TransitionError struct {
	From, To vmflowv1.InstanceState
}

func (e *TransitionError) Error() string {
	return fmt.Sprintf("%s: %s -> %s", ErrIllegalTransition, StateName(e.From), StateName(e.To))
}

// Unwrap makes errors.Is(err, ErrIllegalTransition) true.
func (e *TransitionError) Unwrap() error { return ErrIllegalTransition }
