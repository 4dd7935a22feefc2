package e2e

import (
	"encoding/json"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/lease"
	"vmflow/workflows"
)

// devices runs `vmflow-hostagent devices` against this env's host, as an
// operator would, and returns its output.
func (e *env) devices(args ...string) string {
	e.t.Helper()
	return e.hostagentCLI(append([]string{"devices", "--state-dir", e.stateDir, "--sysfs-root", e.sim.Root, "--gpu-passthrough", "all", "--vgpu-driver", "none"}, args...)...)
}

// hostagentCLI runs vmflow-hostagent with args and returns its output.
func (e *env) hostagentCLI(all ...string) string {
	e.t.Helper()
	out, err := exec.Command(e.agent.Bin, all...).CombinedOutput()
	if err != nil {
		e.t.Fatalf("vmflow-hostagent %v: %v\n%s", all, err, out)
	}
	return string(out)
}

func (e *env) deviceRows() map[string]lease.DeviceRow {
	e.t.Helper()
	var rows []lease.DeviceRow
	require.NoError(e.t, json.Unmarshal([]byte(e.devices("-o", "json")), &rows))
	m := map[string]lease.DeviceRow{}
	for _, r := range rows {
		m[r.ID] = r
	}
	return m
}

// TestWholeGPUHoles: the whole-GPU cases of issue 31 through the stack,
// on a host whose PCI GPUs are vgpusim.PCIGPUAt 0-3 (the fourth beside a
// NIC):
//   - a NIC whose driver has not loaded keeps its group from being offered
//     (devices says why) and is never bound (case 3);
//   - a GPU whose bind fails is quarantined and the spawn takes the next
//     (case 5);
//   - a spawn beside a delete whose unbind is blocked completes promptly
//     (case 1);
//   - a delete whose card was removed in a reboot finishes (case 2).
func TestWholeGPUHoles(t *testing.T) {
	timeTest(t)
	e := newEnv(t, envOptions{noStart: true, sim: func(o *vgpusim.Options) { o.PCIGPUs = 4 }})
	e.agent.Args = append(e.agent.Args, "--gpu-passthrough", "all", "--gpu-quarantine-after", "1")
	e.agent.Start(t)
	e.worker.Start(t)
	g0, g1, g3 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1), vgpusim.PCIGPUAt(3)
	driver := func(addr string) string {
		d, _ := e.sim.Server.PCIDriver(addr)
		return d
	}

	// Case 3.
	require.NoError(t, simtest.Write(e.sim.Path("bus", "pci", "drivers", "mlx5_core", "unbind"), g3.NIC))
	assert.Contains(t, e.devices(), "group "+g3.Group+" also holds "+g3.NIC+" (network controller)")
	three := e.noneSpawn("e2e-three-"+suffix(t), false)
	three.GpuPassthroughCount, three.GpuPassthroughModel = 3, g0.ID // H200s: 0, 2, and 3 beside the NIC
	err := e.startSpawn(three).Get(e.ctx(90*time.Second), nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), workflows.ErrTypeNoCapacity)
	assert.Equal(t, "", driver(g3.NIC), "the driverless NIC is never bound to vfio-pci")
	assert.Equal(t, "nvidia", driver(g0.GPU))

	// Case 5.
	e.sim.Set(t, vgpusim.At(vgpusim.CtlFailUnbind, g0.GPU), "EIO")
	a := e.noneSpawn("e2e-a-"+suffix(t), false)
	a.GpuPassthroughCount = 1
	res := e.spawn(a)
	assert.ElementsMatch(t, []string{g1.GPU, g1.Audio}, res.GetGpuDeviceIds(), "the next GPU")
	assert.Equal(t, "nvidia", driver(g0.GPU), "the bad GPU's bind undone")
	rows := e.deviceRows()
	assert.Equal(t, lease.DeviceQuarantined, rows[g0.GPU].State, "its failed bind quarantined it")
	assert.Equal(t, lease.DeviceClaimed, rows[g1.GPU].State)
	e.sim.Clear(t, vgpusim.At(vgpusim.CtlFailUnbind, g0.GPU))
	assert.Contains(t, e.hostagentCLI("devices", "clear", g0.GPU, "--state-dir", e.stateDir, "--reason", "e2e: unbind fixed"), "cleared")

	// Case 1.
	e.sim.Set(t, vgpusim.At(vgpusim.CtlBlockUnbind, g1.GPU), "")
	delA := e.startDelete(a.GetInstanceId(), 1)
	require.Eventually(t, func() bool { return e.sim.Server.Blocked() > 0 }, time.Minute, 50*time.Millisecond, "the delete's unbind blocks")
	b := e.noneSpawn("e2e-b-"+suffix(t), false)
	b.GpuPassthroughCount = 1
	start := time.Now()
	res = e.spawn(b)
	took := time.Since(start)
	assert.Equal(t, []string{g0.GPU}, res.GetGpuDeviceIds())
	assert.Less(t, took, 20*time.Second, "a spawn beside a blocked unbind")
	t.Logf("whole-GPU spawn beside a blocked unbind took %v", took)
	e.sim.Clear(t, vgpusim.At(vgpusim.CtlBlockUnbind, g1.GPU))
	require.NoError(t, delA.Get(e.ctx(2*time.Minute), nil))
	assert.Equal(t, "nvidia", driver(g1.GPU))

	// Case 2: B's card is taken out; a reboot renumbers the groups.
	require.NoError(t, e.sim.Server.Reboot(vgpusim.Reboot{Remove: []string{g0.GPU}, GroupOffset: -1}))
	require.NoError(t, e.startDelete(b.GetInstanceId(), 1).Get(e.ctx(2*time.Minute), nil), "the release finds the card gone")
	assert.Nil(t, e.record(b.GetInstanceId()))
	assert.Equal(t, "nvidia", driver(g1.GPU), "the card that has the old group number is untouched")
	e.assertNothingLeft()
}
