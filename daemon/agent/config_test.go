package agent_test

import (
	"io"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/daemon/agent"
	"vmflow/hostagent/gpu"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/network"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
)

func TestParseFlags(t *testing.T) {
	c, err := agent.ParseFlags([]string{"--host-id", "h1", "--state-dir", "/tmp/s", "--image-root", "/a", "--image-root", "/b",
		"--vgpu-attach=false", "--sysfs-root", "/tmp/sim", "--graceful-timeout", "3s", "--holders-ignore-pid", "1"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "h1", c.HostID)
	assert.Equal(t, []string{"/a", "/b"}, c.ImageRoots)
	assert.False(t, c.VGPUAttach)
	assert.Equal(t, "/tmp/sim", c.SysfsRoot)
	assert.Equal(t, 3*time.Second, c.GracefulTimeout)
	assert.Equal(t, "/dev", c.DevRoot)
	assert.Equal(t, []int{1}, c.IgnoreUninspectable)

	d, err := agent.ParseFlags([]string{"--host-id", "h1"}, io.Discard)
	require.NoError(t, err)
	assert.True(t, d.VGPUAttach, "production attaches vGPUs")
	assert.Equal(t, "/var/lib/vmflow", d.StateDir)
	assert.Equal(t, store.DefaultQEMUUIDRange, d.QEMUUIDs, "a bare run confines QEMU with the default range")
	assert.Equal(t, "/dev/kvm", d.KVMDevice)
	assert.Equal(t, lease.DefaultOrphanGrace, d.OrphanGrace, "the flag's default is the package's")
	assert.Equal(t, gpu.DefaultSysfsRoot, d.SysfsRoot)
	assert.Equal(t, vmm.DefaultBinary, d.QEMU)
	assert.False(t, d.GPUPassthrough.Enabled(), "no whole GPUs unless named")
	assert.Equal(t, lease.DefaultQuarantineAfter, d.QuarantineAfter)

	p, err := agent.ParseFlags([]string{"--host-id", "h1", "--gpu-passthrough", "10de:2335,10DE:2330", "--gpu-quarantine-after", "3"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "10de:2335,10de:2330", p.GPUPassthrough.String())
	assert.Equal(t, 3, p.QuarantineAfter)
	assert.Empty(t, d.GPUScrub, "no scrub unless named")
	sc, err := agent.ParseFlags([]string{"--host-id", "h1", "--gpu-scrub", "/bin/true"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "/bin/true", sc.GPUScrub)
	assert.False(t, d.NetSubnet.IsValid(), "no network unless a subnet is given")
	assert.Equal(t, network.DefaultBridge, d.NetBridge)
	assert.Equal(t, uint(network.DefaultPortPPS), d.NetPortPPS, "the flag's default is the package's")

	n, err := agent.ParseFlags([]string{"--host-id", "h1", "--net-subnet", "10.88.0.0/24", "--net-egress", "eth0", "--net-netns", "t1"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, netip.MustParsePrefix("10.88.0.0/24"), n.NetSubnet)
	assert.Equal(t, "eth0", n.NetEgress)
	assert.Equal(t, "t1", n.NetNetNS)
	assert.Empty(t, n.NetDeny)
	pps, err := agent.ParseFlags([]string{"--host-id", "h1", "--net-port-pps", "5000"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, uint(5000), pps.NetPortPPS)
	dn, err := agent.ParseFlags([]string{"--host-id", "h1", "--net-subnet", "10.88.0.0/24", "--net-deny", "10.0.0.0/8,192.168.10.0/24"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.10.0/24")}, dn.NetDeny)

	u, err := agent.ParseFlags([]string{"--host-id", "h1", "--qemu-uid-range", "300000-300999"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, store.UIDRange{First: 300000, Last: 300999}, u.QEMUUIDs)
}

func TestParseFlagsRejects(t *testing.T) {
	for _, args := range [][]string{
		{"--host-id", "Host.Example"},
		{"--host-id", ""},
		{"--host-id", "h1", "--vgpu-driver", "nvidia"},
		{"--host-id", "h1", "--graceful-timeout", "0s"},
		{"--host-id", "h1", "stray"},
		{"--host-id", "h1", "--workflow-task-queue", ""},
		{"--host-id", "h1", "--holders-ignore-pid", "one"},
		{"--host-id", "h1", "--net-port-pps", "0"},
		{"--host-id", "h1", "--net-port-pps", "4294967296"},
		// QEMU runs as a uid of its own, always: the flag that ran it as
		// root (or one shared user) is gone; root is never in a range.
		{"--host-id", "h1", "--qemu-user", "nobody"},
		{"--host-id", "h1", "--qemu-uid-range", "0-100"},
		{"--host-id", "h1", "--qemu-uid-range", "300000"},
		{"--host-id", "h1", "--qemu-uid-range", "300999-300000"},
		{"--host-id", "h1", "--gpu-passthrough", "h200"},
		{"--host-id", "h1", "--gpu-quarantine-after", "0"},
		{"--host-id", "h1", "--gpu-scrub", "true"},               // not absolute
		{"--host-id", "h1", "--gpu-scrub", "/nonexistent/scrub"}, // a typo fails at start
		{"--host-id", "h1", "--gpu-scrub", "/etc"},               // not an executable file
		{"--host-id", "h1", "--net-subnet", "10.88.0.1/24"},      // host bits
		{"--host-id", "h1", "--net-subnet", "fd00::/64"},
		{"--host-id", "h1", "--net-subnet", "10.88.0.0/31"},
		{"--host-id", "h1", "--net-subnet", "ten"},
		{"--host-id", "h1", "--net-deny", "10.0.0.1/8"}, // host bits
		{"--host-id", "h1", "--net-deny", "10.0.0.0/8,fd00::/64"},
	} {
		_, err := agent.ParseFlags(args, io.Discard)
		assert.Error(t, err, "%q", args)
	}
}
