package activities

import (
	"errors"
	"syscall"

	"go.temporal.io/sdk/temporal"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/lease"
	"vmflow/internal/errdefs"
	"vmflow/workflows"
)

// classify turns a host error into a Temporal application error of its class's
// type and retryability (a retryable HostError for no class); the only place
// host errors meet Temporal.
func classify(err error) error {
	if err == nil {
		return nil
	}
	var appErr *temporal.ApplicationError
	if errors.As(err, &appErr) {
		return err
	}
	c := errdefs.ClassOf(err)
	// The message carries the whole chain's text once. No Cause: the SDK
	// would serialise every wrapped Go error as a failure of its own, and
	// the CLI and Web UI would print the same text four or five times.
	return temporal.NewApplicationErrorWithOptions(err.Error(), workflows.ErrorType(c),
		temporal.ApplicationErrorOptions{NonRetryable: c != nil && !c.Retryable()})
}

// errnoName is the errno of a failed release for the metric label, or
// "other".
func errnoName(err error) string {
	if errno, ok := gpu.Errno(err); ok {
		if name := errnoNames[errno]; name != "" {
			return name
		}
		return "errno_" + errno.Error()
	}
	switch {
	case errors.Is(err, gpu.ErrReleaseInProgress):
		return "in_progress"
	case errors.Is(err, lease.ErrVMAlive):
		return "vm_alive"
	case errors.Is(err, lease.ErrDeviceHeld):
		return "device_held"
	case errors.Is(err, gpu.ErrClaimedByOther):
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
