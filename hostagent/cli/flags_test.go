package cli_test

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
)

// TestFlagsAfterArguments: every subcommand takes its flags before or
// after its positional arguments, as operators type them (virsh, kubectl
// and the temporal CLI all do). Before, Go's flag package stopped at the
// first positional argument: "show ID --state-dir D" printed the usage and
// "proc PID --wait" took --wait for a second pid.
func TestFlagsAfterArguments(t *testing.T) {
	f := newHostFixture(t)

	code, out, stderr := runShow(t, idRelFail, "--state-dir", f.dir)
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, "instance         vm-relfail")
	code, out, stderr = runShow(t, "--state-dir", f.dir, idRelFail, "-o", "json")
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.True(t, strings.HasPrefix(strings.TrimSpace(out), "{"), "-o json after the id: %q", out)
	code, _, stderr = runShow(t, "--state-dir", f.dir, "--", idRelFail)
	assert.Equal(t, cli.ExitOK, code, "-- ends the flags: %s", stderr)
	code, _, _ = runShow(t, idRelFail, "--state-dir", f.dir, idRunning)
	assert.Equal(t, cli.ExitUsage, code, "two ids, one on each side of a flag")

	code, _, stderr = runLs(t, "-o", "json", "--state-dir", f.dir)
	assert.Equal(t, cli.ExitOK, code, stderr)
	code, _, stderr = runLs(t, "--state-dir", f.dir, "extra", "-o", "json")
	assert.Equal(t, cli.ExitUsage, code)
	assert.Contains(t, stderr, "unexpected arguments")

	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	require.NoError(t, err)
	max, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	missing := strconv.Itoa(max + 1) // never a pid: --wait returns at once
	code, _, stderr = runProc(t, missing, "--wait", "--timeout", "5s")
	assert.Equal(t, cli.ExitOK, code, "--wait after the pid: %s", stderr)

	code, _, stderr = runDevices(t, "--state-dir", f.dir, "stray", "--vgpu-driver", "none")
	assert.Equal(t, cli.ExitUsage, code)
	assert.Contains(t, stderr, "unexpected arguments")
	code, _, stderr = runDevices(t, "clear", "--state-dir", f.dir, "0000:81:00.0", "--reason", "x", "0000:82:00.0")
	assert.Equal(t, cli.ExitUsage, code)
	assert.Contains(t, stderr, "one device id at a time")
}
