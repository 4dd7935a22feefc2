package activities

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestNetworkReleasedAfterVGPU: the launch reports the leased address and
// MAC; the release stage gives the address back only after the vGPU: while
// the vGPU's release fails, the network lease and its TAP are kept, and
// once it passes both are released and the record may go.
func TestNetworkReleasedAfterVGPU(t *testing.T) {
	proctest.RequiresRoot(t, "QEMU is exec'd as a uid of its own")
	h := newHost(t)
	ns := nettest.Namespace(t)
	nh := nettest.Handle(t, ns)
	nw, err := network.New(network.Config{Subnet: netip.MustParsePrefix("10.90.0.0/24"), NetNS: ns, Store: h.st})
	require.NoError(t, err)
	t.Cleanup(nw.Close)
	a := h.acts
	a.Network, a.Host.Network = nw, true
	log := zaptest.NewLogger(t)
	sup, err := supervise.New(supervise.Config{Store: h.st, Logger: log, GracefulTimeout: time.Second, Network: nw,
		PrepareLaunch: admission.PrepareLaunch(a.Host, a.GPUs.(admission.Devices), false), ReadyTimeout: vmmtest.QEMUDeadline(vmm.DefaultReadyTimeout)})
	require.NoError(t, err)
	t.Cleanup(func() { sup.Close() })
	a.Supervisor = sup

	req := spawnReq("vm1")
	req.Machine, req.Network = "q35", admission.NetworkDefault
	ref := &vmflowv1.InstanceRef{InstanceId: "vm1"}
	require.NoError(t, h.run(t, a.CreateRecord, req, nil))
	require.NoError(t, h.run(t, a.ClaimDevices, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: req.GetVgpuProfile()}, nil))
	var launched vmflowv1.LaunchVMResult
	require.NoError(t, h.run(t, a.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, &launched))
	assert.Equal(t, "10.90.0.2/24", launched.GetIp())
	key, err := nw.MACKey(context.Background())
	require.NoError(t, err)
	assert.Equal(t, network.MAC(key, "vm1", 0), launched.GetMac())
	tap := network.TAPName(netip.MustParseAddr("10.90.0.2"))
	require.NotNil(t, nettest.Link(t, nh, tap))

	require.NoError(t, h.run(t, a.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, nil))
	require.NoError(t, h.run(t, a.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1", GracefulTimeoutSeconds: 1}, nil))
	require.NoError(t, h.run(t, a.WaitVMExit, ref, nil))

	h.sim.Set(t, vgpusim.CtlFailRelease, "EBUSY")
	require.Error(t, h.run(t, a.ReleaseLeases, ref, nil))
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.True(t, store.ClaimHeld(rec))
	assert.True(t, store.LeaseHeld(store.Network(rec)), "the address is not given back before the vGPU")
	assert.NotNil(t, nettest.Link(t, nh, tap))

	h.sim.Clear(t, vgpusim.CtlFailRelease)
	require.NoError(t, h.run(t, a.ReleaseLeases, ref, nil))
	rec, err = h.st.Get("vm1")
	require.NoError(t, err)
	assert.False(t, store.AnyLeaseHeld(rec))
	assert.Nil(t, nettest.Link(t, nh, tap), "the TAP is removed")
	require.NoError(t, h.run(t, a.TearDown, ref, nil))
	require.NoError(t, h.run(t, a.DeleteRecord, ref, nil))
}
