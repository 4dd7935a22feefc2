package activities

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// TestLaunchRecreatesVGPULostInReboot: mdev devices do not survive
// a host reboot. A VM whose active claim's device is gone gets it back
// under the same UUID before QEMU starts; if it cannot be re-created, the
// launch fails with ClaimDeviceMissing naming the claim and starts no QEMU,
// rather than going ahead without the device.
func TestLaunchRecreatesVGPULostInReboot(t *testing.T) {
	h := newHost(t)
	req := spawnReq("vm1")
	require.NoError(t, h.run(t, h.acts.CreateRecord, req, nil))
	var claim vmflowv1.ClaimVGPUResult
	require.NoError(t, h.run(t, h.acts.ClaimVGPU, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: req.GetVgpuProfile()}, &claim))
	var launched vmflowv1.LaunchVMResult
	require.NoError(t, h.run(t, h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, &launched))

	// "Reboot": the VM dies and the device vanishes behind the agent's back.
	dev := filepath.Join(h.sim.Root, "bus/mdev/devices", claim.GetVgpuUuid())
	require.NoError(t, syscall.Kill(int(launched.GetPid()), syscall.SIGKILL))
	require.Eventually(t, func() bool {
		rec, err := h.st.Get("vm1")
		return err == nil && rec.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_EXITED
	}, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, os.WriteFile(filepath.Join(dev, "remove"), []byte("1"), 0o200))
	require.NoDirExists(t, dev)

	// It cannot be re-created: the launch fails naming the claim, no QEMU.
	h.sim.Set(t, vgpusim.CtlFailCreate, "EIO")
	err := h.run(t, h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeClaimDeviceMissing, ae.Type())
	assert.Contains(t, ae.Error(), claim.GetVgpuUuid())
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.Nil(t, rec.GetProcess(), "no QEMU started without its vGPU")

	// Once it can, the launch re-creates it under the same UUID first.
	h.sim.Clear(t, vgpusim.CtlFailCreate)
	var again vmflowv1.LaunchVMResult
	require.NoError(t, h.run(t, h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, &again))
	t.Cleanup(func() { _ = syscall.Kill(int(again.GetPid()), syscall.SIGKILL) })
	assert.DirExists(t, dev, "the same mdev UUID again")
	assert.Equal(t, claim.GetVgpuUuid(), again.GetVgpuUuid())
	assert.NotEqual(t, launched.GetPid(), again.GetPid())
}
