package vgpusim_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
)

func fnPath(s *simtest.Sim, addr string, elem ...string) string {
	return s.Path(append([]string{"bus", "pci", "devices", addr}, elem...)...)
}

func driverOf(t *testing.T, s *simtest.Sim, addr string) string {
	t.Helper()
	target, err := os.Readlink(fnPath(s, addr, "driver"))
	if os.IsNotExist(err) {
		return ""
	}
	require.NoError(t, err)
	return filepath.Base(target)
}

// toVFIO is the shell recipe: override, unbind from drv, drivers_probe.
func toVFIO(t *testing.T, s *simtest.Sim, addr, drv string) {
	t.Helper()
	require.NoError(t, write(fnPath(s, addr, "driver_override"), "vfio-pci\n"))
	require.NoError(t, write(s.Path("bus", "pci", "drivers", drv, "unbind"), addr+"\n"))
	require.NoError(t, write(s.Path("bus", "pci", "drivers_probe"), addr+"\n"))
}

func TestPCILayout(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 4})
	for i := 0; i < 4; i++ {
		g := vgpusim.PCIGPUAt(i)
		assert.Equal(t, "0x10de", read(t, fnPath(s, g.GPU, "vendor")))
		assert.Equal(t, "nvidia", driverOf(t, s, g.GPU))
		assert.Equal(t, "(null)", read(t, fnPath(s, g.GPU, "driver_override")))
		target, err := os.Readlink(fnPath(s, g.GPU, "iommu_group"))
		require.NoError(t, err)
		assert.Equal(t, g.Group, filepath.Base(target))
		assertDir(t, s.Path("kernel", "iommu_groups", g.Group, "devices", g.GPU))
		assertDir(t, s.Path("bus", "pci", "drivers", "nvidia", g.GPU))
		_, err = os.Stat(filepath.Join(s.DevRoot, "nvidia"+string(rune('0'+i))))
		assert.NoError(t, err, "the GPU's /dev/nvidia node")
	}
	assert.Equal(t, "0x030200", read(t, fnPath(s, vgpusim.PCIGPUAt(0).GPU, "class")))
	one := vgpusim.PCIGPUAt(1)
	assert.Equal(t, "0x030000", read(t, fnPath(s, one.GPU, "class")))
	assert.Equal(t, "0x040300", read(t, fnPath(s, one.Audio, "class")))
	assert.Equal(t, "snd_hda_intel", driverOf(t, s, one.Audio))
	_, err := os.Stat(fnPath(s, one.Audio, "reset"))
	assert.ErrorIs(t, err, os.ErrNotExist, "the audio function has no reset method")
	assertDir(t, s.Path("kernel", "iommu_groups", one.Group, "devices", one.Audio))
	two := vgpusim.PCIGPUAt(2)
	assert.Equal(t, "pcieport", driverOf(t, s, two.Bridge))
	assert.Equal(t, "0x060400", read(t, fnPath(s, two.Bridge, "class")))
	three := vgpusim.PCIGPUAt(3)
	assert.Equal(t, "mlx5_core", driverOf(t, s, three.NIC))
	assertDir(t, s.Path("kernel", "iommu_groups", three.Group, "devices", three.NIC))
}

// TestPCIDriverModel: the kernel's bind/unbind/drivers_probe/override rules,
// and the group's VFIO node while a function is bound to vfio-pci.
func TestPCIDriverModel(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 2})
	g := vgpusim.PCIGPUAt(1)
	node := filepath.Join(s.DevRoot, "vfio", g.Group)
	drivers := s.Path("bus", "pci", "drivers")

	// Bound already: bind is EBUSY; unbind of another driver ENODEV.
	assert.ErrorIs(t, write(filepath.Join(drivers, "nvidia", "bind"), g.GPU), syscall.EBUSY)
	assert.ErrorIs(t, write(filepath.Join(drivers, "vfio-pci", "unbind"), g.GPU), syscall.ENODEV)
	assert.ErrorIs(t, write(filepath.Join(drivers, "nvidia", "unbind"), "0000:ff:00.0"), syscall.ENODEV)
	assert.ErrorIs(t, write(s.Path("bus", "pci", "drivers_probe"), "0000:ff:00.0"), syscall.ENODEV)

	// vfio-pci has no id table: without an override it takes nothing.
	require.NoError(t, write(filepath.Join(drivers, "nvidia", "unbind"), g.GPU))
	assert.Equal(t, "", driverOf(t, s, g.GPU))
	assert.ErrorIs(t, write(filepath.Join(drivers, "vfio-pci", "bind"), g.GPU), syscall.ENODEV)
	require.NoError(t, write(s.Path("bus", "pci", "drivers_probe"), g.GPU))
	assert.Equal(t, "nvidia", driverOf(t, s, g.GPU), "drivers_probe without an override finds nvidia again")

	toVFIO(t, s, g.GPU, "nvidia")
	assert.Equal(t, "vfio-pci", driverOf(t, s, g.GPU))
	assert.Equal(t, "vfio-pci", read(t, fnPath(s, g.GPU, "driver_override")))
	_, err := os.Stat(node)
	assert.NoError(t, err, "the group's VFIO node exists once a function is bound to vfio-pci")
	// An override naming another driver: nvidia's bind does not match.
	require.NoError(t, write(filepath.Join(drivers, "vfio-pci", "unbind"), g.GPU))
	_, err = os.Stat(node)
	assert.ErrorIs(t, err, os.ErrNotExist, "gone with the group's last vfio-pci function")
	assert.ErrorIs(t, write(filepath.Join(drivers, "nvidia", "bind"), g.GPU), syscall.ENODEV)
	require.NoError(t, write(fnPath(s, g.GPU, "driver_override"), "\n"))
	assert.Equal(t, "(null)", read(t, fnPath(s, g.GPU, "driver_override")))
	require.NoError(t, write(filepath.Join(drivers, "nvidia", "bind"), g.GPU))
	assert.Equal(t, "nvidia", driverOf(t, s, g.GPU))

	assert.ErrorIs(t, write(fnPath(s, g.GPU, "reset"), "2"), syscall.EINVAL)
	assert.NoError(t, write(fnPath(s, g.GPU, "reset"), "1"))
}

// TestPCINonViableGroupBindsAsTheKernelDoes: vfio-pci is a
// driver_managed_dma driver, so binding it in a group whose NIC stays on
// mlx5_core succeeds (Linux 5.19+); only the VFIO user's open would fail.
func TestPCINonViableGroupBindsAsTheKernelDoes(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 4})
	g := vgpusim.PCIGPUAt(3)
	toVFIO(t, s, g.GPU, "nvidia")
	assert.Equal(t, "vfio-pci", driverOf(t, s, g.GPU))
	assert.Equal(t, "mlx5_core", driverOf(t, s, g.NIC))
}

func TestPCIUnbindWaitsForUsers(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 1})
	g := vgpusim.PCIGPUAt(0)
	nv, err := s.Server.NvidiaNode(0)
	require.NoError(t, err)
	f, err := os.Open(nv)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- write(s.Path("bus", "pci", "drivers", "nvidia", "unbind"), g.GPU) }()
	require.Eventually(t, func() bool { return s.Server.Blocked() == 1 }, waitFor, time.Millisecond)
	// As __device_release_driver, the link goes before remove waits.
	assert.Equal(t, "", driverOf(t, s, g.GPU))
	drv, _ := s.Server.PCIDriver(g.GPU)
	assert.Equal(t, "nvidia", drv, "still the driver's until remove returns")
	require.NoError(t, f.Close())
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(waitFor):
		t.Fatal("unbind still blocked after the GPU's user closed it")
	}
	drv, _ = s.Server.PCIDriver(g.GPU)
	assert.Equal(t, "", drv)

	// vfio-pci waits for the holder of the group's node the same way.
	require.NoError(t, write(fnPath(s, g.GPU, "driver_override"), "vfio-pci"))
	require.NoError(t, write(s.Path("bus", "pci", "drivers_probe"), g.GPU))
	vf, err := os.Open(filepath.Join(s.DevRoot, "vfio", g.Group))
	require.NoError(t, err)
	go func() { done <- write(s.Path("bus", "pci", "drivers", "vfio-pci", "unbind"), g.GPU) }()
	require.Eventually(t, func() bool { return s.Server.Blocked() == 1 }, waitFor, time.Millisecond)
	require.NoError(t, vf.Close())
	require.NoError(t, <-done)
}

func TestPCIFaults(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 1})
	g := vgpusim.PCIGPUAt(0)
	unbind := s.Path("bus", "pci", "drivers", "nvidia", "unbind")

	s.Set(t, vgpusim.CtlFailUnbind, "EIO")
	assert.ErrorIs(t, write(unbind, g.GPU), syscall.EIO)
	assert.Equal(t, "nvidia", driverOf(t, s, g.GPU), "a failed unbind changes nothing")
	s.Clear(t, vgpusim.CtlFailUnbind)

	s.Set(t, vgpusim.CtlFailReset, "EBUSY")
	assert.ErrorIs(t, write(fnPath(s, g.GPU, "reset"), "1"), syscall.EBUSY)
	s.Clear(t, vgpusim.CtlFailReset)
	assert.NoError(t, write(fnPath(s, g.GPU, "reset"), "1"))

	s.Set(t, vgpusim.CtlBlockUnbind, "")
	done := make(chan error, 1)
	go func() { done <- write(unbind, g.GPU) }()
	require.Eventually(t, func() bool { return s.Server.Blocked() == 1 }, waitFor, time.Millisecond)
	// The device lock is held: drivers_probe waits behind the unbind.
	probed := make(chan error, 1)
	go func() { probed <- write(s.Path("bus", "pci", "drivers_probe"), g.GPU) }()
	s.Clear(t, vgpusim.CtlBlockUnbind)
	require.NoError(t, <-done)
	require.NoError(t, <-probed)
	assert.Equal(t, "nvidia", driverOf(t, s, g.GPU), "probed after the unbind finished")
}
