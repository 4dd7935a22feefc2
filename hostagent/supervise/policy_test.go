package supervise

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"vmflow/hostagent/vmm"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

func TestBackoff(t *testing.T) {
	for _, tc := range []struct {
		n    uint32
		want time.Duration
	}{
		{0, time.Second}, {1, 2 * time.Second}, {2, 4 * time.Second}, {8, 256 * time.Second},
		{9, 5 * time.Minute}, {40, 5 * time.Minute}, {^uint32(0), 5 * time.Minute},
	} {
		assert.Equal(t, tc.want, Backoff(tc.n, 0, 0), "restarts %d", tc.n)
	}
	assert.Equal(t, 30*time.Millisecond, Backoff(3, 10*time.Millisecond, 30*time.Millisecond))
}

func TestParsePolicy(t *testing.T) {
	for in, want := range map[string]Policy{"": PolicyNever, "never": PolicyNever, "on-failure": PolicyOnFailure, "always": PolicyAlways} {
		p, err := ParsePolicy(in)
		assert.NoError(t, err)
		assert.Equal(t, want, p)
	}
	p, err := ParsePolicy("sometimes")
	assert.ErrorIs(t, err, errdefs.InvalidInput, "classified where it arises: not a retryable host error")
	assert.Equal(t, PolicyNever, p, "unknown is never: don't guess a restart")
}

func TestDecide(t *testing.T) {
	exited := func(policy string, code int32, count, max uint32) *vmflowv1.InstanceRecord {
		return &vmflowv1.InstanceRecord{Id: "vm1", State: vmflowv1.InstanceState_INSTANCE_STATE_EXITED,
			RestartPolicy: policy, LastExitCode: code, RestartCount: count, RestartMaxAttempts: max}
	}
	withState := func(r *vmflowv1.InstanceRecord, s vmflowv1.InstanceState) *vmflowv1.InstanceRecord {
		r.State = s
		return r
	}
	for _, tc := range []struct {
		name    string
		rec     *vmflowv1.InstanceRecord
		marked  bool
		restart bool
		delay   time.Duration
		reason  string
	}{
		{"never", exited("never", 1, 0, 0), false, false, 0, "restart policy never"},
		{"default is never", exited("", -1, 0, 0), false, false, 0, "restart policy never"},
		{"on-failure, killed", exited("on-failure", -1, 0, 0), false, true, time.Second, "restart 1"},
		{"on-failure, exit 1, third", exited("on-failure", 1, 2, 0), false, true, 4 * time.Second, "restart 3"},
		{"on-failure, clean exit", exited("on-failure", 0, 0, 0), false, false, 0, "clean exit"},
		{"always, clean exit", exited("always", 0, 0, 0), false, true, time.Second, "restart 1"},
		{"marker wins", exited("always", -1, 0, 0), true, false, 0, "manual-stop marker"},
		{"max attempts", exited("always", -1, 3, 3), false, false, 0, "gave up after 3"},
		{"below max", exited("always", -1, 2, 3), false, true, 4 * time.Second, "restart 3"},
		{"deleting", withState(exited("always", -1, 0, 0), vmflowv1.InstanceState_INSTANCE_STATE_DELETING), false, false, 0, "being deleted"},
		{"release failed", withState(exited("always", -1, 0, 0), vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED), false, false, 0, "being deleted"},
		{"creating", withState(exited("always", -1, 0, 0), vmflowv1.InstanceState_INSTANCE_STATE_CREATING), false, false, 0, "state is creating"},
		{"unknown policy", exited("sometimes", -1, 0, 0), false, false, 0, "unknown restart policy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := decide(tc.rec, tc.marked, time.Second, 5*time.Minute)
			assert.Equal(t, tc.restart, d.restart)
			assert.Equal(t, tc.delay, d.delay)
			assert.Contains(t, d.reason, tc.reason)
		})
	}
}

func TestStepMapping(t *testing.T) {
	for _, s := range []vmm.StopStep{vmm.StepNone, vmm.StepPowerdownSent, vmm.StepQuitSent, vmm.StepKillSent, vmm.StepGone} {
		assert.Equal(t, s, stepFromProto(stepToProto(s)))
	}
	assert.Equal(t, vmflowv1.StopStep_STOP_STEP_KILLED, stepToProto(vmm.StepKillSent))
}

// TestStepTableCoversProto: every value of the record's enum is in the
// table and maps to a vmm step and back to itself, so an enum value added
// without a row fails here instead of reading as StepNone.
func TestStepTableCoversProto(t *testing.T) {
	seen := map[vmm.StopStep]bool{}
	for n := range vmflowv1.StopStep_name {
		p := vmflowv1.StopStep(n)
		s := stepFromProto(p)
		assert.Equal(t, p, stepToProto(s), "%s", p)
		assert.False(t, seen[s], "%s shares vmm step %q with another value", p, s)
		seen[s] = true
	}
	assert.Len(t, stopSteps, len(vmflowv1.StopStep_name), "one row per enum value")
	for _, s := range []vmm.StopStep{vmm.StepPowerdownSent, vmm.StepQuitSent, vmm.StepKillSent} {
		n, ok := StepReached(s)
		assert.True(t, ok && n != "", "%q has a reported name", s)
	}
	for _, s := range []vmm.StopStep{vmm.StepNone, vmm.StepGone} {
		_, ok := StepReached(s)
		assert.False(t, ok, "%q is an end of the ladder, not a step taken", s)
	}
}
