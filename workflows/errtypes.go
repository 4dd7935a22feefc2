package workflows

import "vmflow/internal/errdefs"

// errorTypes is the one table from host error class to the Type its
// errors carry out of an activity, one to one. Retryability is the class's:
// the retry policies' non-retryable lists come from here too.
var errorTypes = []struct {
	class *errdefs.Class
	typ   string
}{
	{errdefs.InvalidInput, ErrTypeInvalidInput},
	{errdefs.Refused, ErrTypeAdmissionRefused},
	{errdefs.Conflict, ErrTypeConflict},
	{errdefs.Deleting, ErrTypeInstanceDeleting},
	{errdefs.Exists, ErrTypeInstanceExists},
	{errdefs.ManualStopMissing, ErrTypeManualStopMissing},
	{errdefs.IdentityIncomplete, ErrTypeIdentityMismatch},
	{errdefs.Unreadable, ErrTypeRecordUnreadable},
	{errdefs.NoDriver, ErrTypeVGPUUnavailable},
	{errdefs.ClaimedTwice, ErrTypeDeviceClaimedTwice},
	{errdefs.Ambiguous, ErrTypeAmbiguousQEMU},
	{errdefs.Misconfigured, ErrTypeHostMisconfigured},
	{errdefs.Busy, ErrTypeBusy},
	{errdefs.StillAlive, ErrTypeStillAlive},
	{errdefs.LaunchFailed, ErrTypeLaunchFailed},
	{errdefs.ClaimHeld, ErrTypeClaimHeld},
	{errdefs.NoCapacity, ErrTypeNoCapacity},
	{errdefs.NoHostCapacity, ErrTypeNoHostCapacity},
	{errdefs.Draining, ErrTypeHostDraining},
	{errdefs.NoUID, ErrTypeNoQEMUUID},
	{errdefs.DeviceMissing, ErrTypeClaimDeviceMissing},
	{errdefs.NotFound, ErrTypeNotFound},
	{errdefs.Unavailable, ErrTypeUnavailable},
	{errdefs.Internal, ErrTypeInternal},
}

// ErrorType is the Type of an activity error of class c, and HostError for
// no class (an error from outside the host's code, retryable).
func ErrorType(c *errdefs.Class) string {
	for _, e := range errorTypes {
		if e.class == c {
			return e.typ
		}
	}
	return ErrTypeHost
}

// nonRetryableTypes lists the Type of every class no retry can change.
func nonRetryableTypes() []string {
	var out []string
	for _, e := range errorTypes {
		if !e.class.Retryable() {
			out = append(out, e.typ)
		}
	}
	return out
}
