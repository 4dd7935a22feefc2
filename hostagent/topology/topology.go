// Package topology reads the host's NUMA topology from sysfs: its nodes,
// each node's CPUs, memory and hugepage pools, and where a PCI device sits
// (its NUMA node, its PCIe root complex and root port). Placement inside
// the host builds on it: a VM's GPUs, CPUs and memory from one node.
//
// It reads a sysfs root (the agent's --sysfs-root: /sys, or a vgpusim
// mount in tests) with plain file reads, each bounded: a broken or hostile
// tree makes an error wrapping ErrMalformed, never a huge read, a loop or
// a panic. It writes nothing and knows nothing of GPUs, records or QEMU.
//
// The layout it reads (Documentation/ABI/stable/sysfs-devices-node,
// sysfs-bus-pci):
//
//	devices/system/node/node<N>/cpulist                     "0-3,8-11"
//	devices/system/node/node<N>/meminfo                     "Node N MemTotal: ... kB", "Node N MemFree: ... kB"
//	devices/system/node/node<N>/hugepages/hugepages-<size>kB/{nr_hugepages,free_hugepages}
//	devices/system/cpu/online                               (without NUMA)
//	kernel/mm/hugepages/hugepages-<size>kB/...              (without NUMA)
//	bus/pci/devices/<addr> -> ../../../devices/pci0000:80/0000:80:01.0/<addr>
//	bus/pci/devices/<addr>/numa_node                        "1", or "-1": not said
//
// A kernel without NUMA (CONFIG_NUMA off: no devices/system/node) is one
// node 0 holding every online CPU, MemTotal and MemFree of /proc/meminfo
// and the machine's hugepage pools (kernel/mm/hugepages).
package topology

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Hugepage sizes in bytes, the keys of Node.Hugepages on x86-64.
const (
	PageSize2M uint64 = 2 << 20
	PageSize1G uint64 = 1 << 30
)

// NoNode is the NUMA node of a device the platform placed on none: the
// kernel's numa_node reads -1 (NUMA_NO_NODE) when the firmware's tables
// do not say, and always on a kernel without NUMA. See
// Topology.DeviceNode for how placement counts such a device.
const NoNode = -1

// HugepagePool is one page size's pool on a node, in pages.
type HugepagePool struct {
	// Total is nr_hugepages: the pages the pool holds.
	Total uint64 `json:"total"`
	// Free is free_hugepages: the pages no mapping holds.
	Free uint64 `json:"free"`
}

// Node is one NUMA node.
type Node struct {
	// ID is the node's number (node<ID> in sysfs).
	ID int `json:"id"`
	// CPUs are the node's CPUs, ascending; a node of memory alone (CXL,
	// HBM) has none.
	CPUs []int `json:"cpus"`
	// MemoryBytes and FreeBytes are the node's MemTotal and MemFree:
	// hugepage pools count as used.
	MemoryBytes uint64 `json:"memory_bytes"`
	FreeBytes   uint64 `json:"free_bytes"`
	// Hugepages are the node's pools by page size in bytes (PageSize2M,
	// PageSize1G); a size the machine has no pool of is absent.
	Hugepages map[uint64]HugepagePool `json:"hugepages,omitempty"`
}

// Topology is the host's NUMA nodes.
type Topology struct {
	// Nodes are ordered by ID; never empty after Read.
	Nodes []Node `json:"nodes"`
	// NUMA: the kernel showed NUMA nodes. False: it has no NUMA, and
	// Nodes is the one node 0 that stands for the machine.
	NUMA bool `json:"numa"`
}

// Read reads the topology under sysRoot; on a kernel without NUMA, the
// memory is /proc/meminfo's (see ReadWithProc).
func Read(sysRoot string) (Topology, error) { return ReadWithProc(sysRoot, "/proc") }

// ReadWithProc is Read with procfs at procRoot, where a kernel without
// NUMA says its memory (procRoot/meminfo).
func ReadWithProc(sysRoot, procRoot string) (Topology, error) {
	dir := filepath.Join(sysRoot, "devices", "system", "node")
	names, err := readNames(dir)
	if errors.Is(err, os.ErrNotExist) {
		return readFlat(sysRoot, procRoot)
	}
	if err != nil {
		return Topology{}, fmt.Errorf("topology: NUMA nodes: %w", err)
	}
	t := Topology{NUMA: true}
	for _, name := range names {
		num, ok := strings.CutPrefix(name, "node")
		if !ok || num == "" || strings.TrimLeft(num, "0123456789") != "" {
			continue // online, possible, has_cpu, power, uevent...
		}
		id, err := strconv.Atoi(num)
		if err != nil || id > maxNodeID {
			return Topology{}, fmt.Errorf("topology: NUMA node folder %q: %w", name, ErrMalformed)
		}
		n, err := readNode(filepath.Join(dir, name), id)
		if err != nil {
			return Topology{}, err
		}
		t.Nodes = append(t.Nodes, n)
	}
	if len(t.Nodes) == 0 {
		return Topology{}, fmt.Errorf("topology: %s holds no node<N>: %w", dir, ErrMalformed)
	}
	slices.SortFunc(t.Nodes, func(a, b Node) int { return a.ID - b.ID })
	return t, nil
}

// readNode reads node<id>'s folder.
func readNode(dir string, id int) (Node, error) {
	n := Node{ID: id}
	s, err := readAttr(filepath.Join(dir, "cpulist"))
	if err != nil {
		return Node{}, fmt.Errorf("topology: node %d cpulist: %w", id, err)
	}
	if n.CPUs, err = ParseCPUList(s); err != nil {
		return Node{}, fmt.Errorf("topology: node %d: %w", id, err)
	}
	kb, err := meminfoKB(filepath.Join(dir, "meminfo"), "Node "+strconv.Itoa(id)+" ", "MemTotal", "MemFree")
	if err != nil {
		return Node{}, fmt.Errorf("topology: node %d meminfo: %w", id, err)
	}
	n.MemoryBytes, n.FreeBytes = kb["MemTotal"]<<10, kb["MemFree"]<<10
	if n.Hugepages, err = readHugepages(filepath.Join(dir, "hugepages")); err != nil {
		return Node{}, fmt.Errorf("topology: node %d: %w", id, err)
	}
	return n, nil
}

// readFlat is the topology of a kernel without NUMA: one node 0.
func readFlat(sysRoot, procRoot string) (Topology, error) {
	s, err := readAttr(filepath.Join(sysRoot, "devices", "system", "cpu", "online"))
	if err != nil {
		return Topology{}, fmt.Errorf("topology: no NUMA nodes, and the online CPUs: %w", err)
	}
	n := Node{ID: 0}
	if n.CPUs, err = ParseCPUList(s); err != nil {
		return Topology{}, fmt.Errorf("topology: online CPUs: %w", err)
	}
	kb, err := meminfoKB(filepath.Join(procRoot, "meminfo"), "", "MemTotal", "MemFree")
	if err != nil {
		return Topology{}, fmt.Errorf("topology: no NUMA nodes, and the memory: %w", err)
	}
	n.MemoryBytes, n.FreeBytes = kb["MemTotal"]<<10, kb["MemFree"]<<10
	if n.Hugepages, err = readHugepages(filepath.Join(sysRoot, "kernel", "mm", "hugepages")); err != nil {
		return Topology{}, err
	}
	return Topology{Nodes: []Node{n}}, nil
}

// Node returns node id.
func (t Topology) Node(id int) (Node, bool) {
	for _, n := range t.Nodes {
		if n.ID == id {
			return n, true
		}
	}
	return Node{}, false
}

// NodeOfCPU is the node holding cpu; false when no node lists it (an
// offline CPU, or no such CPU).
func (t Topology) NodeOfCPU(cpu int) (int, bool) {
	for _, n := range t.Nodes {
		if _, ok := slices.BinarySearch(n.CPUs, cpu); ok {
			return n.ID, true
		}
	}
	return NoNode, false
}

// CPUCount is the number of CPUs of every node.
func (t Topology) CPUCount() int {
	c := 0
	for _, n := range t.Nodes {
		c += len(n.CPUs)
	}
	return c
}

// DeviceNode is the node placement counts a device on, from the
// numa_node the kernel reports for it (PCILocality.NUMANode). A node of
// the topology is itself. NoNode (the platform did not say) is the one
// node when there is one: nothing else is near or far. With several
// nodes a NoNode device, or one on a node the topology lacks, is on no
// node (false): placement must not count it as near any CPUs, so a
// request that wants its GPUs on one node ("strict") cannot take it, and
// one that only prefers it may, as far from every node.
func (t Topology) DeviceNode(reported int) (int, bool) {
	if _, ok := t.Node(reported); ok {
		return reported, true
	}
	if reported == NoNode && len(t.Nodes) == 1 {
		return t.Nodes[0].ID, true
	}
	return NoNode, false
}
