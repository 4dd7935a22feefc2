package gpu

import (
	"fmt"
	"path/filepath"

	"vmflow/hostagent/topology"
)

// Locate is where GPU device id sits (its NUMA node, PCIe root complex
// and root port; see topology.PCILocality): id is a PCI address (a whole
// GPU, a vGPU parent, a vendor VF) or an mdev's UUID, which sits where
// its parent GPU does. An error wraps ErrInvalid for an id of neither
// form, or the read's own.
func Locate(sysfsRoot, id string) (topology.PCILocality, error) {
	addr := id
	if !pciAddr.MatchString(id) {
		u, err := canonicalUUID(id)
		if err != nil {
			return topology.PCILocality{}, fmt.Errorf("vgpu: locate %q: not a PCI address or an mdev UUID: %w", id, ErrInvalid)
		}
		if _, addr, err = mdevType(filepath.Join(mdevPath(sysfsRoot, u), "mdev_type")); err != nil {
			return topology.PCILocality{}, fmt.Errorf("vgpu: locate mdev %s: %w", u, err)
		}
	}
	l, err := topology.ReadPCILocality(sysfsRoot, addr)
	if err != nil {
		return topology.PCILocality{}, fmt.Errorf("vgpu: locate %s: %w", id, err)
	}
	return l, nil
}

// locality is where PCI function addr sits, for a listing: unknown
// (topology.NoNode, no root) when sysfs cannot say, so that a GPU is
// listed all the same; placement counts it on no node (see
// topology.Topology.DeviceNode).
func locality(sysfsRoot, addr string) topology.PCILocality {
	l, _ := readLocality(sysfsRoot, addr)
	return l
}

// readLocality is locality, and whether sysfs said (a driver keeps only
// what it read).
func readLocality(sysfsRoot, addr string) (topology.PCILocality, bool) {
	l, err := topology.ReadPCILocality(sysfsRoot, addr)
	if err != nil {
		return topology.PCILocality{NUMANode: topology.NoNode}, false
	}
	return l, true
}
