package vmm_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
)

// baseImage writes a raw image of n bytes of pattern b, world-readable.
func baseImage(t *testing.T, dir string, n int, b byte) string {
	t.Helper()
	p := filepath.Join(dir, "base.raw")
	require.NoError(t, os.WriteFile(p, bytes.Repeat([]byte{b}, n), 0o644))
	return p
}

func hmp(t *testing.T, ctx context.Context, mon *vmm.Monitor, line string) string {
	t.Helper()
	var out string
	require.NoError(t, mon.Execute(ctx, "human-monitor-command", map[string]string{"command-line": line}, &out))
	return out
}

// TestLaunchDiskBaseReadOnly: a QEMU given a disk holds its base image only
// read-only, so neither the guest nor QEMU itself (a hostile QMP client, a
// compromised QEMU) can write an image other VMs boot from: the guest's
// writes land in the instance's overlay, asking QEMU to reopen the base
// read-write fails, and the base's bytes and mtime are unchanged. QEMU's argv
// names no image path. Fails if the disk is "-drive file=<path>" read-write
// with no overlay: the same device write would change the base itself.
func TestLaunchDiskBaseReadOnly(t *testing.T) {
	vmmtest.RequiresQEMU(t)
	vmmtest.RequiresQEMUImg(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	run := proctest.ShortDir(t, "vmrun")
	dir := proctest.ShortDir(t, "vmimg") // the images, apart from the socket
	const size = 4 << 20
	basePath := baseImage(t, dir, size, 0x5a)
	before, err := os.Stat(basePath)
	require.NoError(t, err)

	base, err := os.Open(basePath)
	require.NoError(t, err)
	ovPath := filepath.Join(dir, "disk.qcow2")
	ov, created, err := vmm.OpenOverlay(ctx, vmm.OverlayConfig{
		Path: ovPath, Temp: filepath.Join(dir, ".tmp-disk.qcow2"), Base: base, BackingName: basePath})
	require.NoError(t, err)
	assert.True(t, created)
	ovBefore, err := os.Stat(ovPath)
	require.NoError(t, err)

	cfg := vmm.LaunchConfig{
		Spec: vmm.VMSpec{Name: "disk", VCPUs: 1, MemoryMiB: 64, Machine: vmm.MachineQ35, Accel: vmmtest.Accel(),
			Disk: &vmm.Disk{Base: base, Overlay: ov}},
		Paths: vmm.Paths{QMPSocket: filepath.Join(run, "qemu.sock"), PIDFile: filepath.Join(run, "qemu.pid"),
			Log: filepath.Join(run, "qemu.log")},
		ReadyTimeout: 20 * time.Second,
		Confine:      vmmtest.Confine(),
	}
	vm, err := vmm.Launch(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		_, _ = vm.Stop(sctx, vmm.StopConfig{From: vmm.StepKillSent, KillTimeout: 5 * time.Second})
		vm.Close()
	})
	_, err = base.Stat()
	assert.ErrorIs(t, err, os.ErrClosed, "Launch closes the agent's copies after the fork")
	pid := vm.Identity().PID

	assert.NotContains(t, vmmtest.Cmdline(t, pid), dir, "QEMU's argv names no image path")
	var baseFDs, ovFDs int
	for _, f := range vmmtest.OpenFiles(t, pid) {
		switch f.Target {
		case basePath:
			baseFDs++
			assert.Equal(t, os.O_RDONLY, f.Flags&0o3, "fd %d on the base is not read-only (flags %o)", f.FD, f.Flags)
		case ovPath:
			ovFDs++
		}
	}
	assert.Positive(t, baseFDs, "QEMU holds the base")
	assert.Positive(t, ovFDs, "QEMU holds the overlay")

	mon, err := vm.Monitor(ctx)
	require.NoError(t, err)
	// What the guest would do: write through the device.
	out := hmp(t, ctx, mon, `qemu-io -d /machine/peripheral/`+vmm.DiskDeviceID+`/virtio-backend "write -P 0xab 0 65536"`)
	assert.Empty(t, strings.TrimSpace(out), "the device is writable (through its overlay)")
	out = hmp(t, ctx, mon, `qemu-io -d /machine/peripheral/`+vmm.DiskDeviceID+`/virtio-backend "read -P 0xab 0 65536"`)
	assert.NotContains(t, out, "Pattern verification failed", "the guest reads back what it wrote")
	// What a hostile QMP client or a compromised QEMU would do: reopen the
	// base's file node read-write. QEMU has no writable fd for it.
	var nodes []struct {
		NodeName string `json:"node-name"`
		File     string `json:"file"`
		RO       bool   `json:"ro"`
	}
	require.NoError(t, mon.Execute(ctx, "query-named-block-nodes", nil, &nodes))
	baseFile := ""
	for _, n := range nodes {
		if n.NodeName == "base-file" {
			baseFile = n.File
			assert.True(t, n.RO, "base-file is read-only")
		}
	}
	require.True(t, strings.HasPrefix(baseFile, "/dev/fdset/"), "base-file is %q", baseFile)
	err = mon.Execute(ctx, "blockdev-reopen", map[string]any{"options": []map[string]any{{
		"driver": "file", "node-name": "base-file", "filename": baseFile, "read-only": false}}}, nil)
	require.Error(t, err, "reopening the base read-write must fail")
	t.Logf("reopen base read-write: %v", err)

	_, err = vm.Stop(ctx, vmm.StopConfig{SkipPowerdown: true, KillTimeout: 5 * time.Second})
	require.NoError(t, err)

	after, err := os.Stat(basePath)
	require.NoError(t, err)
	assert.Equal(t, before.ModTime(), after.ModTime(), "the base's mtime is unchanged")
	got, err := os.ReadFile(basePath)
	require.NoError(t, err)
	assert.Equal(t, bytes.Repeat([]byte{0x5a}, size), got, "the base's bytes are unchanged")
	ovAfter, err := os.Stat(ovPath)
	require.NoError(t, err)
	assert.Greater(t, ovAfter.Size(), ovBefore.Size(), "the guest's write went to the overlay")
}

// TestOpenOverlayKeepsExisting: a second OpenOverlay opens the same file
// (the guest's writes survive a restart) and creates nothing.
func TestOpenOverlayKeepsExisting(t *testing.T) {
	vmmtest.RequiresQEMUImg(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	basePath := baseImage(t, dir, 1<<20, 0)
	base, err := os.Open(basePath)
	require.NoError(t, err)
	defer base.Close()
	cfg := vmm.OverlayConfig{Path: filepath.Join(dir, "disk.qcow2"), Temp: filepath.Join(dir, ".tmp-disk.qcow2"),
		Base: base, BackingName: basePath}
	// A torn leftover of a crashed create is never used.
	require.NoError(t, os.WriteFile(cfg.Temp, []byte("torn"), 0o600))
	first, created, err := vmm.OpenOverlay(ctx, cfg)
	require.NoError(t, err)
	defer first.Close()
	assert.True(t, created)
	assert.NoFileExists(t, cfg.Temp)
	second, created, err := vmm.OpenOverlay(ctx, cfg)
	require.NoError(t, err)
	defer second.Close()
	assert.False(t, created)
	a, err := first.Stat()
	require.NoError(t, err)
	b, err := second.Stat()
	require.NoError(t, err)
	assert.True(t, os.SameFile(a, b))
	head := make([]byte, 4)
	_, err = second.ReadAt(head, 0)
	require.NoError(t, err)
	assert.Equal(t, "QFI\xfb", string(head), "a qcow2 image")

	// A symlink in the overlay's place is not followed.
	require.NoError(t, os.Remove(cfg.Path))
	require.NoError(t, os.Symlink(basePath, cfg.Path))
	_, _, err = vmm.OpenOverlay(ctx, cfg)
	assert.ErrorIs(t, err, vmm.ErrOverlay)
}
