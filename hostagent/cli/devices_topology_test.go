package cli_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/hostagent/topology"
)

// TestDevicesShowsTopology: on a two-node host devices lists the nodes
// (CPUs, memory, hugepages) above the devices, and each device's node and
// PCIe root, a vGPU's its parent's; -o json adds the root port.
func TestDevicesShowsTopology(t *testing.T) {
	sim := simtest.Start(t, vgpusim.Options{PCIGPUs: 2, MdevParents: 2, NUMANodes: 2, NodeCPUs: 2, NodeMemoryMiB: 4096,
		NodeHugepages2M: vgpusim.Hugepages{Total: 512, Free: 500}})
	dir := t.TempDir()
	_, err := store.New(dir)
	require.NoError(t, err)
	mdev, err := gpu.New(gpu.Config{SysfsRoot: sim.Root, StateDir: dir, Kind: gpu.KindMdev})
	require.NoError(t, err)
	p1 := vgpusim.MdevParent(1)
	dev, err := mdev.Create(context.Background(), gpu.CreateRequest{Profile: "GRID A100-4C", UUID: uuid.NewString(),
		At: &gpu.Placement{Profile: "GRID A100-4C", TypeID: "nvidia-471", Parent: p1}})
	require.NoError(t, err)
	g1 := vgpusim.PCIGPUAt(1).GPU

	code, out, stderr := runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root, "--gpu-passthrough", "all")
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Empty(t, stderr)
	assert.Regexp(t, `(?m)^NODE +CPUS +MEMORY +FREE +2M-PAGES +1G-PAGES$`, out)
	assert.Regexp(t, `(?m)^0 +0-1 +4\.0 GiB +3\.0 GiB +500/512 +0/0$`, out)
	assert.Regexp(t, `(?m)^1 +2-3 +4\.0 GiB +3\.0 GiB +500/512 +0/0$`, out)
	assert.Regexp(t, `(?m)^DEVICE +KIND +NUMA +PCIE-ROOT +STATE +INSTANCE +WHY$`, out)
	assert.Regexp(t, `(?m)^`+vgpusim.PCIGPUAt(0).GPU+` +whole +0 +pci0000:00 +free `, out)
	assert.Regexp(t, `(?m)^`+g1+` +whole +1 +pci0000:10 +free `, out)
	assert.Regexp(t, `(?m)^`+p1+` +vgpu-parent +1 +pci0000:10 +free `, out)
	assert.Regexp(t, `(?m)^`+dev.ID+` +vgpu +1 +pci0000:10 +free `, out, "a vGPU sits where its parent does")

	code, out, stderr = runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root, "--gpu-passthrough", "all", "-o", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	var rows []struct {
		lease.DeviceRow
		topology.PCILocality
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rows))
	by := map[string]topology.PCILocality{}
	for _, r := range rows {
		by[r.ID] = r.PCILocality
	}
	for id, addr := range map[string]string{g1: g1, p1: p1, dev.ID: p1} {
		want, ok := sim.Server.PCILocality(addr)
		require.True(t, ok)
		assert.Equal(t, want, by[id], id)
	}
	assert.NotEmpty(t, by[g1].RootPort)
}

// Without NUMA in sysfs (nor cpu/online: the simulator's default) the
// devices are listed all the same, each on no node, and stderr says
// why there is no node table.
func TestDevicesWithoutTopology(t *testing.T) {
	sim := simtest.Start(t, vgpusim.Options{PCIGPUs: 1})
	dir := t.TempDir()
	_, err := store.New(dir)
	require.NoError(t, err)
	code, out, stderr := runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root, "--gpu-passthrough", "all")
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, stderr, "the host's NUMA nodes")
	assert.NotContains(t, out, "NODE")
	assert.Regexp(t, `(?m)^`+vgpusim.PCIGPUAt(0).GPU+` +whole +- +pci0000:00 +free `, out)
}

// A quarantine naming a device no listing has, with control characters
// in its reason and instance, is listed on no node and shown escaped.
func TestDevicesEscapesEveryColumn(t *testing.T) {
	sim := simtest.Start(t, vgpusim.Options{PCIGPUs: 1})
	dir := t.TempDir()
	_, err := store.New(dir)
	require.NoError(t, err)
	_, err = lease.NewQuarantine(dir, 1, nil).Strike(context.Background(), "vm\x1b]0;owned\x07", "reset: \x1b[2J\u202egone", "0000:99:00.0")
	require.NoError(t, err)
	code, out, stderr := runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root)
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.NotContains(t, out, "\x1b")
	assert.NotContains(t, out, "\u202e")
	assert.Regexp(t, `(?m)^0000:99:00.0 +\? +- +- +quarantined +vm\\x1b\]0;owned\\x07 +failed 1 times: reset: \\x1b\[2J\\u202egone$`, out)
}
