package supervise

import (
	"fmt"
	"time"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Policy is an instance's restart policy, from the record's restart_policy.
type Policy string

// The restart policies.
const (
	// PolicyNever (the default, also for an empty field) leaves an exited VM
	// Exited.
	PolicyNever Policy = admission.RestartNever
	// PolicyOnFailure restarts a VM that failed: exit code != 0, killed by a
	// signal, or an unknown status (the exit was seen through a pidfd after
	// an agent restart, so nobody knows how it ended). A clean exit 0 (the
	// guest powered off) is not a failure.
	PolicyOnFailure Policy = admission.RestartOnFailure
	// PolicyAlways restarts after any exit.
	PolicyAlways Policy = admission.RestartAlways
)

// Defaults for the restart backoff: 1 s doubling, capped at 5 min.
const (
	DefaultRestartBackoff    = time.Second
	DefaultRestartBackoffMax = 5 * time.Minute
)

// ParsePolicy reads a record's restart_policy; empty is PolicyNever.
func ParsePolicy(s string) (Policy, error) {
	switch Policy(s) {
	case "", PolicyNever:
		return PolicyNever, nil
	case PolicyOnFailure, PolicyAlways:
		return Policy(s), nil
	}
	return PolicyNever, errdefs.InvalidInput.Errorf("unknown restart policy %q (want never, on-failure or always)", s)
}

// Backoff is the delay before restart number restarts+1 of a streak: base
// doubled restarts times, capped at max.
func Backoff(restarts uint32, base, max time.Duration) time.Duration {
	if base <= 0 {
		base = DefaultRestartBackoff
	}
	if max <= 0 {
		max = DefaultRestartBackoffMax
	}
	d := base
	for i := uint32(0); i < restarts; i++ {
		if d >= max/2 {
			return max // doubling further would pass the cap (or overflow)
		}
		d *= 2
	}
	return min(d, max)
}

// Failed reports whether an exit code is a failure for PolicyOnFailure; -1 is
// the record's "killed by a signal" or "unknown".
func Failed(exitCode int32) bool { return exitCode != 0 }

// decision is what the restart policy says about an exited instance.
type decision struct {
	restart bool
	// delay is the backoff from the exit to the restart.
	delay  time.Duration
	reason string
}

// decide applies the restart policy to rec, whose VM is gone; pure, so an
// agent decides the same after a restart as before.
func decide(rec *vmflowv1.InstanceRecord, marked bool, base, max time.Duration) decision {
	switch {
	case marked:
		return decision{reason: "manual-stop marker present"}
	case store.IsDeleting(rec):
		return decision{reason: "instance is being deleted"}
	case rec.GetState() != vmflowv1.InstanceState_INSTANCE_STATE_EXITED:
		return decision{reason: "state is " + store.StateName(rec.GetState())}
	case rec.GetProcess() != nil:
		return decision{reason: "a process is recorded"}
	}
	p, err := ParsePolicy(rec.GetRestartPolicy())
	if err != nil {
		return decision{reason: err.Error()}
	}
	switch p {
	case PolicyNever:
		return decision{reason: "restart policy never"}
	case PolicyOnFailure:
		if !Failed(rec.GetLastExitCode()) {
			return decision{reason: "clean exit (code 0) under restart policy on-failure"}
		}
	}
	if m := rec.GetRestartMaxAttempts(); m > 0 && rec.GetRestartCount() >= m {
		return decision{reason: fmt.Sprintf("gave up after %d restarts (restart_max_attempts %d)", rec.GetRestartCount(), m)}
	}
	return decision{restart: true, delay: Backoff(rec.GetRestartCount(), base, max),
		reason: fmt.Sprintf("restart policy %s, restart %d", p, rec.GetRestartCount()+1)}
}
