package topology_test

import (
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/topology"
)

// tree writes files (path relative to root -> content) and symlinks
// (content "->target") under a fresh root.
func tree(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for p, content := range files {
		full := filepath.Join(root, p)
		require.NoError(t, os.MkdirAll(filepath.Dir(full), 0o755))
		if target, ok := strings.CutPrefix(content, "->"); ok {
			require.NoError(t, os.Symlink(target, full))
			continue
		}
		require.NoError(t, os.WriteFile(full, []byte(content), 0o644))
	}
	return root
}

const node = "devices/system/node/"

// twoNodes is a two-socket host: node 0 with CPUs 0-3,8-11, 64 GiB and
// both pools, node 1 with 4-7,12-15, 32 GiB and 2M pages only.
func twoNodes() map[string]string {
	return map[string]string{
		node + "online":        "0-1\n",
		node + "possible":      "0-1\n",
		node + "has_cpu":       "0-1\n",
		node + "node0/cpulist": "0-3,8-11\n",
		node + "node0/meminfo": "Node 0 MemTotal:       67108864 kB\nNode 0 MemFree:        60000000 kB\nNode 0 MemUsed:         7108864 kB\n" +
			"Node 0 HugePages_Total:   512\nNode 0 HugePages_Free:    500\n",
		node + "node0/hugepages/hugepages-2048kB/nr_hugepages":      "512\n",
		node + "node0/hugepages/hugepages-2048kB/free_hugepages":    "500\n",
		node + "node0/hugepages/hugepages-2048kB/surplus_hugepages": "0\n",
		node + "node0/hugepages/hugepages-1048576kB/nr_hugepages":   "4\n",
		node + "node0/hugepages/hugepages-1048576kB/free_hugepages": "4\n",
		node + "node1/cpulist":                                   "4-7,12-15\n",
		node + "node1/meminfo":                                   "Node 1 MemTotal:       33554432 kB\nNode 1 MemFree:        30000000 kB\n",
		node + "node1/hugepages/hugepages-2048kB/nr_hugepages":   "0\n",
		node + "node1/hugepages/hugepages-2048kB/free_hugepages": "0\n",
	}
}

func TestReadTwoNodes(t *testing.T) {
	topo, err := topology.ReadWithProc(tree(t, twoNodes()), t.TempDir())
	require.NoError(t, err)
	require.True(t, topo.NUMA)
	require.Len(t, topo.Nodes, 2)
	n0, n1 := topo.Nodes[0], topo.Nodes[1]
	assert.Equal(t, 0, n0.ID)
	assert.Equal(t, []int{0, 1, 2, 3, 8, 9, 10, 11}, n0.CPUs)
	assert.Equal(t, uint64(64<<30), n0.MemoryBytes)
	assert.Equal(t, uint64(60000000)<<10, n0.FreeBytes)
	assert.Equal(t, map[uint64]topology.HugepagePool{
		topology.PageSize2M: {Total: 512, Free: 500},
		topology.PageSize1G: {Total: 4, Free: 4},
	}, n0.Hugepages)
	assert.Equal(t, 1, n1.ID)
	assert.Equal(t, uint64(32<<30), n1.MemoryBytes)
	assert.Equal(t, map[uint64]topology.HugepagePool{topology.PageSize2M: {}}, n1.Hugepages)
	assert.Equal(t, 16, topo.CPUCount())

	for cpu, want := range map[int]int{0: 0, 3: 0, 4: 1, 11: 0, 15: 1} {
		got, ok := topo.NodeOfCPU(cpu)
		assert.True(t, ok, "cpu %d", cpu)
		assert.Equal(t, want, got, "cpu %d", cpu)
	}
	_, ok := topo.NodeOfCPU(16)
	assert.False(t, ok, "no CPU 16")

	n, ok := topo.DeviceNode(1)
	assert.True(t, ok)
	assert.Equal(t, 1, n)
	_, ok = topo.DeviceNode(topology.NoNode)
	assert.False(t, ok, "with two nodes, a device the platform placed on none is near neither")
	_, ok = topo.DeviceNode(2)
	assert.False(t, ok, "a node the topology lacks")
}

// Nodes are ordered by number, node10 after node2, whatever the folder's
// order; a node of memory alone has no CPUs.
func TestReadOrdersNodesAndTakesMemoryOnlyNodes(t *testing.T) {
	files := map[string]string{}
	for _, id := range []int{10, 2, 0} {
		n := strconv.Itoa(id)
		cpus := n
		if id == 10 {
			cpus = ""
		}
		files[node+"node"+n+"/cpulist"] = cpus + "\n"
		files[node+"node"+n+"/meminfo"] = "Node " + n + " MemTotal: 1024 kB\nNode " + n + " MemFree: 512 kB\n"
	}
	topo, err := topology.ReadWithProc(tree(t, files), t.TempDir())
	require.NoError(t, err)
	var ids []int
	for _, n := range topo.Nodes {
		ids = append(ids, n.ID)
		assert.Empty(t, n.Hugepages, "no hugepages folder: no pools")
	}
	assert.Equal(t, []int{0, 2, 10}, ids)
	assert.Empty(t, topo.Nodes[2].CPUs)
	assert.Equal(t, uint64(1<<20), topo.Nodes[2].MemoryBytes)
}

// A kernel without NUMA: one node 0 of every online CPU, the memory of
// /proc/meminfo and the machine's pools.
func TestReadWithoutNUMA(t *testing.T) {
	sys := tree(t, map[string]string{
		"devices/system/cpu/online":                           "0-5\n",
		"kernel/mm/hugepages/hugepages-2048kB/nr_hugepages":   "16\n",
		"kernel/mm/hugepages/hugepages-2048kB/free_hugepages": "10\n",
	})
	proc := tree(t, map[string]string{"meminfo": "MemTotal:        8000000 kB\nMemFree:         4000000 kB\nMemAvailable:    6000000 kB\n"})
	topo, err := topology.ReadWithProc(sys, proc)
	require.NoError(t, err)
	assert.False(t, topo.NUMA)
	require.Len(t, topo.Nodes, 1)
	assert.Equal(t, topology.Node{ID: 0, CPUs: []int{0, 1, 2, 3, 4, 5}, MemoryBytes: 8000000 << 10, FreeBytes: 4000000 << 10,
		Hugepages: map[uint64]topology.HugepagePool{topology.PageSize2M: {Total: 16, Free: 10}}}, topo.Nodes[0])
	n, ok := topo.DeviceNode(topology.NoNode)
	assert.True(t, ok, "one node: a device placed on none is on it")
	assert.Equal(t, 0, n)
}

// Broken trees are errors wrapping ErrMalformed (or the read's own),
// never a panic or a huge read.
func TestReadRefusesBrokenTrees(t *testing.T) {
	for name, change := range map[string]func(map[string]string){
		"cpulist garbage":      func(f map[string]string) { f[node+"node1/cpulist"] = "4-x\n" },
		"meminfo without free": func(f map[string]string) { f[node+"node1/meminfo"] = "Node 1 MemTotal: 1 kB\n" },
		"meminfo of another node": func(f map[string]string) {
			f[node+"node1/meminfo"] = "Node 0 MemTotal: 1 kB\nNode 0 MemFree: 1 kB\n"
		},
		"meminfo unit":        func(f map[string]string) { f[node+"node1/meminfo"] = "Node 1 MemTotal: 1 MB\nNode 1 MemFree: 1 kB\n" },
		"meminfo too large":   func(f map[string]string) { f[node+"node1/meminfo"] = strings.Repeat("x", 1<<20) },
		"node number too big": func(f map[string]string) { f[node+"node99999/cpulist"] = "" },
		"hugepage size":       func(f map[string]string) { f[node+"node0/hugepages/hugepages-2MB/nr_hugepages"] = "1\n" },
		"hugepage count":      func(f map[string]string) { f[node+"node0/hugepages/hugepages-2048kB/nr_hugepages"] = "-1\n" },
		"cpulist a symlink":   func(f map[string]string) { f[node+"node1/cpulist"] = "->../node0/cpulist" },
	} {
		t.Run(name, func(t *testing.T) {
			files := twoNodes()
			change(files)
			_, err := topology.ReadWithProc(tree(t, files), t.TempDir())
			assert.ErrorIs(t, err, topology.ErrMalformed)
		})
	}
	t.Run("no node folder", func(t *testing.T) {
		_, err := topology.ReadWithProc(tree(t, map[string]string{node + "online": "0\n"}), t.TempDir())
		assert.ErrorIs(t, err, topology.ErrMalformed)
	})
	t.Run("no NUMA and no cpu/online", func(t *testing.T) {
		_, err := topology.ReadWithProc(t.TempDir(), t.TempDir())
		assert.ErrorIs(t, err, os.ErrNotExist)
	})
	t.Run("too many entries", func(t *testing.T) {
		root := tree(t, twoNodes())
		for i := range 4100 {
			require.NoError(t, os.WriteFile(filepath.Join(root, node, "x"+strconv.Itoa(i)), nil, 0o644))
		}
		_, err := topology.ReadWithProc(root, t.TempDir())
		assert.ErrorIs(t, err, topology.ErrMalformed)
	})
}

// This machine: its nodes hold every CPU the process may run on and,
// with one node, all of /proc/meminfo's memory.
func TestReadThisMachine(t *testing.T) {
	topo, err := topology.Read("/sys")
	require.NoError(t, err)
	require.NotEmpty(t, topo.Nodes)
	assert.Equal(t, runtime.NumCPU(), topo.CPUCount(), "every CPU of the machine on a node (fails if the test runs with a narrowed affinity)")
	for cpu := range runtime.NumCPU() {
		_, ok := topo.NodeOfCPU(cpu)
		assert.True(t, ok, "cpu %d on a node", cpu)
	}
	b, err := os.ReadFile("/proc/meminfo")
	require.NoError(t, err)
	var totalKB uint64
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			totalKB, err = strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			require.NoError(t, err)
		}
	}
	require.NotZero(t, totalKB)
	var sum uint64
	for _, n := range topo.Nodes {
		sum += n.MemoryBytes
		assert.LessOrEqual(t, n.FreeBytes, n.MemoryBytes)
	}
	if len(topo.Nodes) == 1 {
		assert.Equal(t, totalKB<<10, sum, "one node holds all the memory")
	} else {
		assert.InDelta(t, float64(totalKB<<10), float64(sum), float64(totalKB<<10)/20, "the nodes hold the memory")
	}
}
