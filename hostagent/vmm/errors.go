package vmm

import (
	"errors"
	"fmt"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/internal/errdefs"
)

var (
	// ErrLaunchExited: QEMU exited before QMP reported it running. The error
	// carries QEMU's exit and the tail of its log, which holds QEMU's own
	// message ("-bogus: invalid option").
	ErrLaunchExited = errdefs.LaunchFailed.New("qemu exited during launch")
	// ErrLaunchTimeout: QEMU neither answered QMP nor exited in time.
	ErrLaunchTimeout = errdefs.LaunchFailed.New("qemu did not become ready in time")
	// ErrNotRunning: QMP answered but query-status is not "running".
	ErrNotRunning = errdefs.LaunchFailed.New("qemu is not running")
	// ErrSocketInUse: something already listens on the QMP socket path, so a
	// launch would take it from a QEMU that may still be alive.
	ErrSocketInUse = errdefs.StillAlive.New("qmp socket in use")
	// ErrStillAlive: the thread group was still there when the wait ended.
	// Callers must treat the VM as alive (never release its devices) and may
	// retry. Returned as a *StillAliveError.
	ErrStillAlive = errdefs.StillAlive.New("vm process still alive")
	// ErrInvalidIdentity: the identity to act on is incomplete.
	ErrInvalidIdentity = errdefs.IdentityIncomplete.New("incomplete process identity")
	// ErrHook: a caller hook (OnStarted, OnStep) failed. A Context: the
	// hook's own error, wrapped beside it, gives the class.
	ErrHook = errdefs.Context("hook failed")
	// ErrNoLaunchIdentity: FindUnrecorded was asked about a record with
	// neither a QEMU uid nor a launch nonce of its own (written by an agent
	// older than both). All such a record offers is a command line, and
	// anyone can start the QEMU binary as a session leader with the
	// instance's -qmp argument: nothing is looked for, nothing adopted.
	ErrNoLaunchIdentity = errdefs.Ambiguous.New("record has neither a qemu uid nor a launch nonce of its own: a command line is no identity")
)

// StillAliveError says which process outlived the wait, after which step,
// and what /proc showed at the end. It matches ErrStillAlive with errors.Is.
type StillAliveError struct {
	Identity proc.Identity
	Step     StopStep
	Waited   time.Duration
	Status   proc.Status
}

func (e *StillAliveError) Error() string {
	return fmt.Sprintf("%v still alive %s after %s (state %s, %d tasks%s): %v",
		e.Identity, e.Waited.Round(time.Millisecond), e.Step, e.Status.State, e.Status.Tasks,
		errSuffix(e.Status.Err), ErrStillAlive)
}

// Is makes errors.Is(err, ErrStillAlive), and so its class, true.
func (e *StillAliveError) Is(target error) bool { return errors.Is(ErrStillAlive, target) }

func errSuffix(s string) string {
	if s == "" {
		return ""
	}
	return ", " + s
}
