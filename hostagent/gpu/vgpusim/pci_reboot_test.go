package vgpusim_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
)

// A per-device fault acts on its function alone: one bad card beside a
// healthy one.
func TestPCIPerDeviceFaults(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 3})
	g0, g2 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(2)
	s.Set(t, vgpusim.At(vgpusim.CtlFailUnbind, g0.GPU), "EIO")
	assert.ErrorIs(t, write(s.Path("bus", "pci", "drivers", "nvidia", "unbind"), g0.GPU), syscall.EIO)
	assert.Equal(t, "nvidia", driverOf(t, s, g0.GPU), "nothing changed")
	toVFIO(t, s, g2.GPU, "nvidia")
	assert.Equal(t, "vfio-pci", driverOf(t, s, g2.GPU), "the other GPU is healthy")

	s.Set(t, vgpusim.At(vgpusim.CtlFailProbe, g2.GPU), "")
	require.NoError(t, write(s.Path("bus", "pci", "drivers", "vfio-pci", "unbind"), g2.GPU))
	require.NoError(t, write(fnPath(s, g2.GPU, "driver_override"), "\n"))
	require.NoError(t, write(s.Path("bus", "pci", "drivers_probe"), g2.GPU), "drivers_probe ignores a probe's failure")
	assert.Equal(t, "", driverOf(t, s, g2.GPU), "the probe failed")

	s.Set(t, vgpusim.At(vgpusim.CtlFailReset, g0.GPU), "EIO")
	assert.ErrorIs(t, write(fnPath(s, g0.GPU, "reset"), "1"), syscall.EIO)
	assert.NoError(t, write(fnPath(s, g2.GPU, "reset"), "1"))
}

// A reboot puts every function back on its driver without an override,
// renumbers the groups, removes and replaces cards as asked; the serial
// number in config space changes with the card.
func TestPCIReboot(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 3, PCIGroupWith: map[int]int{2: 0}})
	g0, g1, g2 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(1), vgpusim.PCIGPUAt(2)
	assert.Equal(t, g0.Group, s.Server.PCIGroup(g2.GPU), "GPU 2 shares GPU 0's group")
	assertDir(t, s.Path("kernel", "iommu_groups", g0.Group, "devices", g2.GPU))
	toVFIO(t, s, g1.GPU, "nvidia")
	cfg0, err := os.ReadFile(fnPath(s, g0.GPU, "config"))
	require.NoError(t, err)

	require.NoError(t, s.Server.Reboot(vgpusim.Reboot{GroupOffset: 7, Remove: []string{g2.GPU}, Replace: map[string]string{g0.GPU: "10de:2330"}}))
	assert.Equal(t, "nvidia", driverOf(t, s, g1.GPU))
	assert.Equal(t, "(null)", read(t, fnPath(s, g1.GPU, "driver_override")))
	_, err = os.Stat(filepath.Join(s.DevRoot, "vfio", g1.Group))
	assert.ErrorIs(t, err, os.ErrNotExist, "no VFIO node after a reboot")
	target, err := os.Readlink(fnPath(s, g1.GPU, "iommu_group"))
	require.NoError(t, err)
	assert.Equal(t, "408", filepath.Base(target))
	_, err = os.Stat(s.Path("kernel", "iommu_groups", g1.Group))
	assert.ErrorIs(t, err, os.ErrNotExist, "the old group number is gone")
	_, err = os.Stat(fnPath(s, g2.GPU))
	assert.ErrorIs(t, err, os.ErrNotExist, "the removed card")
	_, ok := s.Server.PCIDriver(g2.GPU)
	assert.False(t, ok)
	assert.Equal(t, "0x2330", read(t, fnPath(s, g0.GPU, "device")))
	cfg1, err := os.ReadFile(fnPath(s, g0.GPU, "config"))
	require.NoError(t, err)
	assert.NotEqual(t, cfg0[0x104:0x10c], cfg1[0x104:0x10c], "another card, another serial number")
}
