package cli_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/store"
)

// TestDevicesSaysWhyAGroupIsNotOffered: a GPU whose IOMMU group holds a
// device of another card (a NIC whose driver has not loaded yet) is not
// vmflow's, and devices names that device and its class.
func TestDevicesSaysWhyAGroupIsNotOffered(t *testing.T) {
	sim := simtest.Start(t, vgpusim.Options{PCIGPUs: 4})
	g3 := vgpusim.PCIGPUAt(3)
	require.NoError(t, simtest.Write(sim.Path("bus", "pci", "drivers", "mlx5_core", "unbind"), g3.NIC))
	dir := t.TempDir()
	_, err := store.New(dir)
	require.NoError(t, err)
	code, out, stderr := runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root, "--gpu-passthrough", "all")
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Regexp(t, g3.GPU+` +whole +- +pci0000:00 +not-vmflows +- +group `+g3.Group+` also holds `+g3.NIC+` \(network controller\)`, out)
}
