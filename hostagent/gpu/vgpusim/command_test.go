package vgpusim_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/topology"
	"vmflow/internal/service"
)

func TestVGPUSimUsage(t *testing.T) {
	var out bytes.Buffer
	assert.Equal(t, service.ExitUsage, vgpusim.Command(context.Background(), nil, &out))
	assert.Contains(t, out.String(), "usage: vmflow-vgpusim")
	assert.Equal(t, service.ExitUsage, vgpusim.Command(context.Background(), []string{"--bogus"}, &out))
	assert.Equal(t, service.ExitOK, vgpusim.Command(context.Background(), []string{"-h"}, &out))
	assert.Contains(t, out.String(), "--numa-nodes")
	for _, bad := range [][]string{{"--node-hugepages-2m", "x"}, {"--node-hugepages-1g", "1/y"}, {"--gpu-nodes", "0000:81:00.0"}, {"--gpu-nodes", "0000:81:00.0=one"}} {
		assert.Equal(t, service.ExitUsage, vgpusim.Command(context.Background(), append([]string{"--mount", t.TempDir()}, bad...), &out), "%q", bad)
	}
}

func TestVGPUSimMountError(t *testing.T) {
	var out bytes.Buffer
	code := vgpusim.Command(context.Background(), []string{"--mount", filepath.Join(t.TempDir(), "missing"), "--mdev-parents", "1"}, &out)
	assert.Equal(t, service.ExitError, code, out.String())
	code = vgpusim.Command(context.Background(), []string{"--mount", t.TempDir(), "--numa-nodes", "9"}, &out)
	assert.Equal(t, service.ExitError, code, "checked at the mount")
	assert.Contains(t, out.String(), "NUMA nodes 9 out of range")
}

// The command serves until its context ends (SIGINT/SIGTERM in main), a
// shell can drive it meanwhile, and it unmounts on the way out.
func TestVGPUSimServesUntilCancelled(t *testing.T) {
	proctest.RequiresFUSE(t)
	dir := t.TempDir()
	mnt, ctl, dev := filepath.Join(dir, "sys"), filepath.Join(dir, "ctl"), filepath.Join(dir, "dev")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	require.NoError(t, os.Mkdir(ctl, 0o755))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out vgpuSimOutput
	done := make(chan int, 1)
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		done <- vgpusim.Command(ctx, []string{"--mount", mnt, "--control", ctl, "--mdev-parents", "1", "--vendor-vfs", "1", "--pci-gpus", "1", "--dev-root", dev,
			"--numa-nodes", "2", "--node-cpus", "3", "--node-memory-mib", "2048", "--node-hugepages-2m", "8/4", "--node-hugepages-1g", "1",
			"--gpu-nodes", vgpusim.PCIGPUAt(0).GPU + "=1"}, &out)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-exited: // unmounted, also when the test failed early
		case <-time.After(10 * time.Second):
			t.Error("vmflow-vgpusim still running at cleanup")
		}
	})
	create := filepath.Join(mnt, "class/mdev_bus", vgpusim.MdevParent(0), "mdev_supported_types/nvidia-471/create")
	require.Eventually(t, func() bool { _, err := os.Stat(create); return err == nil }, 5*time.Second, time.Millisecond, "mounted")

	// The NUMA flags.
	topo, err := topology.ReadWithProc(mnt, t.TempDir())
	require.NoError(t, err)
	require.Len(t, topo.Nodes, 2)
	assert.Equal(t, []int{3, 4, 5}, topo.Nodes[1].CPUs)
	assert.Equal(t, uint64(2048)<<20, topo.Nodes[1].MemoryBytes)
	assert.Equal(t, map[uint64]topology.HugepagePool{topology.PageSize2M: {Total: 8, Free: 4}, topology.PageSize1G: {Total: 1, Free: 1}}, topo.Nodes[1].Hugepages)
	for addr, node := range map[string]int{vgpusim.PCIGPUAt(0).GPU: 1, vgpusim.MdevParent(0): 0, vgpusim.VendorVF(0): 0} {
		l, err := topology.ReadPCILocality(mnt, addr)
		require.NoError(t, err)
		assert.Equal(t, node, l.NUMANode, addr)
	}

	u := uuid.NewString()
	b, err := exec.Command("sh", "-c", "echo "+u+" > "+create).CombinedOutput()
	require.NoError(t, err, string(b))
	assert.DirExists(t, filepath.Join(mnt, "bus/mdev/devices", u))

	// The README's passthrough recipe.
	gpu := vgpusim.PCIGPUAt(0)
	fn := filepath.Join(mnt, "bus/pci/devices", gpu.GPU)
	b, err = exec.Command("sh", "-ec", "echo vfio-pci > "+fn+"/driver_override; echo "+gpu.GPU+" > "+mnt+"/bus/pci/drivers/nvidia/unbind; echo "+gpu.GPU+" > "+mnt+"/bus/pci/drivers_probe; readlink "+fn+"/driver").CombinedOutput()
	require.NoError(t, err, string(b))
	assert.Equal(t, "vfio-pci", filepath.Base(strings.TrimSpace(string(b))))
	assert.FileExists(t, filepath.Join(dev, "vfio", gpu.Group))

	cancel()
	select {
	case code := <-done:
		assert.Equal(t, service.ExitOK, code, out.String())
	case <-time.After(10 * time.Second):
		t.Fatal("vmflow-vgpusim did not return after cancel")
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	assert.False(t, strings.Contains(string(mounts), " "+mnt+" "), "still mounted")
	assert.Contains(t, out.String(), "unmounted")
}

// vgpuSimOutput is a bytes.Buffer safe for the command's goroutine and the test.
type vgpuSimOutput struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (o *vgpuSimOutput) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.Write(p)
}

func (o *vgpuSimOutput) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}
