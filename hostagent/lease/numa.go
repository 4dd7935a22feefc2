package lease

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/store"
	"vmflow/hostagent/topology"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Placement inside the host. A VM with GPUs gets its CPUs and memory from
// its GPUs' NUMA node (KubeVirt's PCINUMAAwareTopology); one without goes
// where fewer GPUs are free, and then where most room is, so it leaves
// GPU nodes' CPUs to GPU VMs. "strict" takes one node or is refused;
// "preferred" (the default) spreads over several, with a guest NUMA node
// per host node, when no one node has room. A dedicated VM takes CPUs of
// the host's --dedicated-cpus, one per vCPU, that no other VM holds;
// every other VM's cpuset leaves that pool out, so none ever shares a CPU
// with a dedicated VM. A host of one node with no pool and no hugepages
// confines nothing: its VMs run as before the ledger.

// nodesUsed is what the records hold of each node, and the dedicated CPUs
// they hold.
type nodesUsed struct {
	nodes     map[int]*nodeUse
	dedicated map[int]bool
}

// nodeUse is what the records hold of one node: shared vCPUs, memory and
// hugepage MiB by page size in KiB, a share spread over several nodes
// counted evenly on each.
type nodeUse struct {
	vcpus, memMiB uint64
	hugeMiB       map[uint32]uint64
}

func (n *nodesUsed) at(id int) *nodeUse {
	if n.nodes == nil {
		n.nodes = map[int]*nodeUse{}
	}
	u := n.nodes[id]
	if u == nil {
		u = &nodeUse{hugeMiB: map[uint32]uint64{}}
		n.nodes[id] = u
	}
	return u
}

// add counts s on its nodes (a share placed on none counts only
// host-wide) and its dedicated CPUs.
func (n *nodesUsed) add(s *vmflowv1.CapacityLease) {
	if s.GetDedicatedCpus() {
		cpus, _ := topology.ParseCPUList(s.GetCpus())
		for _, c := range cpus {
			if n.dedicated == nil {
				n.dedicated = map[int]bool{}
			}
			n.dedicated[c] = true
		}
	}
	k := len(s.GetNumaNodes())
	if k == 0 {
		return
	}
	vcpus, mem := splitEven(uint64(s.GetVcpus()), k), splitEven(uint64(s.GetMemoryMib()), k)
	huge := splitEven(uint64(s.GetHugepages())*uint64(s.GetHugepageKib())/1024, k)
	for i, id := range s.GetNumaNodes() {
		u := n.at(int(id))
		if !s.GetDedicatedCpus() {
			u.vcpus += vcpus[i]
		}
		u.memMiB += mem[i]
		u.hugeMiB[s.GetHugepageKib()] += huge[i]
	}
}

// splitEven is v in k parts as even as they go, the larger first: how a
// VM on k nodes splits its vCPUs and RAM (vmm's guest NUMA nodes split
// them the same way).
func splitEven(v uint64, k int) []uint64 {
	out := make([]uint64, k)
	for i := range out {
		out[i] = v / uint64(k)
		if uint64(i) < v%uint64(k) {
			out[i]++
		}
	}
	return out
}

// dedicatedOf is how many dedicated CPUs s holds.
func dedicatedOf(s *vmflowv1.CapacityLease) uint64 {
	if s.GetDedicatedCpus() {
		return uint64(s.GetVcpus())
	}
	return 0
}

// hugepagePoolMiB is the MiB in pools of kib-KiB pages on nodes.
func hugepagePoolMiB(nodes []topology.Node, kib uint32) uint64 {
	var mib uint64
	for _, n := range nodes {
		mib += n.Hugepages[uint64(kib)<<10].Total * uint64(kib) / 1024
	}
	return mib
}

// hugepagePoolsMiB is the MiB in every pool of nodes.
func hugepagePoolsMiB(nodes []topology.Node) uint64 {
	var mib uint64
	for _, n := range nodes {
		for size, p := range n.Hugepages {
			mib += p.Total * (size >> 20)
		}
	}
	return mib
}

// placement is where a share runs: its nodes (empty: not bound) and
// cpuset (empty: not confined).
type placement struct {
	nodes []uint32
	cpus  string
}

// place chooses where rec's share s runs, against what the others hold.
func (c *Capacity) place(ctx context.Context, rec *vmflowv1.InstanceRecord, s *vmflowv1.CapacityLease, used nodesUsed) (placement, error) {
	t := c.cfg.Topology
	if len(t.Nodes) == 0 || (len(t.Nodes) == 1 && len(c.cfg.DedicatedCPUs) == 0 && s.GetHugepageKib() == 0) {
		return placement{}, nil
	}
	id, strict := rec.GetId(), rec.GetSpec().GetNuma() == "strict"
	var cands [][]topology.Node
	gpuNodes, stray := c.gpuNodes(rec)
	switch {
	case len(gpuNodes) > 1 || stray:
		if strict {
			return placement{}, fmt.Errorf("%w: instance %s asks numa \"strict\" but its GPUs are not on one NUMA node (%s)",
				ErrNoHostCapacity, id, describeNodes(gpuNodes, stray))
		}
		if !stray {
			cands = append(cands, gpuNodes)
		}
	case len(gpuNodes) == 1:
		cands = append(cands, gpuNodes)
		if !strict {
			for _, n := range c.byRoom(ctx, t.Nodes, used, false) {
				if n.ID != gpuNodes[0].ID {
					cands = append(cands, []topology.Node{n})
				}
			}
		}
	default:
		for _, n := range c.byRoom(ctx, t.Nodes, used, true) {
			cands = append(cands, []topology.Node{n})
		}
	}
	if !strict && len(t.Nodes) > 1 {
		cands = append(cands, t.Nodes)
	}
	pinned := pinned(rec.GetSpec())
	var why []string
	for _, set := range cands {
		p, err := c.placeOn(set, s, used, pinned)
		if err == nil {
			return p, nil
		}
		why = append(why, err.Error())
	}
	return placement{}, fmt.Errorf("%w: instance %s (%d vCPUs, %d MiB) fits no NUMA node: %s", ErrNoHostCapacity, id,
		s.GetVcpus(), s.GetMemoryMib(), strings.Join(why, "; "))
}

// placeOn places s across set, evenly, or says what a node lacks.
func (c *Capacity) placeOn(set []topology.Node, s *vmflowv1.CapacityLease, used nodesUsed, pinned bool) (placement, error) {
	k := len(set)
	if uint64(s.GetVcpus()) < uint64(k) {
		return placement{}, fmt.Errorf("%d vCPUs do not split over %d nodes", s.GetVcpus(), k)
	}
	vcpus, mem := splitEven(uint64(s.GetVcpus()), k), splitEven(uint64(s.GetMemoryMib()), k)
	huge := splitEven(uint64(s.GetHugepages())*uint64(s.GetHugepageKib())/1024, k)
	var p placement
	var cpus []int
	for i, n := range set {
		u := used.at(n.ID)
		shared, pool := c.nodeCPUs(n, used)
		if s.GetDedicatedCpus() {
			if uint64(len(pool)) < vcpus[i] {
				return placement{}, fmt.Errorf("node %d: %d dedicated CPUs free, %d asked", n.ID, len(pool), vcpus[i])
			}
			// The highest first: CPU 0 and its siblings carry the
			// host's own housekeeping.
			cpus = append(cpus, pool[len(pool)-int(vcpus[i]):]...)
		} else {
			limit := uint64(float64(len(shared)) * c.cfg.CPUOvercommit)
			if u.vcpus+vcpus[i] > limit || len(shared) == 0 {
				return placement{}, fmt.Errorf("node %d: %d of %d shared vCPUs free", n.ID, sub(limit, u.vcpus), limit)
			}
			cpus = append(cpus, shared...)
		}
		if limit := c.nodeMemoryMiB(n, pinned); u.memMiB+mem[i] > limit {
			return placement{}, fmt.Errorf("node %d: %d of %d MiB free", n.ID, sub(limit, u.memMiB), limit)
		}
		if kib := s.GetHugepageKib(); kib > 0 {
			pool := hugepagePoolMiB([]topology.Node{n}, kib)
			if u.hugeMiB[kib]+huge[i] > pool {
				return placement{}, fmt.Errorf("node %d: %d of %d MiB in %d KiB hugepages free", n.ID, sub(pool, u.hugeMiB[kib]), pool, kib)
			}
		}
		if c.cfg.Topology.NUMA {
			p.nodes = append(p.nodes, uint32(n.ID))
		}
	}
	slices.Sort(cpus)
	p.cpus = topology.FormatCPUList(slices.Compact(cpus))
	return p, nil
}

// nodeCPUs are n's CPUs a shared VM may run on (all but the dedicated
// pool) and its dedicated CPUs no VM holds, ascending.
func (c *Capacity) nodeCPUs(n topology.Node, used nodesUsed) (shared, pool []int) {
	for _, cpu := range n.CPUs {
		switch {
		case !slices.Contains(c.cfg.DedicatedCPUs, cpu):
			shared = append(shared, cpu)
		case !used.dedicated[cpu]:
			pool = append(pool, cpu)
		}
	}
	return shared, pool
}

// nodeMemoryMiB is what n may promise: its memory less its part of the
// reserve and its hugepage pools, times the overcommit (not for pinned
// memory).
func (c *Capacity) nodeMemoryMiB(n topology.Node, pinned bool) uint64 {
	mib := n.MemoryBytes >> 20
	reserve := c.cfg.MemoryReserveMiB * mib / max(c.cfg.MemoryMiB, 1)
	phys := sub(mib, reserve+hugepagePoolsMiB([]topology.Node{n}))
	if pinned {
		return phys
	}
	return uint64(float64(phys) * c.cfg.MemoryOvercommit)
}

// byRoom orders nodes for a VM: with gpuShy, those with fewer free GPUs
// first (FreeGPUs); then by free shared vCPUs, most first; then by id.
func (c *Capacity) byRoom(ctx context.Context, nodes []topology.Node, used nodesUsed, gpuShy bool) []topology.Node {
	var free map[int]int
	if gpuShy && c.cfg.FreeGPUs != nil {
		if f, err := c.cfg.FreeGPUs(ctx); err == nil {
			free = f
		}
	}
	room := func(n topology.Node) int64 {
		shared, _ := c.nodeCPUs(n, used)
		return int64(float64(len(shared))*c.cfg.CPUOvercommit) - int64(used.at(n.ID).vcpus)
	}
	out := slices.Clone(nodes)
	slices.SortStableFunc(out, func(a, b topology.Node) int {
		return cmp.Or(cmp.Compare(free[a.ID], free[b.ID]), cmp.Compare(room(b), room(a)), cmp.Compare(a.ID, b.ID))
	})
	return out
}

// gpuNodes are the nodes of rec's held GPU leases' devices, by id; stray:
// a GPU on no node of the host's, or whose node cannot be read.
func (c *Capacity) gpuNodes(rec *vmflowv1.InstanceRecord) (nodes []topology.Node, stray bool) {
	var ids []string
	for _, l := range store.HeldLeases(rec) {
		switch {
		case l.GetVgpu() != nil:
			ids = append(ids, store.ClaimDevice(l.GetVgpu()))
		case l.GetGpuPassthrough() != nil:
			ids = append(ids, store.PassthroughGPUs(l)...)
		}
	}
	for _, id := range ids {
		loc, err := gpu.Locate(c.cfg.SysfsRoot, id)
		n, ok := c.cfg.Topology.DeviceNode(loc.NUMANode)
		node, known := c.cfg.Topology.Node(n)
		if err != nil || !ok || !known {
			stray = true
			continue
		}
		if !slices.ContainsFunc(nodes, func(x topology.Node) bool { return x.ID == n }) {
			nodes = append(nodes, node)
		}
	}
	slices.SortFunc(nodes, func(a, b topology.Node) int { return cmp.Compare(a.ID, b.ID) })
	return nodes, stray
}

func describeNodes(nodes []topology.Node, stray bool) string {
	var parts []string
	for _, n := range nodes {
		parts = append(parts, fmt.Sprintf("node %d", n.ID))
	}
	if stray {
		parts = append(parts, "one on no known node")
	}
	return strings.Join(parts, ", ")
}
