package vmm

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func placedSpec(vcpus, mib int, m Machine, p Placement) VMSpec {
	return VMSpec{Name: "vm1", VCPUs: vcpus, MemoryMiB: mib, Machine: m, Accel: AccelKVM, Placement: p}
}

// TestPlacementArgv: guest RAM bound to its host node (one backend, the
// machine's), split over several with a guest NUMA node each, hugepages
// from a memfd; nothing without a placement.
func TestPlacementArgv(t *testing.T) {
	for _, c := range []struct {
		name string
		p    Placement
		m    Machine
		want string
	}{
		{"none", Placement{}, MachineQ35, ""},
		{"cpus only", Placement{CPUs: "2-3"}, MachineQ35, ""},
		{"one node", Placement{CPUs: "4-7", Nodes: []int{1}}, MachineQ35,
			"-object memory-backend-ram,id=vmflow-mem0,size=1024M,host-nodes=1,policy=bind -machine memory-backend=vmflow-mem0"},
		{"one node, machine none", Placement{Nodes: []int{0}}, MachineNone,
			"-object memory-backend-ram,id=vmflow-mem0,size=1024M,host-nodes=0,policy=bind -machine memory-backend=vmflow-mem0"},
		{"two nodes", Placement{Nodes: []int{0, 1}}, MachineQ35,
			"-object memory-backend-ram,id=vmflow-mem0,size=512M,host-nodes=0,policy=bind -numa node,nodeid=0,cpus=0-1,memdev=vmflow-mem0 " +
				"-object memory-backend-ram,id=vmflow-mem1,size=512M,host-nodes=1,policy=bind -numa node,nodeid=1,cpus=2-2,memdev=vmflow-mem1"},
		{"hugepages on a node", Placement{Nodes: []int{1}, HugepageKiB: 2048}, MachineQ35,
			"-object memory-backend-memfd,id=vmflow-mem0,size=1024M,hugetlb=on,hugetlbsize=2048K,prealloc=on,host-nodes=1,policy=bind -machine memory-backend=vmflow-mem0"},
		{"hugepages anywhere", Placement{HugepageKiB: 1 << 20}, MachineQ35,
			"-object memory-backend-memfd,id=vmflow-mem0,size=1024M,hugetlb=on,hugetlbsize=1048576K,prealloc=on -machine memory-backend=vmflow-mem0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			vcpus := 3
			if c.m == MachineNone {
				vcpus = 1
			}
			a, err := Argv(placedSpec(vcpus, 1024, c.m, c.p), Paths{QMPSocket: "/run/q.sock", Log: "/run/q.log"})
			require.NoError(t, err)
			joined := strings.Join(a, " ")
			assert.Contains(t, joined, fmt.Sprintf("-m 1024 -smp %d", vcpus), "-m stays: the backends add up to it")
			if c.want == "" {
				assert.NotContains(t, joined, "memory-backend")
				assert.NotContains(t, joined, "-numa")
				return
			}
			assert.Contains(t, joined, c.want)
		})
	}
}

func TestPlacementRefusedWhereQEMUWouldFail(t *testing.T) {
	for _, c := range []struct {
		name string
		spec VMSpec
		want string
	}{
		{"guest NUMA on machine none", placedSpec(1, 64, MachineNone, Placement{Nodes: []int{0, 1}}), "no guest NUMA"},
		{"more nodes than vCPUs", placedSpec(1, 64, MachineQ35, Placement{Nodes: []int{0, 1}}), "do not split"},
		{"memory not whole hugepages", placedSpec(1, 1023, MachineQ35, Placement{HugepageKiB: 2048}), "hugepages"},
		{"a node's half not whole hugepages", placedSpec(2, 1026, MachineQ35, Placement{Nodes: []int{0, 1}, HugepageKiB: 2048}), "hugepages"},
		{"odd hugepage size", placedSpec(1, 1024, MachineQ35, Placement{HugepageKiB: 4}), "hugepage size"},
		{"cpus not a list", placedSpec(1, 64, MachineQ35, Placement{CPUs: "0-3;reboot"}), "CPU list"},
		{"negative node", placedSpec(1, 64, MachineQ35, Placement{Nodes: []int{-1}}), "node -1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Argv(c.spec, Paths{QMPSocket: "/run/q.sock", Log: "/run/q.log"})
			require.ErrorIs(t, err, ErrInvalidSpec)
			assert.Contains(t, err.Error(), c.want)
		})
	}
}

// TestCgroupV1CPUSet: on v1 every folder MkdirAll made above the VM's
// cpuset gets its parent's CPUs and mems (a v1 cpuset starts empty and
// takes no task), the VM's own gets its placement's, and QEMU goes in.
// A host without the cpuset hierarchy refuses a placed VM.
func TestCgroupV1CPUSet(t *testing.T) {
	root := t.TempDir()
	cs := filepath.Join(root, "cpuset")
	require.NoError(t, os.MkdirAll(cs, 0o755))
	for f, v := range map[string]string{"cgroup.procs": "", "cpuset.cpus": "0-7\n", "cpuset.mems": "0-1\n"} {
		require.NoError(t, os.WriteFile(filepath.Join(cs, f), []byte(v), 0o644))
	}
	// A fake hierarchy: new folders are plain, so give each its empty
	// cpuset files as the kernel would.
	for _, d := range []string{"agent", "agent/vmflow", "agent/vmflow/vm-vm1"} {
		require.NoError(t, os.MkdirAll(filepath.Join(cs, d), 0o755))
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			require.NoError(t, os.WriteFile(filepath.Join(cs, d, f), nil, 0o644))
		}
	}
	for _, ctrl := range cgroupV1Controllers {
		require.NoError(t, os.MkdirAll(filepath.Join(root, ctrl), 0o755))
	}
	c := CgroupV1{Root: root, Parent: "agent/vmflow"}
	l := CgroupLimits{MemoryBytes: 1 << 30, Pids: 64, CPUWeight: 100, CPUs: "4-5", Mems: "1"}
	require.NoError(t, c.Place(ctxT(t, 5*time.Second), "vm1", 4242, l))
	for _, d := range []string{"agent", "agent/vmflow"} {
		assert.Equal(t, "0-7", readTrim(t, filepath.Join(cs, d), "cpuset.cpus"), d)
		assert.Equal(t, "0-1", readTrim(t, filepath.Join(cs, d), "cpuset.mems"), d)
	}
	vm := c.dir(cgroupV1CPUSet, "vm1")
	assert.Equal(t, "4-5", readTrim(t, vm, "cpuset.cpus"))
	assert.Equal(t, "1", readTrim(t, vm, "cpuset.mems"))
	assert.Equal(t, "4242", readTrim(t, vm, "cgroup.procs"))

	require.NoError(t, os.Remove(filepath.Join(cs, "cgroup.procs")))
	err := c.Place(ctxT(t, 5*time.Second), "vm2", 4243, l)
	require.ErrorIs(t, err, ErrNoCgroups, "no cpuset hierarchy: refused, never run unconfined")
}

// TestCgroupV2CPUSet: cpuset enabled from the root down, then the VM's
// CPUs and mems.
func TestCgroupV2CPUSet(t *testing.T) {
	root := t.TempDir()
	c := CgroupV2{Root: root, Parent: "vmflow"}
	require.NoError(t, c.Place(ctxT(t, 5*time.Second), "vm1", 4242, CgroupLimits{MemoryBytes: 1, Pids: 1, CPUWeight: 1, CPUs: "0-1", Mems: "0"}))
	assert.Equal(t, "+cpuset", readTrim(t, root, "cgroup.subtree_control"))
	assert.Equal(t, "+cpuset", readTrim(t, filepath.Join(root, "vmflow"), "cgroup.subtree_control"), "its parent's too (the last write there)")
	assert.Equal(t, "0-1", readTrim(t, c.dir("vm1"), "cpuset.cpus"))
	assert.Equal(t, "0", readTrim(t, c.dir("vm1"), "cpuset.mems"))
}

// TestSystemdScopeCPUSet: AllowedCPUs and AllowedMemoryNodes as systemd
// takes them, a bit per CPU.
func TestSystemdScopeCPUSet(t *testing.T) {
	f := &fakeSystemd{result: "done"}
	s := SystemdScope{Conn: f, Slice: "machine.slice"}
	l := CgroupLimitsFor(placedSpec(2, 512, MachineQ35, Placement{CPUs: "0-3,9", Nodes: []int{1}}))
	require.NoError(t, s.Place(ctxT(t, 5*time.Second), "vm1", 4242, l))
	got := map[string]dbus.Variant{}
	for _, p := range f.started {
		got[p.Name] = p.Value
	}
	assert.Equal(t, []byte{0x0f, 0x02}, got["AllowedCPUs"].Value())
	assert.Equal(t, []byte{0x02}, got["AllowedMemoryNodes"].Value())
}

// TestLaunchConfinedToItsCPUs: a real QEMU placed on one CPU runs every
// one of its threads there (Cpus_allowed_list of each task), through its
// v1 or v2 cgroup; its memory is bound to node 0, the one node here.
func TestLaunchConfinedToItsCPUs(t *testing.T) {
	requiresQEMU(t)
	cg := v1OrSkip(t)
	if _, ok := cg.(CgroupV1); ok {
		if _, err := os.Stat("/sys/fs/cgroup/cpuset/cgroup.procs"); err != nil {
			t.Skip("no v1 cpuset hierarchy")
		}
	}
	cpu := "0"
	if b, err := os.ReadFile("/sys/devices/system/cpu/online"); err == nil && strings.TrimSpace(string(b)) != "0" {
		cpu = "1" // not the first: a default would not say 1
	}
	cfg := testLaunchConfig(t, "pinned")
	cfg.Confine.Cgroups = cg
	cfg.Spec.Placement = Placement{CPUs: cpu, Nodes: []int{0}}
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)
	t.Cleanup(func() { _ = cg.Remove(ctxT(t, 5*time.Second), CgroupName(cfg.Spec.Name, cfg.Confine.UID)) })
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", vm.Identity().PID))
	require.NoError(t, err)
	require.NotEmpty(t, tasks)
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", vm.Identity().PID, task.Name()))
		require.NoError(t, err)
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && k == "Cpus_allowed_list" {
				assert.Equal(t, cpu, strings.TrimSpace(v), "thread %s", task.Name())
			}
		}
	}
	assertRunsThenStops(t, vm)
}
