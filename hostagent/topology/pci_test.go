package topology_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/topology"
)

// pciTree lays out devices as the kernel does: each folder under
// devices/, bus/pci/devices/<addr> a relative link to it, numa_node in
// the folder unless numa is "".
func pciTree(t *testing.T, devices map[string]string) string {
	t.Helper()
	files := map[string]string{}
	for real, numa := range devices {
		addr := filepath.Base(real)
		files["bus/pci/devices/"+addr] = "->../../../" + real
		if numa != "" {
			files[real+"/numa_node"] = numa + "\n"
		}
		files[real+"/class"] = "0x030200\n"
	}
	return tree(t, files)
}

func TestReadPCILocality(t *testing.T) {
	root := pciTree(t, map[string]string{
		"devices/pci0000:80/0000:80:01.0/0000:81:00.0":                            "1",
		"devices/pci0000:80/0000:80:01.0/0000:82:00.0/0000:83:00.0":               "1",  // behind a switch
		"devices/pci0000:00/0000:00:03.0":                                         "-1", // on the root bus
		"devices/pci0000:00/0000:00:04.0":                                         "",   // no numa_node
		"devices/platform/soc/fd500000.pcie/pci0000:00/0000:00:00.0/0000:01:00.0": "0",
		"devices/pci10000:00/10000:00:02.0/0000:05:00.0":                          "0", // under VMD
	})
	for addr, want := range map[string]topology.PCILocality{
		"0000:81:00.0": {NUMANode: 1, PCIeRoot: "pci0000:80", RootPort: "0000:80:01.0"},
		"0000:83:00.0": {NUMANode: 1, PCIeRoot: "pci0000:80", RootPort: "0000:80:01.0"},
		"0000:00:03.0": {NUMANode: topology.NoNode, PCIeRoot: "pci0000:00"},
		"0000:00:04.0": {NUMANode: topology.NoNode, PCIeRoot: "pci0000:00"},
		"0000:01:00.0": {NUMANode: 0, PCIeRoot: "pci0000:00", RootPort: "0000:00:00.0"},
		"0000:05:00.0": {NUMANode: 0, PCIeRoot: "pci10000:00"},
	} {
		got, err := topology.ReadPCILocality(root, addr)
		if assert.NoError(t, err, addr) {
			assert.Equal(t, want, got, addr)
		}
	}
	_, err := topology.ReadPCILocality(root, "0000:99:00.0")
	assert.ErrorIs(t, err, os.ErrNotExist)
	for _, bad := range []string{"../../etc", "0000:81:00.0/..", "", "0000:81:00.8", "0000:81:00.0\n"} {
		_, err := topology.ReadPCILocality(root, bad)
		assert.ErrorIs(t, err, topology.ErrMalformed, "%q", bad)
	}
}

// A device folder that is not a link (an older simulator, a copied tree)
// has a node and no path.
func TestReadPCILocalityOfAFolder(t *testing.T) {
	root := tree(t, map[string]string{"bus/pci/devices/0000:81:00.0/numa_node": "0\n"})
	got, err := topology.ReadPCILocality(root, "0000:81:00.0")
	require.NoError(t, err)
	assert.Equal(t, topology.PCILocality{NUMANode: 0}, got)
}

func TestReadPCILocalityRefusesBrokenTrees(t *testing.T) {
	for name, files := range map[string]map[string]string{
		"numa_node not a number": {"bus/pci/devices/0000:81:00.0": "->../../../devices/pci0000:80/0000:81:00.0", "devices/pci0000:80/0000:81:00.0/numa_node": "one\n"},
		"numa_node below -1":     {"bus/pci/devices/0000:81:00.0": "->../../../devices/pci0000:80/0000:81:00.0", "devices/pci0000:80/0000:81:00.0/numa_node": "-2\n"},
		"numa_node huge":         {"bus/pci/devices/0000:81:00.0": "->../../../devices/pci0000:80/0000:81:00.0", "devices/pci0000:80/0000:81:00.0/numa_node": "4096\n"},
		"link to another name":   {"bus/pci/devices/0000:81:00.0": "->../../../devices/pci0000:80/0000:82:00.0"},
		"link under no root":     {"bus/pci/devices/0000:81:00.0": "->../../../devices/0000:81:00.0"},
		"root not under devices": {"bus/pci/devices/0000:81:00.0": "->../../../pci0000:80/0000:81:00.0"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := topology.ReadPCILocality(tree(t, files), "0000:81:00.0")
			assert.ErrorIs(t, err, topology.ErrMalformed)
		})
	}
}

// This machine's PCI devices each sit under a root complex, on a node of
// its topology (or on none, which one node takes).
func TestReadPCILocalityThisMachine(t *testing.T) {
	topo, err := topology.Read("/sys")
	require.NoError(t, err)
	ents, err := os.ReadDir("/sys/bus/pci/devices")
	if os.IsNotExist(err) || len(ents) == 0 {
		t.Skip("no PCI devices in /sys")
	}
	require.NoError(t, err)
	for _, e := range ents {
		l, err := topology.ReadPCILocality("/sys", e.Name())
		require.NoError(t, err, e.Name())
		assert.Regexp(t, `^pci[0-9a-f]{4,8}:[0-9a-f]{2}$`, l.PCIeRoot, e.Name())
		if len(topo.Nodes) == 1 {
			_, ok := topo.DeviceNode(l.NUMANode)
			assert.True(t, ok, "%s on node %d", e.Name(), l.NUMANode)
		}
	}
}
