package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// TestSeveralAndWholeGPUs: on one host (two vGPU-capable GPUs for mdev,
// two whole GPUs handed out with --gpu-passthrough all), a VM with two
// vGPUs and one with two whole GPUs, each given every device; a request
// for three whole GPUs refused with nothing bound; a delete whose unbind
// fails parks in release-failed with the record and its leases kept, and
// the operator's retry after the fault clears finishes it, every function
// back on the driver it had.
func TestSeveralAndWholeGPUs(t *testing.T) {
	timeTest(t)
	e := newEnv(t, envOptions{noStart: true})
	e.agent.Args = append(e.agent.Args, "--gpu-passthrough", "all")
	e.agent.Start(t)
	e.worker.Start(t)
	drivers := func() map[string]string {
		out := map[string]string{}
		for i := range 2 {
			g := vgpusim.PCIGPUAt(i)
			for _, a := range []string{g.GPU, g.Audio} {
				if a != "" {
					out[a], _ = e.sim.Server.PCIDriver(a)
				}
			}
		}
		return out
	}
	before := drivers()

	two := e.noneSpawn("e2e-vgpus-"+suffix(t), true)
	two.VgpuCount = 2
	res := e.spawn(two)
	require.Len(t, res.GetGpuDeviceIds(), 2, "both vGPUs in the result")
	assert.Len(t, e.simDevices(), 2)

	// Three whole GPUs of a host with two: the claim binds two, fails on
	// the third and undoes both; the spawn fails having bound nothing.
	three := e.noneSpawn("e2e-three-"+suffix(t), false)
	three.GpuPassthroughCount = 3
	err := e.startSpawn(three).Get(e.ctx(90*time.Second), nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), workflows.ErrTypeNoCapacity)
	assert.Equal(t, before, drivers(), "nothing bound")

	whole := e.noneSpawn("e2e-whole-"+suffix(t), false)
	whole.GpuPassthroughCount = 2
	wres := e.spawn(whole)
	g0, g1 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1)
	assert.ElementsMatch(t, []string{g0.GPU, g1.GPU, g1.Audio}, wres.GetGpuDeviceIds(), "every function of both groups")
	for a, d := range drivers() {
		assert.Equal(t, "vfio-pci", d, a)
	}
	rec := e.record(whole.GetInstanceId())
	require.Len(t, store.HeldPassthrough(rec), 2)
	assert.Len(t, store.HeldVGPUs(e.record(two.GetInstanceId())), 2)

	e.sim.Set(t, vgpusim.CtlFailUnbind, "EIO")
	delID := workflows.DeleteWorkflowID(whole.GetInstanceId())
	run := e.startDelete(whole.GetInstanceId(), 1)
	st := e.waitStage(delID, workflows.StageReleaseFailed, 60*time.Second, nil)
	assert.True(t, st.GetNeedsAttention())
	assert.True(t, st.GetMetadataRetained())
	assert.Contains(t, strings.ToLower(st.GetLastError()), "unbind failed")
	rec = e.record(whole.GetInstanceId())
	require.NotNil(t, rec, "record kept while the unbind fails")
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED, rec.GetState())
	assert.Len(t, store.HeldPassthrough(rec), 2, "both leases kept (each return fails at its unbind)")

	e.sim.Clear(t, vgpusim.CtlFailUnbind)
	e.cli("workflow", "update", "execute", "--workflow-id", delID, "--name", workflows.RetryUpdate, "--input", `{"reason":"e2e: unbind fixed"}`)
	require.NoError(t, run.Get(e.ctx(60*time.Second), nil))
	assert.Nil(t, e.record(whole.GetInstanceId()), "record removed once every group is back")
	assert.Equal(t, before, drivers(), "every function back on the driver it had")

	require.NoError(t, e.startDelete(two.GetInstanceId(), 1).Get(e.ctx(60*time.Second), nil))
	e.assertNothingLeft()
}
