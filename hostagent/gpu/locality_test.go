package gpu_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/topology"
)

// TestListingsCarryLocality: on a two-node simulator every listing of
// GPUs says where each sits (whole GPUs, mdev parents, the vendor PF),
// and Locate says it of any device id, an mdev's being its parent's.
func TestListingsCarryLocality(t *testing.T) {
	g1 := vgpusim.PCIGPUAt(1)
	sim := simtest.Start(t, vgpusim.Options{PCIGPUs: 2, MdevParents: 2, VendorVFs: 2, NUMANodes: 2,
		GPUNodes: map[string]int{vgpusim.VendorPF: 1}})
	ctx := context.Background()
	model := func(addr string) topology.PCILocality {
		l, ok := sim.Server.PCILocality(addr)
		require.True(t, ok, addr)
		return l
	}

	f, err := gpu.ParseGPUFilter("all")
	require.NoError(t, err)
	gpus, err := gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot: sim.Root, StateDir: t.TempDir(), Filter: f}).GPUs(ctx)
	require.NoError(t, err)
	seen := map[string]topology.PCILocality{}
	for _, g := range gpus {
		seen[g.Addr] = g.PCILocality
		assert.Equal(t, model(g.Addr), g.PCILocality, g.Addr)
	}
	assert.Equal(t, 1, seen[g1.GPU].NUMANode, "PCI GPU 1 round robin on node 1")
	assert.Equal(t, "pci0000:10", seen[g1.GPU].PCIeRoot)
	assert.Equal(t, 1, seen[vgpusim.VendorPF].NUMANode, "named onto node 1")
	assert.Len(t, seen, 2+2+1+2, "every display function: PCI GPUs, mdev parents, the PF and its VFs")

	mdev, err := gpu.New(gpu.Config{SysfsRoot: sim.Root, StateDir: t.TempDir(), Kind: gpu.KindMdev})
	require.NoError(t, err)
	profs, err := mdev.Profiles(ctx)
	require.NoError(t, err)
	require.NotEmpty(t, profs)
	for _, p := range profs {
		assert.Equal(t, model(p.Parent), p.PCILocality, "%s on %s", p.Name, p.Parent)
	}
	vendor, err := gpu.New(gpu.Config{SysfsRoot: sim.Root, StateDir: t.TempDir(), Kind: gpu.KindVendor})
	require.NoError(t, err)
	profs, err = vendor.Profiles(ctx)
	require.NoError(t, err)
	require.NotEmpty(t, profs)
	for _, p := range profs {
		assert.Equal(t, 1, p.NUMANode, "%s on the PF's node", p.Name)
	}

	dev, err := mdev.Create(ctx, gpu.CreateRequest{Profile: "GRID A100-4C", UUID: uuid.NewString(),
		At: &gpu.Placement{Profile: "GRID A100-4C", TypeID: "nvidia-471", Parent: vgpusim.MdevParent(1)}})
	require.NoError(t, err)
	for id, want := range map[string]string{dev.ID: vgpusim.MdevParent(1), vgpusim.VendorVF(1): vgpusim.VendorVF(1), g1.GPU: g1.GPU} {
		l, err := gpu.Locate(sim.Root, id)
		require.NoError(t, err, id)
		assert.Equal(t, model(want), l, id)
	}
	_, err = gpu.Locate(sim.Root, "../../etc")
	assert.ErrorIs(t, err, gpu.ErrInvalid)
	_, err = gpu.Locate(sim.Root, uuid.NewString())
	assert.ErrorIs(t, err, os.ErrNotExist, "no such mdev")
}

// TestMdevParentOnTheKernelsLayout: the kernel keeps an mdev under its
// parent and writes its mdev_type link relative to it
// ("../mdev_supported_types/<type>", no parent in the text): the parent
// is read from where the link leads, and the mdev sits where it does.
func TestMdevParentOnTheKernelsLayout(t *testing.T) {
	root := t.TempDir()
	const parent, id = "0000:3b:00.0", "5e1b5c4a-2c55-4b1e-9a34-7d0c3f2a9b10"
	home := "devices/pci0000:3a/0000:3a:00.0/" + parent
	for p, content := range map[string]string{
		home + "/mdev_supported_types/nvidia-471/name":                "GRID A100-4C\n",
		home + "/mdev_supported_types/nvidia-471/available_instances": "9\n",
		home + "/numa_node":         "1\n",
		home + "/" + id + "/remove": "",
	} {
		require.NoError(t, os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(root, p), []byte(content), 0o644))
	}
	for link, target := range map[string]string{
		home + "/" + id + "/mdev_type": "../mdev_supported_types/nvidia-471",
		"bus/mdev/devices/" + id:       "../../../" + home + "/" + id,
		"bus/pci/devices/" + parent:    "../../../" + home,
		"class/mdev_bus/" + parent:     "../../" + home,
	} {
		require.NoError(t, os.MkdirAll(filepath.Join(root, filepath.Dir(link)), 0o755))
		require.NoError(t, os.Symlink(target, filepath.Join(root, link)))
	}

	drv, err := gpu.New(gpu.Config{SysfsRoot: root, StateDir: t.TempDir(), Kind: gpu.KindMdev})
	require.NoError(t, err)
	devs, err := drv.Devices(context.Background())
	require.NoError(t, err)
	require.Len(t, devs, 1)
	assert.Equal(t, gpu.Device{Kind: gpu.KindMdev, ID: id, UUID: id, Profile: "GRID A100-4C", TypeID: "nvidia-471", Parent: parent}, devs[0])
	l, err := gpu.Locate(root, id)
	require.NoError(t, err)
	assert.Equal(t, topology.PCILocality{NUMANode: 1, PCIeRoot: "pci0000:3a", RootPort: "0000:3a:00.0"}, l)
}
