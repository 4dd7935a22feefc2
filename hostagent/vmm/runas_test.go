package vmm

import (
	"context"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func ver(major, minor, micro int) Version {
	var v Version
	v.QEMU.Major, v.QEMU.Minor, v.QEMU.Micro = major, minor, micro
	return v
}

func TestParseVersionOutput(t *testing.T) {
	for _, tc := range []struct {
		name, out string
		want      Version
		pkg       string
		err       bool
	}{
		{name: "debian 12", out: "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright (c) 2003-2022 Fabrice Bellard and the QEMU Project developers\n",
			want: ver(7, 2, 22), pkg: "Debian 1:7.2+dfsg-7+deb12u18+b3"},
		{name: "upstream 9.1", out: "QEMU emulator version 9.1.0\nCopyright (c) 2003-2024 Fabrice Bellard and the QEMU Project developers\n", want: ver(9, 1, 0)},
		{name: "two components", out: "QEMU emulator version 8.0 (v8.0.0-dirty)\n", want: ver(8, 0, 0), pkg: "v8.0.0-dirty"},
		{name: "10.x", out: "QEMU emulator version 10.0.2 (qemu-10.0.2-1.fc42)\n", want: ver(10, 0, 2), pkg: "qemu-10.0.2-1.fc42"},
		{name: "not qemu", out: "bash: qemu: command not found\n", err: true},
		{name: "empty", out: "", err: true},
		{name: "garbage version", out: "QEMU emulator version x.y\n", err: true},
		{name: "huge number", out: "QEMU emulator version 99999999999999999999.1\n", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, err := ParseVersionOutput(tc.out)
			if tc.err {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want.QEMU, v.QEMU)
			assert.Equal(t, tc.pkg, v.Package)
		})
	}
}

func TestRunWithSupported(t *testing.T) {
	for _, tc := range []struct {
		v    Version
		want bool
	}{
		{ver(7, 2, 22), false}, {ver(8, 2, 0), false}, {ver(9, 0, 4), false},
		{ver(9, 1, 0), true}, {ver(9, 2, 1), true}, {ver(10, 0, 0), true},
	} {
		assert.Equal(t, tc.want, RunWithSupported(tc.v), "%s", tc.v)
	}
}

func TestRunAsArgv(t *testing.T) {
	spec := VMSpec{Name: "vm1", VCPUs: 1, MemoryMiB: 64, Machine: MachineNone, Accel: AccelKVM, RunAs: "nobody"}
	a, err := Argv(spec, testPaths)
	require.NoError(t, err)
	assert.Equal(t, []string{"-runas", "nobody"}, a[len(a)-2:])
	spec.RunWith = true
	a, err = Argv(spec, testPaths)
	require.NoError(t, err)
	assert.Equal(t, []string{"-run-with", "user=nobody"}, a[len(a)-2:])
	assert.NotContains(t, a, "-runas")
	// A user name that could smuggle another QemuOpts key is refused.
	spec.RunAs = "nobody,chroot=/"
	_, err = Argv(spec, testPaths)
	assert.ErrorIs(t, err, ErrInvalidSpec)
}

func TestDetectVersionOfInstalledQEMU(t *testing.T) {
	bin := requiresQEMU(t)
	v, err := DetectVersion(context.Background(), bin)
	require.NoError(t, err)
	assert.Positive(t, v.QEMU.Major)
	_, err = DetectVersion(context.Background(), "/bin/false")
	assert.Error(t, err)
}

// procUIDs returns the real, effective, saved and filesystem uids of pid
// from /proc/<pid>/status.
func procUIDs(t *testing.T, pid int) []string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			return strings.Fields(rest)
		}
	}
	t.Fatalf("no Uid line in /proc/%d/status", pid)
	return nil
}

// A real QEMU launched with RunAs=nobody runs as uid 65534 once QMP
// answers, with the option its version takes. The socket, pidfile and log
// live in a root-only (0700) folder: QEMU opens them before it drops
// privileges, so the unprivileged user needs no access to the state dir.
func TestLaunchRunAsNobody(t *testing.T) {
	bin := requiresQEMU(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root: QEMU can only drop to another user when it starts as root")
	}
	nobody, err := user.Lookup("nobody")
	if err != nil {
		t.Skipf("no user nobody: %v", err)
	}
	v, err := DetectVersion(ctxT(t, 10*time.Second), bin)
	require.NoError(t, err)
	cfg := testLaunchConfig(t, "runas")
	require.NoError(t, os.Chmod(filepath.Dir(cfg.Paths.QMPSocket), 0o700))
	cfg.Binary = bin
	cfg.Spec.RunAs, cfg.Spec.RunWith = "nobody", RunWithSupported(v)

	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err, "QEMU %s", v)
	killOnCleanup(t, vm)
	assert.Equal(t, []string{nobody.Uid, nobody.Uid, nobody.Uid, nobody.Uid}, procUIDs(t, vm.Identity().PID),
		"QEMU %s with %v", v, RunAsArgs("nobody", cfg.Spec.RunWith))
	st, err := vm.Status(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	assert.True(t, st.Running)

	// The stop ladder still works on the unprivileged QEMU: QMP quit over
	// the socket it opened as root, and the root agent reaps it.
	res, err := vm.Stop(ctxT(t, 30*time.Second), StopConfig{GracefulTimeout: time.Millisecond})
	require.NoError(t, err)
	assert.Equal(t, StepGone, res.Reached)
	assertGone(t, vm.Identity())
}
