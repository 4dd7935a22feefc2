package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

func runDevices(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := cli.Devices(context.Background(), args, cli.IO{Stdout: &stdout, Stderr: &stderr})
	return code, stdout.String(), stderr.String()
}

// TestDevicesListsAndClears: every GPU device with its state (claimed by
// its instance, free, quarantined with the reason, not vmflow's), and
// devices clear puts a quarantined one back, refusing without a reason and
// logging the clear.
func TestDevicesListsAndClears(t *testing.T) {
	sim := simtest.Start(t, vgpusim.Options{PCIGPUs: 4, MdevParents: 1})
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	ctx := context.Background()
	f, err := gpu.ParseGPUFilter("all")
	require.NoError(t, err)
	w, err := lease.NewWhole(lease.WholeConfig{Driver: gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot: sim.Root, StateDir: dir, DevRoot: sim.DevRoot, Filter: f}), Store: st})
	require.NoError(t, err)
	_, err = st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", GpuPassthroughCount: 1}})
	require.NoError(t, err)
	_, err = w.Claim(ctx, "vm1", "", 1)
	require.NoError(t, err)
	g := func(i int) string { return vgpusim.PCIGPUAt(i).GPU }
	_, err = lease.NewQuarantine(dir, 1, nil).Strike(ctx, "vm0", "reset: EIO", g(2))
	require.NoError(t, err)

	list := func() map[string]lease.DeviceRow {
		code, out, stderr := runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root, "--gpu-passthrough", "all", "-o", "json")
		require.Equal(t, cli.ExitOK, code, stderr)
		var rows []lease.DeviceRow
		require.NoError(t, json.Unmarshal([]byte(out), &rows))
		m := map[string]lease.DeviceRow{}
		for _, r := range rows {
			m[r.ID] = r
		}
		return m
	}
	rows := list()
	assert.Equal(t, lease.DeviceClaimed, rows[g(0)].State)
	assert.Equal(t, "vm1", rows[g(0)].Instance)
	assert.Equal(t, lease.DeviceFree, rows[g(1)].State)
	assert.Equal(t, lease.DeviceQuarantined, rows[g(2)].State)
	assert.Contains(t, rows[g(2)].Why, "reset: EIO")
	assert.Equal(t, lease.DeviceNotOurs, rows[g(3)].State, "its group holds a NIC")
	parents := 0
	for _, r := range rows {
		if r.Kind == "vgpu-parent" {
			parents++
			assert.Equal(t, lease.DeviceFree, r.State)
		}
	}
	assert.Equal(t, 1, parents)

	code, out, _ := runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root, "--gpu-passthrough", "all")
	require.Equal(t, cli.ExitOK, code)
	assert.Contains(t, out, "DEVICE")
	assert.Contains(t, out, "quarantined")

	code, _, _ = runDevices(t, "clear", g(2), "--state-dir", dir)
	assert.Equal(t, cli.ExitUsage, code, "a reason is required")
	code, _, _ = runDevices(t, "clear", g(1), "--state-dir", dir, "--reason", "x")
	assert.Equal(t, cli.ExitUsage, code, "not quarantined")
	code, out, stderr := runDevices(t, "clear", g(2), "--state-dir", dir, "--reason", "GPU reseated, RMA 42")
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, "cleared")
	b, err := os.ReadFile(filepath.Join(dir, cli.QuarantineLogFile))
	require.NoError(t, err)
	assert.Contains(t, string(b), "GPU reseated, RMA 42")
	assert.Equal(t, lease.DeviceFree, list()[g(2)].State)
}

// TestDevicesUnreadableQuarantine (issue 31 case 7): a quarantine file
// holding null is unreadable: devices says so and how to mend it, and
// devices clear --reset (with a reason, logged) sets it aside for an
// empty one. A readable quarantine is not reset.
func TestDevicesUnreadableQuarantine(t *testing.T) {
	sim := simtest.Start(t, vgpusim.Options{PCIGPUs: 1})
	dir := t.TempDir()
	_, err := store.New(dir)
	require.NoError(t, err)
	path := filepath.Join(dir, lease.QuarantineFile)
	require.NoError(t, os.WriteFile(path, []byte("null"), 0o600))

	code, _, stderr := runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root, "--gpu-passthrough", "all")
	assert.Equal(t, cli.ExitError, code)
	assert.Contains(t, stderr, "quarantine unreadable")
	assert.Contains(t, stderr, "devices clear --reset")

	code, _, _ = runDevices(t, "clear", "--reset", "--state-dir", dir)
	assert.Equal(t, cli.ExitUsage, code, "a reason is required")
	code, _, _ = runDevices(t, "clear", "0000:01:00.0", "--reset", "--state-dir", dir, "--reason", "x")
	assert.Equal(t, cli.ExitUsage, code, "an id or --reset, not both")
	code, out, stderr := runDevices(t, "clear", "--reset", "--state-dir", dir, "--reason", "file zeroed by a bad restore, checked by hand")
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, ".unreadable-")
	b, err := os.ReadFile(filepath.Join(dir, cli.QuarantineLogFile))
	require.NoError(t, err)
	assert.Contains(t, string(b), "checked by hand")

	code, _, stderr = runDevices(t, "--state-dir", dir, "--sysfs-root", sim.Root, "--gpu-passthrough", "all")
	assert.Equal(t, cli.ExitOK, code, stderr)
	code, _, _ = runDevices(t, "clear", "--reset", "--state-dir", dir, "--reason", "again")
	assert.Equal(t, cli.ExitUsage, code, "a readable quarantine is cleared by id")
}
