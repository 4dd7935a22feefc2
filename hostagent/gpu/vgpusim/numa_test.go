package vgpusim_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/topology"
)

// TestNUMATopology: two nodes of CPUs, memory and hugepages, the GPUs
// round robin across them (one named onto node 0), each function of a
// card on its card's node and root port, as topology reads sysfs.
func TestNUMATopology(t *testing.T) {
	g3 := vgpusim.PCIGPUAt(3)
	s := simtest.Start(t, vgpusim.Options{
		PCIGPUs: 4, MdevParents: 2, VendorVFs: 2,
		NUMANodes: 2, NodeCPUs: 4, NodeMemoryMiB: 8192,
		NodeHugepages2M: vgpusim.Hugepages{Total: 512, Free: 256},
		NodeHugepages1G: vgpusim.Hugepages{Total: 2, Free: 1},
		GPUNodes:        map[string]int{g3.GPU: 0},
	})
	topo, err := topology.ReadWithProc(s.Root, t.TempDir())
	require.NoError(t, err)
	assert.True(t, topo.NUMA)
	require.Len(t, topo.Nodes, 2)
	for k, n := range topo.Nodes {
		assert.Equal(t, k, n.ID)
		assert.Equal(t, []int{4 * k, 4*k + 1, 4*k + 2, 4*k + 3}, n.CPUs)
		assert.Equal(t, uint64(8192)<<20, n.MemoryBytes)
		assert.Equal(t, uint64(8192-512*2-2*1024)<<20, n.FreeBytes, "the pools are not free memory")
		assert.Equal(t, map[uint64]topology.HugepagePool{
			topology.PageSize2M: {Total: 512, Free: 256},
			topology.PageSize1G: {Total: 2, Free: 1},
		}, n.Hugepages)
	}
	assert.Equal(t, "0-7", read(t, s.Path("devices", "system", "cpu", "online")))
	assert.Equal(t, "0-1", read(t, s.Path("devices", "system", "node", "online")))
	assert.Equal(t, "1024", read(t, s.Path("kernel", "mm", "hugepages", "hugepages-2048kB", "nr_hugepages")), "the machine's pool is the nodes'")

	want := map[string]int{} // GPU address -> node
	for i := range 4 {
		want[vgpusim.PCIGPUAt(i).GPU] = i % 2
	}
	want[g3.GPU] = 0
	want[vgpusim.MdevParent(0)], want[vgpusim.MdevParent(1)] = 0, 1
	want[vgpusim.VendorPF], want[vgpusim.VendorVF(1)] = 0, 0
	want[vgpusim.PCIGPUAt(1).Audio], want[g3.NIC], want[vgpusim.PCIGPUAt(2).Bridge] = 1, 0, 0
	ports := map[string]string{}
	for addr, node := range want {
		got, err := topology.ReadPCILocality(s.Root, addr)
		require.NoError(t, err, addr)
		model, ok := s.Server.PCILocality(addr)
		require.True(t, ok, addr)
		assert.Equal(t, model, got, "%s: sysfs shows the model", addr)
		assert.Equal(t, node, got.NUMANode, addr)
		assert.Equal(t, []string{"pci0000:00", "pci0000:10"}[node], got.PCIeRoot, addr)
		ports[addr] = got.RootPort
	}
	assert.Equal(t, ports[vgpusim.PCIGPUAt(1).GPU], ports[vgpusim.PCIGPUAt(1).Audio], "a card's functions share its port")
	assert.Equal(t, ports[vgpusim.VendorPF], ports[vgpusim.VendorVF(1)], "VFs sit on their PF's bus")
	assert.NotEqual(t, ports[vgpusim.PCIGPUAt(0).GPU], ports[vgpusim.PCIGPUAt(2).GPU], "each GPU has a port of its own")
	_, ok := s.Server.PCILocality("0000:99:00.0")
	assert.False(t, ok)
}

// Without NUMA options the simulator is a kernel without NUMA, as before:
// no devices/system, every numa_node -1, the paths under one root.
func TestNoNUMAByDefault(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 1, MdevParents: 1})
	_, err := os.Stat(s.Path("devices", "system"))
	assert.ErrorIs(t, err, os.ErrNotExist)
	for _, addr := range []string{vgpusim.PCIGPUAt(0).GPU, vgpusim.MdevParent(0)} {
		got, err := topology.ReadPCILocality(s.Root, addr)
		require.NoError(t, err)
		assert.Equal(t, topology.NoNode, got.NUMANode, addr)
		assert.Equal(t, "pci0000:00", got.PCIeRoot, addr)
		assert.NotEmpty(t, got.RootPort, addr)
		target, err := os.Readlink(s.Path("bus", "pci", "devices", addr))
		require.NoError(t, err)
		assert.Equal(t, "../../../devices/pci0000:00/"+got.RootPort+"/"+addr, target, "linked as the kernel links it")
	}
}

// A GPU in another's IOMMU group sits behind its switch: its root port
// and node; one taken out by a reboot leaves no folder behind.
func TestPCIGroupSharesThePortAndRebootRemoves(t *testing.T) {
	g0, g4 := vgpusim.PCIGPUAt(0), vgpusim.PCIGPUAt(4)
	s := simtest.Start(t, vgpusim.Options{PCIGPUs: 5, PCIGroupWith: map[int]int{4: 0}, NUMANodes: 2})
	l0, err := topology.ReadPCILocality(s.Root, g0.GPU)
	require.NoError(t, err)
	l4, err := topology.ReadPCILocality(s.Root, g4.GPU)
	require.NoError(t, err)
	assert.Equal(t, l0, l4)

	require.NoError(t, s.Server.Reboot(vgpusim.Reboot{Remove: []string{g4.GPU}}))
	_, err = topology.ReadPCILocality(s.Root, g4.GPU)
	assert.ErrorIs(t, err, os.ErrNotExist)
	_, err = os.Lstat(s.Path("devices", l4.PCIeRoot, l4.RootPort, g4.GPU))
	assert.ErrorIs(t, err, os.ErrNotExist)
	_, ok := s.Server.PCILocality(g4.GPU)
	assert.False(t, ok)
	assertDir(t, s.Path("bus", "pci", "devices", g0.GPU))
}

func TestNUMAOptionsChecked(t *testing.T) {
	proctest.RequiresFUSE(t)
	for name, o := range map[string]vgpusim.Options{
		"too many nodes":          {NUMANodes: vgpusim.MaxNUMANodes + 1},
		"CPUs without nodes":      {NodeCPUs: 4},
		"hugepages without nodes": {NodeHugepages2M: vgpusim.Hugepages{Total: 1}},
		"GPU node without nodes":  {PCIGPUs: 1, GPUNodes: map[string]int{vgpusim.PCIGPUAt(0).GPU: 0}},
		"pools past the memory":   {NUMANodes: 1, NodeMemoryMiB: 1024, NodeHugepages1G: vgpusim.Hugepages{Total: 2}},
		"more free than total":    {NUMANodes: 1, NodeHugepages2M: vgpusim.Hugepages{Total: 1, Free: 2}},
		"no such GPU":             {NUMANodes: 2, PCIGPUs: 1, GPUNodes: map[string]int{vgpusim.PCIGPUAt(1).GPU: 0}},
		"no such node":            {NUMANodes: 2, PCIGPUs: 1, GPUNodes: map[string]int{vgpusim.PCIGPUAt(0).GPU: 2}},
		"grouped GPU elsewhere":   {NUMANodes: 2, PCIGPUs: 5, PCIGroupWith: map[int]int{4: 0}, GPUNodes: map[string]int{vgpusim.PCIGPUAt(4).GPU: 1}},
		"negative CPUs":           {NUMANodes: 1, NodeCPUs: -1},
	} {
		dir := t.TempDir()
		srv, err := vgpusim.Mount(dir, o)
		if !assert.Error(t, err, name) {
			_ = srv.Unmount()
		}
	}
}
