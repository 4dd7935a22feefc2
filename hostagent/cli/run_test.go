package cli_test

import (
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
)

func TestParseRun(t *testing.T) {
	c, err := cli.ParseRun([]string{"--host-id", "h1", "--state-dir", "/tmp/s", "--image-root", "/a", "--image-root", "/b",
		"--vgpu-attach=false", "--sysfs-root", "/tmp/sim", "--graceful-timeout", "3s", "--holders-ignore-pid", "1"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "h1", c.HostID)
	assert.Equal(t, []string{"/a", "/b"}, c.ImageRoots)
	assert.False(t, c.VGPUAttach)
	assert.Equal(t, "/tmp/sim", c.SysfsRoot)
	assert.Equal(t, 3*time.Second, c.GracefulTimeout)
	assert.Equal(t, "/dev", c.DevRoot)
	assert.Equal(t, []int{1}, c.IgnoreUninspectable)

	d, err := cli.ParseRun([]string{"--host-id", "h1"}, io.Discard)
	require.NoError(t, err)
	assert.True(t, d.VGPUAttach, "production attaches vGPUs")
	assert.Equal(t, "/var/lib/vmflow", d.StateDir)
	assert.Empty(t, d.QEMUUser, "QEMU stays root unless asked")

	u, err := cli.ParseRun([]string{"--host-id", "h1", "--qemu-user", "vmflow-qemu"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "vmflow-qemu", u.QEMUUser)
}

func TestParseRunRejects(t *testing.T) {
	for _, args := range [][]string{
		{"--host-id", "Host.Example"},
		{"--host-id", ""},
		{"--host-id", "h1", "--vgpu-driver", "nvidia"},
		{"--host-id", "h1", "--graceful-timeout", "0s"},
		{"--host-id", "h1", "stray"},
		{"--host-id", "h1", "--workflow-task-queue", ""},
		{"--host-id", "h1", "--holders-ignore-pid", "one"},
		// A user name is one argv element after -runas / inside
		// -run-with user=: nothing that could add a QemuOpts key or a path.
		{"--host-id", "h1", "--qemu-user", "nobody,chroot=/"},
		{"--host-id", "h1", "--qemu-user", "../root"},
		{"--host-id", "h1", "--qemu-user", "Root"},
		{"--host-id", "h1", "--qemu-user", "-runas"},
	} {
		_, err := cli.ParseRun(args, io.Discard)
		assert.Error(t, err, "%q", args)
	}
}
