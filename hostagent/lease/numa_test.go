package lease_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/hostagent/topology"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// twoNodes is a host of two NUMA nodes of 4 CPUs and 8 GiB each; node 1
// has a pool of 512 2M hugepages. GPU 0000:01:00.0 and 0000:02:00.0 sit
// on node 0, 0000:81:00.0 and 0000:82:00.0 on node 1.
func twoNodes(t *testing.T, mutate func(*lease.CapacityConfig)) *capacityHost {
	t.Helper()
	sys := t.TempDir()
	for addr, node := range map[string]string{"0000:01:00.0": "0", "0000:02:00.0": "0", "0000:81:00.0": "1", "0000:82:00.0": "1"} {
		dir := filepath.Join(sys, "bus", "pci", "devices", addr)
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "numa_node"), []byte(node+"\n"), 0o644))
	}
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	h := &capacityHost{st: st, now: time.Date(2026, 12, 6, 8, 0, 0, 0, time.UTC)}
	cfg := lease.CapacityConfig{Store: st, CPUs: 8, MemoryMiB: 16384, MemoryReserveMiB: 0, CPUOvercommit: 1, MemoryOvercommit: 1,
		SysfsRoot: sys, Now: h.clock,
		Topology: topology.Topology{NUMA: true, Nodes: []topology.Node{
			{ID: 0, CPUs: []int{0, 1, 2, 3}, MemoryBytes: 8 << 30},
			{ID: 1, CPUs: []int{4, 5, 6, 7}, MemoryBytes: 8 << 30,
				Hugepages: map[uint64]topology.HugepagePool{topology.PageSize2M: {Total: 512, Free: 512}}},
		}}}
	if mutate != nil {
		mutate(&cfg)
	}
	h.cfg = cfg
	h.cap, err = lease.NewCapacity(cfg)
	require.NoError(t, err)
	return h
}

// restart is the agent started again over the same records and sysfs,
// its flags changed by mutate.
func (h *capacityHost) restart(t *testing.T, mutate func(*lease.CapacityConfig)) {
	t.Helper()
	mutate(&h.cfg)
	var err error
	h.cap, err = lease.NewCapacity(h.cfg)
	require.NoError(t, err)
}

// withGPUs creates id holding whole GPUs at addrs (their leases written
// ahead as a claim does).
func (h *capacityHost) withGPUs(t *testing.T, id string, spec *vmflowv1.VMSpec, addrs ...string) {
	t.Helper()
	spec.GpuPassthroughCount = uint32(len(addrs))
	_, err := h.create(id, spec)
	require.NoError(t, err)
	for _, a := range addrs {
		_, err := h.st.Apply(context.Background(), id, store.LeaseIntent(store.PassthroughLeaseOf(&vmflowv1.PassthroughLease{
			IommuGroup: a, Functions: []*vmflowv1.PassthroughFunction{{Addr: a, Display: true, Id: "10de:2335"}}}), h.clock()))
		require.NoError(t, err)
	}
}

func placed(t *testing.T, rec *vmflowv1.InstanceRecord) *vmflowv1.CapacityLease {
	t.Helper()
	l := store.Capacity(rec)
	require.NotNil(t, l)
	require.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, l.GetPhase())
	return l.GetCapacity()
}

// TestNUMAGPUVMRunsOnItsGPUsNode: a VM whose two GPUs sit on node 1 gets
// node 1's CPUs and memory.
func TestNUMAGPUVMRunsOnItsGPUsNode(t *testing.T) {
	h := twoNodes(t, nil)
	h.withGPUs(t, "gpu2", vm(2, 1024), "0000:81:00.0", "0000:82:00.0")
	rec, err := h.place(t, "gpu2")
	require.NoError(t, err)
	c := placed(t, rec)
	assert.Equal(t, []uint32{1}, c.GetNumaNodes())
	assert.Equal(t, "4-7", c.GetCpus())
}

// TestNUMADedicatedCPUsAreNobodyElses: with 6-7 kept for dedicated VMs, a
// VM on node 1 gets 4-5 and a dedicated VM 6-7: no CPU of one is in the
// other's cpuset, whichever launches first; a third dedicated VM finds
// none left.
func TestNUMADedicatedCPUsAreNobodyElses(t *testing.T) {
	h := twoNodes(t, func(c *lease.CapacityConfig) { c.DedicatedCPUs = []int{6, 7} })
	ded := vm(2, 512)
	ded.DedicatedCpus = true
	_, err := h.create("dedicated", ded)
	require.NoError(t, err)
	rec, err := h.place(t, "dedicated")
	require.NoError(t, err)
	d := placed(t, rec)
	assert.Equal(t, "6-7", d.GetCpus())
	assert.Equal(t, []uint32{1}, d.GetNumaNodes())

	h.withGPUs(t, "gpu", vm(2, 1024), "0000:81:00.0")
	rec, err = h.place(t, "gpu")
	require.NoError(t, err)
	assert.Equal(t, "4-5", placed(t, rec).GetCpus(), "the dedicated pool is in no other VM's cpuset")

	_, err = h.create("third", func() *vmflowv1.VMSpec { s := vm(1, 64); s.DedicatedCpus = true; return s }())
	require.ErrorIs(t, err, lease.ErrNoHostCapacity)
	assert.Contains(t, err.Error(), "dedicated CPUs")
}

// TestNUMAStrictWantsOneNode: GPUs on two nodes refuse a strict VM and
// spread a preferred one, with a guest NUMA node per host node.
func TestNUMAStrictWantsOneNode(t *testing.T) {
	h := twoNodes(t, nil)
	strict := vm(2, 1024)
	strict.Numa = "strict"
	h.withGPUs(t, "strict", strict, "0000:01:00.0", "0000:81:00.0")
	_, err := h.place(t, "strict")
	require.ErrorIs(t, err, lease.ErrNoHostCapacity)
	assert.Contains(t, err.Error(), "not on one NUMA node (node 0, node 1)")

	h.withGPUs(t, "preferred", vm(2, 1024), "0000:02:00.0", "0000:82:00.0")
	rec, err := h.place(t, "preferred")
	require.NoError(t, err)
	c := placed(t, rec)
	assert.Equal(t, []uint32{0, 1}, c.GetNumaNodes())
	assert.Equal(t, "0-7", c.GetCpus())
}

// TestNUMAVMWithoutGPUsLeavesGPUNodes: a CPU-only VM goes to the node with
// fewer free GPUs, not the fuller one.
func TestNUMAVMWithoutGPUsLeavesGPUNodes(t *testing.T) {
	h := twoNodes(t, func(c *lease.CapacityConfig) {
		c.FreeGPUs = func(context.Context) (map[int]int, error) { return map[int]int{0: 2}, nil }
	})
	_, err := h.create("cpu", vm(2, 1024))
	require.NoError(t, err)
	rec, err := h.place(t, "cpu")
	require.NoError(t, err)
	assert.Equal(t, []uint32{1}, placed(t, rec).GetNumaNodes(), "node 0 has the free GPUs")
}

// TestNUMATooBigForOneNode: 6 vCPUs fit no 4-CPU node: preferred spreads
// over both, strict is refused.
func TestNUMATooBigForOneNode(t *testing.T) {
	h := twoNodes(t, nil)
	_, err := h.create("big", vm(6, 1024))
	require.NoError(t, err)
	rec, err := h.place(t, "big")
	require.NoError(t, err)
	assert.Equal(t, []uint32{0, 1}, placed(t, rec).GetNumaNodes())

	h2 := twoNodes(t, nil)
	s := vm(6, 1024)
	s.Numa = "strict"
	_, err = h2.create("big", s)
	require.NoError(t, err)
	_, err = h2.place(t, "big")
	require.ErrorIs(t, err, lease.ErrNoHostCapacity)
	assert.Contains(t, err.Error(), "fits no NUMA node")
}

// TestHugepagesFromTheNodesPool: hugepage RAM is counted against the
// pool (its node's), not the general memory, and refused when the pool
// is short.
func TestHugepagesFromTheNodesPool(t *testing.T) {
	h := twoNodes(t, nil)
	assert.EqualValues(t, 16384-1024, h.cap.Limits().PhysicalMiB, "the pool is not general memory")
	s := vm(1, 1024)
	s.Hugepages = "2M"
	_, err := h.create("huge", s)
	require.NoError(t, err)
	rec, err := h.place(t, "huge")
	require.NoError(t, err)
	c := placed(t, rec)
	assert.EqualValues(t, 512, c.GetHugepages())
	assert.EqualValues(t, 2048, c.GetHugepageKib())
	assert.EqualValues(t, 256, c.GetMemoryMib(), "only QEMU's own beside the pages")
	assert.Equal(t, []uint32{1}, c.GetNumaNodes(), "the node with the pool")

	more := vm(1, 2)
	more.Hugepages = "2M"
	_, err = h.create("more", more)
	require.ErrorIs(t, err, lease.ErrNoHostCapacity)
	assert.Contains(t, err.Error(), "hugepages")
}

// TestOneNodeHostPlacesNothing: a host of one node with no dedicated CPUs
// and no hugepages confines no VM (as before the ledger).
func TestOneNodeHostPlacesNothing(t *testing.T) {
	h := newCapacityHost(t, 4, 1)
	_, err := h.create("vm", vm(1, 64))
	require.NoError(t, err)
	rec, err := h.place(t, "vm")
	require.NoError(t, err)
	c := placed(t, rec)
	assert.Empty(t, c.GetNumaNodes())
	assert.Empty(t, c.GetCpus())
}

// TestWholeClaimTakesGPUsOfOneNode: on a simulated host of two NUMA nodes
// (GPUs 0000:81 and 0000:83 on node 0; 0000:82, 0000:85 and 0000:86 on
// node 1, 0000:84 beside a NIC, never offered), a claim of two takes both
// from one node, the fuller one first (packing), the next claim both from
// the other; a strict claim no node can serve is refused and holds
// nothing.
func TestWholeClaimTakesGPUsOfOneNode(t *testing.T) {
	nodes := map[string]int{"0000:81:00.0": 0, "0000:83:00.0": 0, "0000:82:00.0": 1, "0000:84:00.0": 1, "0000:85:00.0": 1, "0000:86:00.0": 1}
	e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: 6, NUMANodes: 2, GPUNodes: nodes}, 0)
	ctx := context.Background()
	nodeOf := func(leases []*vmflowv1.Lease) []int {
		var out []int
		for _, l := range leases {
			for _, a := range store.PassthroughGPUs(l) {
				loc, ok := e.sim.Server.PCILocality(a)
				require.True(t, ok, a)
				out = append(out, loc.NUMANode)
			}
		}
		return out
	}
	e.record(t, "vm1", 2)
	got, err := e.whole.Claim(ctx, "vm1", "", 2)
	require.NoError(t, err)
	assert.Equal(t, []int{0, 0}, nodeOf(got), "node 0 has exactly two: packed there")
	e.record(t, "vm2", 2)
	got, err = e.whole.Claim(ctx, "vm2", "", 2)
	require.NoError(t, err)
	assert.Equal(t, []int{1, 1}, nodeOf(got))

	_, err = e.st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm3", Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none",
		GpuPassthroughCount: 2, Numa: "strict"}})
	require.NoError(t, err)
	_, err = e.whole.Claim(ctx, "vm3", "", 2)
	require.ErrorIs(t, err, lease.ErrNoWholeGPU)
	rec, err := e.st.Get("vm3")
	require.NoError(t, err)
	assert.Empty(t, store.HeldPassthrough(rec), "a refused claim holds nothing")
}

// TestPlacementRedoneWhenTheHostChanged: a VM placed when CPU 7 alone was
// kept for dedicated VMs is placed again at its next launch after the
// operator kept 6 and 7: its cpuset never holds a dedicated CPU. One
// whose place still holds keeps it.
func TestPlacementRedoneWhenTheHostChanged(t *testing.T) {
	h := twoNodes(t, func(c *lease.CapacityConfig) { c.DedicatedCPUs = []int{7} })
	h.withGPUs(t, "gpu", vm(1, 512), "0000:81:00.0")
	rec, err := h.place(t, "gpu")
	require.NoError(t, err)
	assert.Equal(t, "4-6", placed(t, rec).GetCpus())
	again, err := h.place(t, "gpu")
	require.NoError(t, err)
	assert.Equal(t, rec.GetUpdatedAt().AsTime(), again.GetUpdatedAt().AsTime(), "still fits: nothing written")

	h.restart(t, func(c *lease.CapacityConfig) { c.DedicatedCPUs = []int{6, 7} })
	rec, err = h.place(t, "gpu")
	require.NoError(t, err)
	assert.Equal(t, "4-5", placed(t, rec).GetCpus())
}

// TestVGPUClaimStaysOnOneNode: on four mdev parents over two NUMA nodes
// (parents 0 and 2 on node 0, 1 and 3 on node 1), a claim of two vGPUs
// puts the second on the first's node, not on the next least used parent
// (parent 1, node 1).
func TestVGPUClaimStaysOnOneNode(t *testing.T) {
	e := newClaims(t, vgpusim.Options{MdevParents: 4, NUMANodes: 2})
	ctx := context.Background()
	_, err := e.st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none",
		VgpuProfile: profile, VgpuCount: 2}})
	require.NoError(t, err)
	got, err := e.claims.Claim(ctx, "vm1", profile, 2)
	require.NoError(t, err)
	require.Len(t, got, 2)
	var nodes []int
	for _, l := range got {
		loc, ok := e.sim.Server.PCILocality(l.GetVgpu().GetParent())
		require.True(t, ok, l.GetVgpu().GetParent())
		nodes = append(nodes, loc.NUMANode)
	}
	assert.Equal(t, nodes[0], nodes[1], "both vGPUs on one node: %v", nodes)
	assert.NotEqual(t, got[0].GetVgpu().GetParent(), got[1].GetVgpu().GetParent(), "still spread over that node's GPUs")
}

// TestVendorVGPUClaimKnowsItsNode: on a vendor-VFIO host whose GPU sits
// on node 1, a strict claim of two vGPUs gets both (the placement reads
// where the GPU is, not node 0).
func TestVendorVGPUClaimKnowsItsNode(t *testing.T) {
	e := newClaims(t, vgpusim.Options{VendorVFs: 4, NUMANodes: 2, GPUNodes: map[string]int{vgpusim.VendorPF: 1}})
	ctx := context.Background()
	_, err := e.st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none",
		VgpuProfile: "NVIDIA L40-4Q", VgpuCount: 2, Numa: "strict"}})
	require.NoError(t, err)
	got, err := e.claims.Claim(ctx, "vm1", "NVIDIA L40-4Q", 2)
	require.NoError(t, err)
	assert.Len(t, got, 2)
}

// TestNUMASpreadOnlyWhatQEMUCanRun: a VM no node has room for is spread
// over several only when QEMU can run it so: a microvm (no guest NUMA) or
// RAM that is not whole hugepages on each node is refused instead of
// placed where every launch would fail.
func TestNUMASpreadOnlyWhatQEMUCanRun(t *testing.T) {
	h := twoNodes(t, nil)
	micro := vm(6, 1024)
	micro.Machine = "microvm"
	_, err := h.create("micro", micro)
	require.NoError(t, err)
	_, err = h.place(t, "micro")
	require.ErrorIs(t, err, lease.ErrNoHostCapacity)
	assert.Contains(t, err.Error(), "no guest NUMA")
}

// TestNUMAVGPUAfterARebootFindsItsParent: after a reboot a vGPU does not
// exist until its launch makes it again, after the capacity stage; its
// node is its parent GPU's, which the lease names.
func TestNUMAVGPUAfterARebootFindsItsParent(t *testing.T) {
	h := twoNodes(t, nil)
	s := vm(2, 512)
	s.VgpuProfile, s.Numa = "GRID A100-4C", "strict"
	_, err := h.create("vgpu", s)
	require.NoError(t, err)
	_, err = h.st.Apply(context.Background(), "vgpu", store.LeaseIntent(store.VGPULease(&vmflowv1.VgpuLease{
		Profile: "GRID A100-4C", Parent: "0000:82:00.0", Uuid: "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab"}), h.clock()))
	require.NoError(t, err)
	rec, err := h.place(t, "vgpu")
	require.NoError(t, err, "the mdev is gone; its parent says node 1")
	assert.Equal(t, []uint32{1}, placed(t, rec).GetNumaNodes())
}

// TestHugepagePoolsBySize: RAM held in 1G pages takes nothing of the 2M
// pool.
func TestHugepagePoolsBySize(t *testing.T) {
	h := twoNodes(t, func(c *lease.CapacityConfig) {
		c.Topology.Nodes[0].Hugepages = map[uint64]topology.HugepagePool{topology.PageSize1G: {Total: 4, Free: 4}}
	})
	big := vm(1, 4096)
	big.Hugepages = "1G"
	_, err := h.create("big", big)
	require.NoError(t, err)
	small := vm(1, 512)
	small.Hugepages = "2M"
	_, err = h.create("small", small)
	require.NoError(t, err, "the 2M pool is untouched")
	more := vm(1, 1024)
	more.Hugepages = "1G"
	_, err = h.create("more", more)
	require.ErrorIs(t, err, lease.ErrNoHostCapacity, "the 1G pool is")
}

// TestPlacementRedoneWhenNodesRenumber: after a reboot into another NUMA
// layout (node 1's CPUs are now node 0's), a share's CPUs must be on its
// memory's node, or it is placed again.
func TestPlacementRedoneWhenNodesRenumber(t *testing.T) {
	h := twoNodes(t, nil)
	h.withGPUs(t, "gpu", vm(1, 512), "0000:81:00.0")
	rec, err := h.place(t, "gpu")
	require.NoError(t, err)
	require.Equal(t, "4-7", placed(t, rec).GetCpus())
	h.restart(t, func(c *lease.CapacityConfig) {
		c.Topology.Nodes[0].CPUs, c.Topology.Nodes[1].CPUs = []int{4, 5, 6, 7}, []int{0, 1, 2, 3}
	})
	rec, err = h.place(t, "gpu")
	require.NoError(t, err)
	c := placed(t, rec)
	assert.Equal(t, []uint32{1}, c.GetNumaNodes())
	assert.Equal(t, "0-3", c.GetCpus(), "node 1's CPUs now")
}

// TestTwoGPUVMOnOneNodeEndToEnd: the simulator shows two NUMA nodes of two
// CPUs (node 1: CPUs 2-3, with GPUs 0000:81 and 0000:82; node 0 with
// 0000:83), CPU 3 kept for dedicated VMs. A VM asking two whole GPUs gets
// both from node 1; its launch places its CPUs and memory there; the QEMU
// spec assembled from its record binds its RAM to node 1 and its cgroup
// files confine it to node 1's shared CPU. A dedicated VM then gets CPU 3,
// which the first's cpuset does not hold.
func TestTwoGPUVMOnOneNodeEndToEnd(t *testing.T) {
	e, _ := newWholeOpts(t, vgpusim.Options{PCIGPUs: 3, NUMANodes: 2, NodeCPUs: 2,
		GPUNodes: map[string]int{"0000:81:00.0": 1, "0000:82:00.0": 1, "0000:83:00.0": 0}}, 0)
	ctx := context.Background()
	topo, err := topology.ReadWithProc(e.sim.Root, "/proc")
	require.NoError(t, err)
	require.Len(t, topo.Nodes, 2)
	capacity, err := lease.NewCapacity(lease.CapacityConfig{Store: e.st, CPUs: 4, MemoryMiB: 8192, CPUOvercommit: 4,
		Topology: topo, DedicatedCPUs: []int{3}, SysfsRoot: e.sim.Root})
	require.NoError(t, err)
	launch := func(id string, spec *vmflowv1.VMSpec) *vmflowv1.InstanceRecord {
		t.Helper()
		_, err := e.st.Create(ctx, &vmflowv1.InstanceRecord{Id: id, Spec: spec}, store.Reserving(capacity.Reserve(id, spec)))
		require.NoError(t, err)
		if spec.GetGpuPassthroughCount() > 0 {
			_, err = e.whole.Claim(ctx, id, "", int(spec.GetGpuPassthroughCount()))
			require.NoError(t, err)
		}
		l, err := e.st.Lock(ctx, id)
		require.NoError(t, err)
		defer l.Unlock()
		rec, err := capacity.Place(ctx, l)
		require.NoError(t, err)
		return rec
	}

	gpuVM := launch("gpu2", &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 512, Machine: "q35", Accel: "kvm", GpuPassthroughCount: 2})
	for _, l := range store.HeldPassthrough(gpuVM) {
		for _, a := range store.PassthroughGPUs(l) {
			loc, _ := e.sim.Server.PCILocality(a)
			assert.Equal(t, 1, loc.NUMANode, "GPU %s", a)
		}
	}
	spec := admission.ForRecord(gpuVM, nil)
	argv, err := vmm.Argv(spec, vmm.Paths{QMPSocket: "/run/q.sock", Log: "/run/q.log"})
	require.NoError(t, err)
	assert.Contains(t, strings.Join(argv, " "), "-object memory-backend-ram,id=vmflow-mem0,size=512M,host-nodes=1,policy=bind")
	cg := t.TempDir()
	for _, ctrl := range []string{"memory", "pids", "cpu", "cpuset"} {
		require.NoError(t, os.MkdirAll(filepath.Join(cg, ctrl), 0o755))
	}
	for f, v := range map[string]string{"cgroup.procs": "", "cpuset.cpus": "0-3", "cpuset.mems": "0-1"} {
		require.NoError(t, os.WriteFile(filepath.Join(cg, "cpuset", f), []byte(v), 0o644))
	}
	require.NoError(t, vmm.CgroupV1{Root: cg, Parent: "vmflow"}.Place(ctx, "gpu2", 4242, vmm.CgroupLimitsFor(spec)))
	readCg := func(f string) string {
		b, err := os.ReadFile(filepath.Join(cg, "cpuset", "vmflow", "vm-gpu2", f))
		require.NoError(t, err)
		return strings.TrimSpace(string(b))
	}
	assert.Equal(t, "2", readCg("cpuset.cpus"), "node 1's CPUs but the dedicated 3")
	assert.Equal(t, "1", readCg("cpuset.mems"))

	ded := launch("dedicated", &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 256, Machine: "q35", Accel: "kvm", DedicatedCpus: true})
	assert.Equal(t, "3", placed(t, ded).GetCpus())
}
