package activities

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/supervise"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// Host errors that no retry can change are non-retryable with a type that
// says why, not a retryable HostError that a delete would retry forever out
// of sight.

// TestStopWithoutMarkerIsNotRetried: a StopVM for an instance whose delete
// never wrote the manual-stop marker (a caller that skipped BeginDelete) is
// refused with a non-retryable ManualStopMissing: the marker will not
// appear by retrying, and stopping without it would let the restart policy
// bring the VM back (invariant 6).
func TestStopWithoutMarkerIsNotRetried(t *testing.T) {
	h := newHost(t)
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("vm1"), nil))
	err := h.run(t, h.acts.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1"}, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeManualStopMissing, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, err.Error(), "manual-stop marker not written")
}

// TestLaunchWithoutSpecIsNotRetried: an agent whose supervisor has no
// PrepareLaunch for a record with a vGPU (supervise.ErrNoSpec) is
// misconfigured: a non-retryable HostMisconfigured, so the spawn fails at
// once saying why instead of retrying a launch that cannot start.
func TestLaunchWithoutSpecIsNotRetried(t *testing.T) {
	h := newHost(t)
	sup, err := supervise.New(supervise.Config{Store: h.st})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sup.Close() })
	h.acts.Supervisor = sup
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("vm1"), nil)) // asks for a vGPU
	err = h.run(t, h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeHostMisconfigured, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.ErrorContains(t, err, "no launch spec")
}
