package activities

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestTwoVGPUsThroughActivities: a spawn asking for two vGPUs gets both
// from ClaimVGPU and LaunchVM, and the one release stage releases both,
// each once however many leases of its kind the record holds.
func TestTwoVGPUsThroughActivities(t *testing.T) {
	h := newHost(t)
	a := h.acts
	req := spawnReq("vm2")
	req.VgpuCount = 2
	ref := &vmflowv1.InstanceRef{InstanceId: "vm2"}
	require.NoError(t, h.run(t, a.ValidateSpawn, req, nil))
	require.NoError(t, h.run(t, a.CreateRecord, req, nil))
	var claim vmflowv1.ClaimVGPUResult
	require.NoError(t, h.run(t, a.ClaimDevices, &vmflowv1.ClaimVGPURequest{InstanceId: "vm2", VgpuProfile: req.GetVgpuProfile(), VgpuCount: 2}, &claim))
	require.Len(t, claim.GetDeviceIds(), 2)
	assert.Equal(t, claim.GetDeviceIds()[0], claim.GetDeviceId())
	var launched vmflowv1.LaunchVMResult
	require.NoError(t, h.run(t, a.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm2"}, &launched))
	assert.Equal(t, claim.GetDeviceIds(), launched.GetGpuDeviceIds())

	require.NoError(t, h.run(t, a.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm2"}, nil))
	require.NoError(t, h.run(t, a.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm2", GracefulTimeoutSeconds: 1}, nil))
	require.NoError(t, h.run(t, a.WaitVMExit, ref, nil))
	var rel vmflowv1.ReleaseVGPUResult
	require.NoError(t, h.run(t, a.ReleaseLeases, ref, &rel))
	assert.True(t, rel.GetReleased())
	assert.ElementsMatch(t, claim.GetDeviceIds(), rel.GetDeviceIds())
	rec, err := h.st.Get("vm2")
	require.NoError(t, err)
	assert.False(t, store.AnyLeaseHeld(rec))
	require.NoError(t, h.run(t, a.TearDown, ref, nil))
	require.NoError(t, h.run(t, a.DeleteRecord, ref, nil))
}
