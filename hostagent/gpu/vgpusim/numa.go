package vgpusim

import (
	"context"
	"fmt"
	"strconv"

	"github.com/hanwen/go-fuse/v2/fs"

	"vmflow/hostagent/topology"
)

// Bounds and defaults of the NUMA options.
const (
	MaxNUMANodes         = 8
	MaxNodeCPUs          = 1024
	MaxNodeMemoryMiB     = 16 << 20 // 16 TiB
	DefaultNodeCPUs      = 2
	DefaultNodeMemoryMiB = 4096
)

// Hugepages is one node's pool of one page size, in pages.
type Hugepages struct {
	Total, Free int
}

// The page sizes the simulator has pools of, as their folders name them.
var hugepageSizes = []struct {
	dir   string
	bytes uint64
	pool  func(o *Options) Hugepages
}{
	{"hugepages-2048kB", topology.PageSize2M, func(o *Options) Hugepages { return o.NodeHugepages2M }},
	{"hugepages-1048576kB", topology.PageSize1G, func(o *Options) Hugepages { return o.NodeHugepages1G }},
}

func (o *Options) nodeCPUs() int {
	if o.NodeCPUs == 0 {
		return DefaultNodeCPUs
	}
	return o.NodeCPUs
}

func (o *Options) nodeMemoryMiB() int {
	if o.NodeMemoryMiB == 0 {
		return DefaultNodeMemoryMiB
	}
	return o.NodeMemoryMiB
}

// checkNUMA checks the NUMA options against each other and the GPUs.
func (o *Options) checkNUMA() error {
	if o.NUMANodes < 0 || o.NUMANodes > MaxNUMANodes {
		return fmt.Errorf("vgpusim: NUMA nodes %d out of range 0..%d", o.NUMANodes, MaxNUMANodes)
	}
	if o.NUMANodes == 0 {
		if o.NodeCPUs != 0 || o.NodeMemoryMiB != 0 || o.NodeHugepages2M != (Hugepages{}) || o.NodeHugepages1G != (Hugepages{}) || len(o.GPUNodes) > 0 {
			return fmt.Errorf("vgpusim: node CPUs, memory, hugepages or GPU nodes given without NUMA nodes")
		}
		return nil
	}
	if o.NodeCPUs < 0 || o.NodeCPUs > MaxNodeCPUs || o.NUMANodes*o.nodeCPUs() > topology.MaxCPUs {
		return fmt.Errorf("vgpusim: %d CPUs per node out of range 1..%d", o.NodeCPUs, MaxNodeCPUs)
	}
	if o.NodeMemoryMiB < 0 || o.NodeMemoryMiB > MaxNodeMemoryMiB {
		return fmt.Errorf("vgpusim: node memory %d MiB out of range 1..%d", o.NodeMemoryMiB, MaxNodeMemoryMiB)
	}
	var pools uint64
	for _, hs := range hugepageSizes {
		p := hs.pool(o)
		if p.Total < 0 || p.Free < 0 || p.Free > p.Total || uint64(p.Total) > (uint64(MaxNodeMemoryMiB)<<20)/hs.bytes {
			return fmt.Errorf("vgpusim: %s pool of %d pages, %d free: out of range", hs.dir, p.Total, p.Free)
		}
		pools += uint64(p.Total) * hs.bytes
	}
	if pools > uint64(o.nodeMemoryMiB())<<20 {
		return fmt.Errorf("vgpusim: hugepage pools of %d MiB exceed the node's %d MiB", pools>>20, o.nodeMemoryMiB())
	}
	cards := o.cards()
	for addr, n := range o.GPUNodes {
		if _, ok := cards[addr]; !ok {
			return fmt.Errorf("vgpusim: GPU node for %s: not a simulated GPU (a PCI GPU's display function, an mdev parent or the vendor PF)", addr)
		}
		if n < 0 || n >= o.NUMANodes {
			return fmt.Errorf("vgpusim: GPU %s on node %d: no such node of %d", addr, n, o.NUMANodes)
		}
	}
	for i, j := range o.PCIGroupWith {
		// Behind one switch: GPU i hangs under GPU j's root port.
		a := PCIGPUAt(i).GPU
		if n, named := o.GPUNodes[a]; named && n != o.cardNode(PCIGPUAt(j).GPU, j) {
			return fmt.Errorf("vgpusim: PCI GPU %d shares GPU %d's IOMMU group, so its switch and node: not node %d", i, j, n)
		}
	}
	return nil
}

// cards maps every simulated GPU (a card, with a root port of its own) to
// its index in its family.
func (o *Options) cards() map[string]int {
	m := map[string]int{}
	for i := range o.MdevParents {
		m[MdevParent(i)] = i
	}
	if o.VendorVFs > 0 {
		m[VendorPF] = 0
	}
	for i := range o.PCIGPUs {
		m[PCIGPUAt(i).GPU] = i
	}
	return m
}

// cardNode is the node of GPU addr, the i-th of its family.
func (o *Options) cardNode(addr string, i int) int {
	if n, ok := o.GPUNodes[addr]; ok {
		return n
	}
	if o.NUMANodes == 0 {
		return 0
	}
	return i % o.NUMANodes
}

// pciPort is a root port: a card's functions hang under it.
type pciPort struct {
	node       int
	root, addr string // "pci0000:10", "0000:10:01.0"
	dir        *fs.Inode
}

// newPortLocked makes the next root port of node's root complex. Node k's
// root complex is pci0000:<k*0x10>, clear of every simulated function's
// bus; its ports are 0000:<bus>:01.0, 01.1, ... (the simulator does not
// keep a device's bus within its root's range: nothing reads that).
func (s *Server) newPortLocked(ctx context.Context, node int) *pciPort {
	bus := node * 0x10
	j := s.portsOn[node]
	s.portsOn[node]++
	p := &pciPort{node: node, root: fmt.Sprintf("pci0000:%02x", bus), addr: fmt.Sprintf("0000:%02x:%02x.%d", bus, 1+j/8, j%8)}
	p.dir = mkpath(ctx, s.root, "devices", p.root, p.addr)
	return p
}

// pciHomeLocked makes PCI function addr's folder under port, where the
// kernel keeps it, with its numa_node, and links bus/pci/devices/<addr>
// to it as the kernel does. The folder is at depth 4, as
// bus/pci/devices/<addr> is: links from it climb up(4) to the root.
func (s *Server) pciHomeLocked(ctx context.Context, port *pciPort, addr string) *fs.Inode {
	dir := mkdir(ctx, port.dir, addr)
	addLink(ctx, mkpath(ctx, s.root, "bus", "pci", "devices"), addr, up(3)+"devices/"+port.root+"/"+port.addr+"/"+addr)
	numa := "-1\n"
	if s.opts.NUMANodes > 0 {
		numa = strconv.Itoa(port.node) + "\n"
	}
	addFile(ctx, dir, "numa_node", roAttr(func() string { return numa }))
	s.homes[addr] = port
	return dir
}

// removeHomeLocked removes PCI function addr's folder and link.
func (s *Server) removeHomeLocked(addr string) {
	if p := s.homes[addr]; p != nil {
		p.dir.RmChild(addr)
		delete(s.homes, addr)
	}
	if devs := s.root.GetChild("bus").GetChild("pci").GetChild("devices"); devs != nil {
		devs.RmChild(addr)
	}
}

// PCILocality is where simulated PCI function addr sits, as sysfs shows
// it; false when there is no such function.
func (s *Server) PCILocality(addr string) (topology.PCILocality, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.homes[addr]
	if p == nil {
		return topology.PCILocality{}, false
	}
	l := topology.PCILocality{NUMANode: topology.NoNode, PCIeRoot: p.root, RootPort: p.addr}
	if s.opts.NUMANodes > 0 {
		l.NUMANode = p.node
	}
	return l, true
}

// buildNUMA serves devices/system/node, devices/system/cpu and
// kernel/mm/hugepages for Options.NUMANodes nodes; nothing without.
func (s *Server) buildNUMA(ctx context.Context) {
	o := &s.opts
	if o.NUMANodes == 0 {
		return
	}
	static := func(dir *fs.Inode, name, v string) {
		addFile(ctx, dir, name, roAttr(func() string { return v + "\n" }))
	}
	seq := func(from, n int) string {
		l := make([]int, n)
		for i := range l {
			l[i] = from + i
		}
		return topology.FormatCPUList(l)
	}
	nodes := mkpath(ctx, s.root, "devices", "system", "node")
	for _, name := range []string{"online", "possible", "has_cpu", "has_memory", "has_normal_memory"} {
		static(nodes, name, seq(0, o.NUMANodes))
	}
	cpus := mkpath(ctx, s.root, "devices", "system", "cpu")
	for _, name := range []string{"online", "possible", "present"} {
		static(cpus, name, seq(0, o.NUMANodes*o.nodeCPUs()))
	}
	memKB := uint64(o.nodeMemoryMiB()) << 10
	var poolKB uint64
	for _, hs := range hugepageSizes {
		poolKB += uint64(hs.pool(o).Total) * hs.bytes >> 10
	}
	def := o.NodeHugepages2M // the default size's pool, as meminfo shows it
	for k := range o.NUMANodes {
		dir := mkdir(ctx, nodes, "node"+strconv.Itoa(k))
		static(dir, "cpulist", seq(k*o.nodeCPUs(), o.nodeCPUs()))
		line := func(key string, v uint64, unit string) string {
			return fmt.Sprintf("Node %d %-15s %8d%s\n", k, key+":", v, unit)
		}
		meminfo := line("MemTotal", memKB, " kB") + line("MemFree", memKB-poolKB, " kB") + line("MemUsed", poolKB, " kB") +
			line("HugePages_Total", uint64(def.Total), "") + line("HugePages_Free", uint64(def.Free), "") + line("HugePages_Surp", 0, "")
		addFile(ctx, dir, "meminfo", roAttr(func() string { return meminfo }))
		s.buildHugepages(ctx, mkdir(ctx, dir, "hugepages"), 1)
	}
	s.buildHugepages(ctx, mkpath(ctx, s.root, "kernel", "mm", "hugepages"), o.NUMANodes)
}

// buildHugepages serves each page size's pool under dir, nodes times a
// node's (a node's own, or the machine's in kernel/mm/hugepages).
func (s *Server) buildHugepages(ctx context.Context, dir *fs.Inode, nodes int) {
	for _, hs := range hugepageSizes {
		p := hs.pool(&s.opts)
		pd := mkdir(ctx, dir, hs.dir)
		for name, v := range map[string]int{"nr_hugepages": p.Total * nodes, "free_hugepages": p.Free * nodes, "surplus_hugepages": 0} {
			addFile(ctx, pd, name, roAttr(func() string { return strconv.Itoa(v) + "\n" }))
		}
	}
}
