package activities

import (
	"errors"
	"syscall"

	"go.temporal.io/sdk/temporal"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/spec"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/vgpu"
	"vmflow/hostagent/vgpu/claims"
	"vmflow/hostagent/vmm"
	"vmflow/workflows"
)

// classes is the one list of the host's sentinel errors and the error type
// (workflows' list) each becomes at the activity edge, in the order
// classify tries them: the first class with a sentinel the error wraps
// wins. Invalid input, a stranger's pid, an unreadable record or a host
// that cannot run the launch can never succeed, so they are non-retryable;
// everything else retries, typed so an operator can tell a busy instance
// from a GPU that will not let go.
var classes = []struct {
	typ          string
	nonRetryable bool
	errs         []error
}{
	// Before ErrInvalid, which its field errors also match: a launch
	// refused by the host's policy, not a bad request.
	// A full state file system refuses a spawn the same way: nothing was
	// created, and retrying would only wait for space someone else frees.
	{workflows.ErrTypeAdmissionRefused, true, []error{spec.ErrAdmissionRefused, store.ErrDiskFull}},
	{workflows.ErrTypeInvalidInput, true, []error{spec.ErrInvalid, store.ErrInvalidID, vmm.ErrInvalidSpec, store.ErrRecordTooLarge}},
	{workflows.ErrTypeConflict, true, []error{store.ErrConflict}},
	{workflows.ErrTypeInstanceDeleting, true, []error{store.ErrDeleting, supervise.ErrManualStop}},
	{workflows.ErrTypeManualStopMissing, true, []error{store.ErrManualStopMissing}},
	{workflows.ErrTypeIdentityMismatch, true, []error{proc.ErrIncompleteIdentity}},
	// A record that cannot be read stays unreadable until an operator
	// repairs it; retrying forever would only hide it.
	{workflows.ErrTypeRecordUnreadable, true, []error{store.ErrInvalidRecord}},
	{workflows.ErrTypeVGPUUnavailable, true, []error{errVGPUUnavailable}},
	{workflows.ErrTypeDeviceClaimedTwice, true, []error{vgpu.ErrClaimedByOther}},
	{workflows.ErrTypeAmbiguousQEMU, true, []error{supervise.ErrUnrecordedAmbiguous}},
	{workflows.ErrTypeBusy, false, []error{store.ErrBusy}},
	{workflows.ErrTypeStillAlive, false, []error{vmm.ErrStillAlive, supervise.ErrStillRunning, store.ErrProcessMayLive}},
	{workflows.ErrTypeVGPUUnavailable, true, []error{spec.ErrNoVGPUDriver}},
	{workflows.ErrTypeHostMisconfigured, true, []error{vmm.ErrKVMAccess, vmm.ErrMemlockLimit, vmm.ErrNoQEMUUID, supervise.ErrNoSpec, store.ErrUIDRangeTaken}},
	{workflows.ErrTypeNoQEMUUID, false, []error{store.ErrNoFreeUID}},
	{workflows.ErrTypeLaunchFailed, false, []error{vmm.ErrLaunchExited, vmm.ErrLaunchTimeout}},
	{workflows.ErrTypeClaimHeld, false, []error{store.ErrClaimHeld}},
	{workflows.ErrTypeNoCapacity, false, []error{vgpu.ErrNoCapacity}},
	{workflows.ErrTypeClaimDeviceMissing, false, []error{claims.ErrClaimDeviceMissing, claims.ErrClaimNotActive}},
}

// classify turns a host error into a Temporal application error of its
// class (classes; a retryable HostError for none). This is the only place
// where host errors meet Temporal.
func classify(err error) error {
	if err == nil {
		return nil
	}
	var appErr *temporal.ApplicationError
	if errors.As(err, &appErr) {
		return err
	}
	typ, nonRetryable := workflows.ErrTypeHost, false
find:
	for _, c := range classes {
		for _, sentinel := range c.errs {
			if errors.Is(err, sentinel) {
				typ, nonRetryable = c.typ, c.nonRetryable
				break find
			}
		}
	}
	// The message carries the whole chain's text once. No Cause: the SDK
	// would serialise every wrapped Go error as a failure of its own, and
	// the CLI and Web UI would print the same text four or five times.
	return temporal.NewApplicationErrorWithOptions(err.Error(), typ, temporal.ApplicationErrorOptions{NonRetryable: nonRetryable})
}

// errnoName is the errno of a failed release for the metric label, or
// "other".
func errnoName(err error) string {
	if errno, ok := vgpu.Errno(err); ok {
		if name := errnoNames[errno]; name != "" {
			return name
		}
		return "errno_" + errno.Error()
	}
	switch {
	case errors.Is(err, vgpu.ErrReleaseInProgress):
		return "in_progress"
	case errors.Is(err, claims.ErrVMAlive):
		return "vm_alive"
	case errors.Is(err, claims.ErrDeviceHeld):
		return "device_held"
	case errors.Is(err, vgpu.ErrClaimedByOther):
		return "claimed_twice"
	}
	return "other"
}

var errnoNames = map[syscall.Errno]string{
	syscall.EBUSY: "EBUSY", syscall.EIO: "EIO", syscall.EAGAIN: "EAGAIN", syscall.ENODEV: "ENODEV",
	syscall.EINVAL: "EINVAL", syscall.EPERM: "EPERM", syscall.EACCES: "EACCES", syscall.ENOENT: "ENOENT",
}

// retype gives a generic retryable host error a more specific type; typed
// errors (busy, invalid input) keep theirs.
func retype(err error, typ string) error {
	var appErr *temporal.ApplicationError
	if !errors.As(err, &appErr) || appErr.Type() != workflows.ErrTypeHost {
		return err
	}
	return temporal.NewApplicationErrorWithOptions(appErr.Message(), typ, temporal.ApplicationErrorOptions{
		NonRetryable: appErr.NonRetryable(),
	})
}
