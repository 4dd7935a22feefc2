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

// Retryable error types (the workflows and the Web UI see these names).
const (
	ErrTypeStillAlive    = "VMStillAlive"
	ErrTypeLaunchFailed  = "LaunchFailed"
	ErrTypeReleaseFailed = "ReleaseFailed"
	ErrTypeClaimHeld     = "ClaimHeld"
	ErrTypeNoCapacity    = "NoVGPUCapacity"
	// Every uid of the agent's --qemu-uid-range is taken (by records or
	// live processes): a launch waits for one to be freed.
	ErrTypeNoQEMUUID = "NoQEMUUID"
	// The instance's claimed vGPU is missing (after a reboot) and could not
	// be re-created where the claim says: the launch waits for it.
	ErrTypeClaimDeviceMissing = "ClaimDeviceMissing"
	ErrTypeHost               = "HostError"
)

// ErrTypeDeviceClaimedTwice: two held claims name one vGPU device
// (invariant 10 broken by a record from before the ledger, or by hand).
// Non-retryable: acting on the device could destroy the other instance's
// vGPU, so an operator decides.
const ErrTypeDeviceClaimedTwice = "DeviceClaimedTwice"

// ErrTypeAmbiguousQEMU: more than one process looks like the instance's
// unrecorded QEMU (a record from an agent before launch markers, and a copy
// someone started by hand). Nothing is signalled; an operator decides.
const ErrTypeAmbiguousQEMU = "AmbiguousQEMU"

// ErrTypeHostMisconfigured: the host cannot run this launch as configured
// (/dev/kvm's group cannot open it, so a confined QEMU could not either).
// Non-retryable: no retry changes a device node's mode; the spawn fails at
// once naming the mode, and an operator fixes the host.
const ErrTypeHostMisconfigured = "HostMisconfigured"

// classify turns a host error into a Temporal application error. This is
// the only place where host errors meet Temporal: invalid input and a
// stranger's pid can never succeed, so they are non-retryable with a type;
// everything else retries, typed so an operator can tell a busy instance
// from a GPU that will not let go.
func classify(err error) error {
	if err == nil {
		return nil
	}
	var appErr *temporal.ApplicationError
	if errors.As(err, &appErr) {
		return err
	}
	// The message carries the whole chain's text once. No Cause: the SDK
	// would serialise every wrapped Go error as a failure of its own, and
	// the CLI and Web UI would print the same text four or five times.
	nonRetryable := func(typ string) error {
		return temporal.NewApplicationErrorWithOptions(err.Error(), typ, temporal.ApplicationErrorOptions{NonRetryable: true})
	}
	retryable := func(typ string) error {
		return temporal.NewApplicationErrorWithOptions(err.Error(), typ, temporal.ApplicationErrorOptions{})
	}
	switch {
	case errors.Is(err, spec.ErrAdmissionRefused):
		// Before ErrInvalid, which its field errors also match: a launch
		// refused by the host's policy, not a bad request.
		return nonRetryable(workflows.ErrTypeAdmissionRefused)
	case errors.Is(err, spec.ErrInvalid), errors.Is(err, store.ErrInvalidID), errors.Is(err, vmm.ErrInvalidSpec),
		errors.Is(err, store.ErrRecordTooLarge):
		return nonRetryable(workflows.ErrTypeInvalidInput)
	case errors.Is(err, store.ErrConflict):
		return nonRetryable(workflows.ErrTypeConflict)
	case errors.Is(err, store.ErrDeleting), errors.Is(err, supervise.ErrDeleting), errors.Is(err, supervise.ErrManualStop):
		return nonRetryable(workflows.ErrTypeInstanceDeleting)
	case errors.Is(err, proc.ErrIncompleteIdentity):
		return nonRetryable(workflows.ErrTypeIdentityMismatch)
	case errors.Is(err, store.ErrInvalidRecord):
		// A record that cannot be read stays unreadable until an operator
		// repairs it; retrying forever would only hide it.
		return nonRetryable(workflows.ErrTypeRecordUnreadable)
	case errors.Is(err, errVGPUUnavailable):
		return nonRetryable(workflows.ErrTypeVGPUUnavailable)
	case errors.Is(err, vgpu.ErrClaimedByOther):
		return nonRetryable(ErrTypeDeviceClaimedTwice)
	case errors.Is(err, supervise.ErrUnrecordedAmbiguous):
		return nonRetryable(ErrTypeAmbiguousQEMU)
	case errors.Is(err, store.ErrBusy), errors.Is(err, supervise.ErrBusy), errors.Is(err, errBusy):
		return retryable(workflows.ErrTypeBusy)
	case errors.Is(err, vmm.ErrStillAlive), errors.Is(err, supervise.ErrStillRunning):
		return retryable(ErrTypeStillAlive)
	case errors.Is(err, spec.ErrNoVGPUDriver):
		return nonRetryable(workflows.ErrTypeVGPUUnavailable)
	case errors.Is(err, vmm.ErrKVMAccess), errors.Is(err, vmm.ErrNoQEMUUID):
		return nonRetryable(ErrTypeHostMisconfigured)
	case errors.Is(err, store.ErrNoFreeUID):
		return retryable(ErrTypeNoQEMUUID)
	case errors.Is(err, vmm.ErrLaunchExited), errors.Is(err, vmm.ErrLaunchTimeout):
		return retryable(ErrTypeLaunchFailed)
	case errors.Is(err, store.ErrClaimHeld):
		return retryable(ErrTypeClaimHeld)
	case errors.Is(err, vgpu.ErrNoCapacity):
		return retryable(ErrTypeNoCapacity)
	case errors.Is(err, claims.ErrClaimDeviceMissing), errors.Is(err, claims.ErrClaimNotActive):
		return retryable(ErrTypeClaimDeviceMissing)
	}
	return retryable(ErrTypeHost)
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
	if !errors.As(err, &appErr) || appErr.Type() != ErrTypeHost {
		return err
	}
	return temporal.NewApplicationErrorWithOptions(appErr.Message(), typ, temporal.ApplicationErrorOptions{
		NonRetryable: appErr.NonRetryable(),
	})
}
