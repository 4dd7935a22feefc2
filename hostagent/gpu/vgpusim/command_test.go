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
	"vmflow/internal/service"
)

func TestVGPUSimUsage(t *testing.T) {
	var out bytes.Buffer
	assert.Equal(t, service.ExitUsage, vgpusim.Command(context.Background(), nil, &out))
	assert.Contains(t, out.String(), "usage: vmflow-vgpusim")
	assert.Equal(t, service.ExitUsage, vgpusim.Command(context.Background(), []string{"--bogus"}, &out))
	assert.Equal(t, service.ExitOK, vgpusim.Command(context.Background(), []string{"-h"}, &out))
}

func TestVGPUSimMountError(t *testing.T) {
	var out bytes.Buffer
	code := vgpusim.Command(context.Background(), []string{"--mount", filepath.Join(t.TempDir(), "missing"), "--mdev-parents", "1"}, &out)
	assert.Equal(t, service.ExitError, code, out.String())
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
		done <- vgpusim.Command(ctx, []string{"--mount", mnt, "--control", ctl, "--mdev-parents", "1", "--vendor-vfs", "1", "--pci-gpus", "1", "--dev-root", dev}, &out)
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
