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
	"vmflow/hostagent/vmm"
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
	nodes map[int]*nodeUse
	// dedicated counts the records holding each dedicated CPU (one, unless
	// a hand made two name it).
	dedicated map[int]int
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
func (n *nodesUsed) add(s *vmflowv1.CapacityLease) { n.count(s, true) }

// sub takes s, counted by add, back out.
func (n *nodesUsed) sub(s *vmflowv1.CapacityLease) { n.count(s, false) }

// count adds s (plus) or takes it back out.
func (n *nodesUsed) count(s *vmflowv1.CapacityLease, plus bool) {
	step := func(v *uint64, d uint64) {
		if plus {
			*v += d
		} else {
			*v = sub(*v, d)
		}
	}
	if s.GetDedicatedCpus() {
		d := 1
		if !plus {
			d = -1
		}
		cpus, _ := topology.ParseCPUList(s.GetCpus())
		for _, c := range cpus {
			if n.dedicated == nil {
				n.dedicated = map[int]int{}
			}
			if n.dedicated[c] += d; n.dedicated[c] <= 0 {
				delete(n.dedicated, c)
			}
		}
	}
	k := len(s.GetNumaNodes())
	if k == 0 {
		return
	}
	vcpus, mem := splitEven(uint64(s.GetVcpus()), k), splitEven(uint64(s.GetMemoryMib()), k)
	huge := splitEven(hugeMiB(s), k)
	for i, id := range s.GetNumaNodes() {
		u := n.at(int(id))
		if !s.GetDedicatedCpus() {
			step(&u.vcpus, vcpus[i])
		}
		step(&u.memMiB, mem[i])
		h := u.hugeMiB[s.GetHugepageKib()]
		step(&h, huge[i])
		u.hugeMiB[s.GetHugepageKib()] = h
	}
}

// clone is a copy of n to count more on.
func (n nodesUsed) clone() nodesUsed {
	out := nodesUsed{}
	for id, u := range n.nodes {
		c := out.at(id)
		c.vcpus, c.memMiB = u.vcpus, u.memMiB
		for k, v := range u.hugeMiB {
			c.hugeMiB[k] = v
		}
	}
	for c, k := range n.dedicated {
		if out.dedicated == nil {
			out.dedicated = map[int]int{}
		}
		out.dedicated[c] = k
	}
	return out
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

// placeHints are what placement reads from sysfs, outside the admission
// lock: the nodes of the VM's GPUs (stray: one on no node of the host's)
// and the GPUs free on each node.
type placeHints struct {
	gpuNodes []topology.Node
	stray    bool
	freeGPUs map[int]int
}

// hints reads rec's placeHints.
func (c *Capacity) hints(ctx context.Context, rec *vmflowv1.InstanceRecord) placeHints {
	var h placeHints
	if len(c.cfg.Topology.Nodes) == 0 {
		return h
	}
	h.gpuNodes, h.stray = c.gpuNodes(rec)
	if c.cfg.FreeGPUs != nil {
		if f, err := c.cfg.FreeGPUs(ctx); err == nil {
			h.freeGPUs = f
		}
	}
	return h
}

// place chooses where rec's share s runs, against what the others hold.
func (c *Capacity) place(rec *vmflowv1.InstanceRecord, s *vmflowv1.CapacityLease, used nodesUsed, h placeHints) (placement, error) {
	t := c.cfg.Topology
	if len(t.Nodes) == 0 || (len(t.Nodes) == 1 && len(c.cfg.DedicatedCPUs) == 0 && s.GetHugepageKib() == 0) {
		return placement{}, nil
	}
	id, strict := rec.GetId(), rec.GetSpec().GetNuma() == "strict"
	var cands [][]topology.Node
	switch {
	case len(h.gpuNodes) > 1 || h.stray:
		if strict {
			return placement{}, fmt.Errorf("%w: instance %s asks numa \"strict\" but its GPUs are not on one NUMA node (%s)",
				ErrNoHostCapacity, id, describeNodes(h.gpuNodes, h.stray))
		}
		if !h.stray {
			cands = append(cands, h.gpuNodes)
		}
	case len(h.gpuNodes) == 1:
		cands = append(cands, h.gpuNodes)
		if !strict {
			for _, n := range c.byRoom(t.Nodes, used, nil) {
				if n.ID != h.gpuNodes[0].ID {
					cands = append(cands, []topology.Node{n})
				}
			}
		}
	default:
		for _, n := range c.byRoom(t.Nodes, used, h.freeGPUs) {
			cands = append(cands, []topology.Node{n})
		}
	}
	if !strict && len(t.Nodes) > 1 {
		cands = append(cands, t.Nodes)
	}
	pinned := pinned(rec.GetSpec())
	var why []string
	for _, set := range cands {
		p, err := c.placeOn(set, rec.GetSpec(), s, used, pinned)
		if err == nil {
			return p, nil
		}
		why = append(why, err.Error())
	}
	return placement{}, fmt.Errorf("%w: instance %s (%d vCPUs, %d MiB) fits no NUMA node: %s", ErrNoHostCapacity, id,
		s.GetVcpus(), s.GetMemoryMib(), strings.Join(why, "; "))
}

// placeOn places s across set, evenly, or says what a node lacks.
func (c *Capacity) placeOn(set []topology.Node, spec *vmflowv1.VMSpec, s *vmflowv1.CapacityLease, used nodesUsed, pinned bool) (placement, error) {
	k := len(set)
	// What QEMU could not run over k guest nodes (a machine without
	// guest NUMA, RAM not whole pages on each) is no candidate.
	if err := vmm.SplitsOver(vmm.Machine(spec.GetMachine()), int(spec.GetVcpus()), int(spec.GetMemoryMib()), int(s.GetHugepageKib()), k); err != nil {
		return placement{}, err
	}
	vcpus, mem := splitEven(uint64(s.GetVcpus()), k), splitEven(uint64(s.GetMemoryMib()), k)
	huge := splitEven(hugeMiB(s), k)
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
		case used.dedicated[cpu] == 0:
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

// byRoom orders nodes for a VM: those with fewer free GPUs first (free:
// nil for a GPU VM, which goes by room alone); then by free shared vCPUs,
// most first; then by id.
func (c *Capacity) byRoom(nodes []topology.Node, used nodesUsed, free map[int]int) []topology.Node {
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

// gpuNodes are the nodes of rec's held GPU leases, by id; stray: a GPU
// on no node of the host's. A vGPU is where its parent GPU is (which a
// reboot does not take away, as it does the vGPU until its launch makes
// it again); a device whose node cannot be read counts as the platform's
// "not said" (topology.DeviceNode: the one node of a host of one).
func (c *Capacity) gpuNodes(rec *vmflowv1.InstanceRecord) (nodes []topology.Node, stray bool) {
	var ids []string
	for _, l := range store.HeldLeases(rec) {
		switch {
		case l.GetVgpu() != nil:
			id := l.GetVgpu().GetParent()
			if id == "" {
				id = store.ClaimDevice(l.GetVgpu())
			}
			ids = append(ids, id)
		case l.GetGpuPassthrough() != nil:
			ids = append(ids, store.PassthroughGPUs(l)...)
		}
	}
	for _, id := range ids {
		reported := topology.NoNode
		if loc, err := gpu.Locate(c.cfg.SysfsRoot, id); err == nil {
			reported = loc.NUMANode
		}
		n, ok := c.cfg.Topology.DeviceNode(reported)
		node, known := c.cfg.Topology.Node(n)
		if !ok || !known {
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
