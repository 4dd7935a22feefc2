package activities

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/supervise"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// Host errors that no retry can change are non-retryable with a type that
// says why (issue 15); before, these fell through to a retryable HostError
// that a delete retried forever out of sight.

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

// TestUnreadableRecordEveryActivity: every activity that reads the
// instance's record reports an unreadable one as a non-retryable
// RecordUnreadable (store.ErrInvalidRecord), whichever host package it
// went through; none turns it into a retryable HostError.
func TestUnreadableRecordEveryActivity(t *testing.T) {
	h := newHost(t)
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("vm1"), nil))
	p, err := h.st.Paths("vm1")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte("{"), 0o600))
	require.NoError(t, h.st.MarkManualStop(t.Context(), "vm1"), "the marker does not need the record")

	ref := &vmflowv1.InstanceRef{InstanceId: "vm1"}
	for _, c := range []struct {
		name string
		fn   any
		in   any
	}{
		{"CreateRecord", h.acts.CreateRecord, spawnReq("vm1")},
		{"ClaimVGPU", h.acts.ClaimVGPU, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: spawnReq("vm1").GetVgpuProfile()}},
		{"LaunchVM", h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}},
		{"BeginDelete", h.acts.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}},
		{"StopVM", h.acts.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1"}},
		{"WaitVMExit", h.acts.WaitVMExit, ref},
		{"ReleaseVGPU", h.acts.ReleaseVGPU, ref},
		{"TearDown", h.acts.TearDown, ref},
		{"DeleteRecord", h.acts.DeleteRecord, ref},
	} {
		err := h.run(t, c.fn, c.in, nil)
		if !assert.Error(t, err, c.name) {
			continue
		}
		ae := appError(t, err)
		assert.Equal(t, workflows.ErrTypeRecordUnreadable, ae.Type(), "%s: %v", c.name, err)
		assert.True(t, ae.NonRetryable(), c.name)
	}
}
