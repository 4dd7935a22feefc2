package cli_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestLsShowListEveryVGPU: an instance with two vGPUs shows both in ls
// (JSON and table) and show, and a device another instance's held claim
// also names is flagged on both, whichever of its vGPUs it is.
func TestLsShowListEveryVGPU(t *testing.T) {
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	ctx := context.Background()
	lease := func(u string) *vmflowv1.Lease {
		l := store.VGPULease(&vmflowv1.VgpuLease{Profile: "GRID A100-4C", Parent: "0000:3b:00.0", TypeId: "nvidia-471", Uuid: u, DeviceId: u})
		l.Phase, l.ClaimedAt = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, timestamppb.Now()
		return l
	}
	const u1, u2 = "6f9b6c1e-0000-4000-8000-0000000000a1", "6f9b6c1e-0000-4000-8000-0000000000a2"
	for id, ls := range map[string][]*vmflowv1.Lease{"vm-two": {lease(u1), lease(u2)}, "vm-other": {lease(u2)}} {
		_, err := st.Create(ctx, &vmflowv1.InstanceRecord{Id: id, Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 128, Machine: "none",
			VgpuProfile: "GRID A100-4C", VgpuCount: uint32(len(ls))}})
		require.NoError(t, err)
		_, err = st.Update(ctx, id, func(r *vmflowv1.InstanceRecord) error { r.Leases = ls; return nil })
		require.NoError(t, err)
	}

	code, out, stderr := runLs(t, "--state-dir", dir, "-o", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	var rows []struct {
		ID             string   `json:"id"`
		ClaimDevice    string   `json:"claim_device"`
		GPUDevices     []string `json:"gpu_devices"`
		NeedsAttention []string `json:"needs_attention"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rows))
	require.Len(t, rows, 2)
	for _, r := range rows {
		if r.ID == "vm-two" {
			assert.Equal(t, u1, r.ClaimDevice)
			assert.Equal(t, []string{u1, u2}, r.GPUDevices)
		}
		require.Len(t, r.NeedsAttention, 1, r.ID)
		assert.Contains(t, r.NeedsAttention[0], "vGPU "+u2+" is claimed by 2 instances")
	}

	code, out, stderr = runLs(t, "--state-dir", dir)
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, "active "+u1+","+u2)

	code, out, stderr = runShow(t, "--state-dir", dir, "vm-two")
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, "vGPU             active "+u1+":")
	assert.Contains(t, out, "vGPU             active "+u2+":")
}
