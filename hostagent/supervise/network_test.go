package supervise

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// netEnv is an env whose supervisor puts VMs on a bridge in a namespace of
// the test's own.
type netEnv struct {
	*env
	ns  string
	h   *netlink.Handle
	net *network.Net
}

func newNetEnv(t *testing.T, prepare func(context.Context, *store.Locked, *vmflowv1.InstanceRecord) (vmm.VMSpec, error)) *netEnv {
	t.Helper()
	requiresRoot(t)
	e := &netEnv{env: newEnv(t), ns: nettest.Namespace(t)}
	e.h = nettest.Handle(t, e.ns)
	var err error
	e.net, err = network.New(network.Config{Subnet: netip.MustParsePrefix("10.89.0.0/24"), NetNS: e.ns, Store: e.st})
	require.NoError(t, err)
	t.Cleanup(e.net.Close)
	e.newSupervisor(func(c *Config) {
		c.Network = e.net
		if prepare != nil {
			c.PrepareLaunch = prepare
		}
	})
	return e
}

// createNet records id as a q35 VM with a network: QEMU runs its firmware,
// which is enough to hold the TAP and answer QMP.
func (e *netEnv) createNet(id string) {
	e.t.Helper()
	_, err := e.st.Create(ctxT(e.t, 10*time.Second), &vmflowv1.InstanceRecord{
		Id:   id,
		Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "q35", Accel: testAccel(), Network: "default"},
	})
	require.NoError(e.t, err)
}

// holdsTAP reports whether process pid has /dev/net/tun open.
func holdsTAP(t *testing.T, pid int) bool {
	t.Helper()
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	require.NoError(t, err)
	for _, fd := range fds {
		if target, err := os.Readlink(filepath.Join(fmt.Sprintf("/proc/%d/fd", pid), fd.Name())); err == nil && target == "/dev/net/tun" {
			return true
		}
	}
	return false
}

// TestLaunchWithNetworkGivesQEMUTheTAP: the lease is in the record, the TAP
// (owned by the VM's uid, a port of the bridge) exists, QEMU holds the
// TAP's descriptor; the TAP outlives the VM, and the next launch gets the
// same TAP, MAC and address.
func TestLaunchWithNetworkGivesQEMUTheTAP(t *testing.T) {
	e := newNetEnv(t, nil)
	e.createNet("vm1")
	res, err := e.sup.Launch(ctxT(t, 60*time.Second), "vm1")
	require.NoError(t, err)
	rec := e.get("vm1")
	lease := store.Network(rec)
	require.NotNil(t, lease)
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, lease.GetPhase())
	nl := lease.GetNetwork()
	assert.Equal(t, "10.89.0.2/24", nl.GetAddress())
	tap := nettest.Link(t, e.h, nl.GetTap())
	require.NotNil(t, tap)
	assert.Equal(t, rec.GetQemuUid(), tap.(*netlink.Tuntap).Owner)
	assert.True(t, holdsTAP(t, res.Identity.PID), "QEMU has the TAP's descriptor")

	// The VM ends from outside (a crash): its TAP stays.
	killAndReap(t, res.Identity)
	require.NotNil(t, nettest.Link(t, e.h, nl.GetTap()), "the TAP outlives its VM")
	assert.True(t, store.LeaseHeld(store.Network(e.get("vm1"))))

	res, err = e.sup.Launch(ctxT(t, 60*time.Second), "vm1")
	require.NoError(t, err)
	again := store.Network(e.get("vm1")).GetNetwork()
	assert.Equal(t, nl.GetAddress(), again.GetAddress())
	assert.Equal(t, nl.GetMac(), again.GetMac())
	assert.Equal(t, nl.GetTap(), again.GetTap())
	assert.True(t, holdsTAP(t, res.Identity.PID))
}

// TestFailedLaunchLeavesNoTAP: a QEMU that dies at launch (a vfio device
// that cannot open) after the TAP was made leaves no TAP; the lease (the
// address) stays the instance's.
func TestFailedLaunchLeavesNoTAP(t *testing.T) {
	e := newNetEnv(t, func(_ context.Context, _ *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
		return vmm.VMSpec{Name: rec.GetId(), VCPUs: 1, MemoryMiB: 64, Machine: vmm.MachineQ35, Accel: vmm.Accel(testAccel()),
			VFIO: []string{"/sys/bus/mdev/devices/00000000-0000-4000-8000-00000000dead"}}, nil
	})
	e.createNet("vm1")
	_, err := e.sup.Launch(ctxT(t, 60*time.Second), "vm1")
	require.Error(t, err)
	rec := e.get("vm1")
	lease := store.Network(rec)
	require.NotNil(t, lease, "the lease was written before the TAP")
	assert.True(t, store.LeaseHeld(lease))
	assert.Nil(t, rec.GetProcess())
	assert.Nil(t, nettest.Link(t, e.h, lease.GetNetwork().GetTap()), "no TAP left behind")
}

// TestLaunchWithNetworkRefusedWithoutOne: a record asking for a network on
// an agent with none fails before the fork, with the marker cleared.
func TestLaunchWithNetworkRefusedWithoutOne(t *testing.T) {
	e := newEnv(t)
	e.newSupervisor(nil)
	_, err := e.st.Create(ctxT(t, 10*time.Second), &vmflowv1.InstanceRecord{
		Id: "vm1", Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "q35", Accel: testAccel(), Network: "default"},
	})
	require.NoError(t, err)
	_, err = e.sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.ErrorIs(t, err, network.ErrNoNetwork)
	rec := e.get("vm1")
	assert.Nil(t, rec.GetLaunchStartedAt())
	assert.Nil(t, rec.GetProcess())
}
