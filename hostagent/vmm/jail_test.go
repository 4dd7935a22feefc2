package vmm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/guest"
	"vmflow/guest/build"
	"vmflow/hostagent/proc"
)

// jailed is cfg jailed, with this test binary as the setup stage (TestMain
// runs JailMain for it, as the agent's main does).
func jailed(t *testing.T, cfg LaunchConfig) LaunchConfig {
	t.Helper()
	cfg.Confine.Jail = &Jail{Setup: os.Args[0], Dir: filepath.Join(filepath.Dir(cfg.Paths.QMPSocket), "root")}
	return cfg
}

func nsOf(t *testing.T, pid int, ns string) string {
	t.Helper()
	l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
	require.NoError(t, err)
	return l
}

// A jailed QEMU, seen from outside in /proc/<pid>: namespaces of its own
// (network, mount, pid, IPC, UTS), PID 1 of its pid namespace (the process
// the agent forked and reaps, no init in between), a root holding QEMU's
// binary (the same file: same device and inode), its libraries, modules and
// firmware, a fresh /proc and a minimal /dev, and nothing else: no /etc
// beyond ld.so.cache, no state directory, no other instance's files. Its
// uid, capabilities and rlimits are as unjailed; QMP and the stop ladder
// work unchanged.
func TestJailedQEMU(t *testing.T) {
	qemu := requiresQEMU(t)
	requiresRoot(t)
	cfg := jailed(t, testLaunchConfig(t, "jailed"))
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err, "log: %s", readLog(cfg.Paths.Log))
	killOnCleanup(t, vm)
	pid := vm.Identity().PID

	for _, ns := range []string{"net", "mnt", "pid", "ipc", "uts"} {
		assert.NotEqual(t, nsOf(t, os.Getpid(), ns), nsOf(t, pid, ns), "QEMU has a %s namespace of its own", ns)
	}
	st := procStatus(t, pid)
	assert.Equal(t, fmt.Sprintf("%d 1", pid), st["NSpid"], "PID 1 of its own pid namespace")
	assert.Equal(t, "0000000000000000", st["CapEff"])
	assert.Equal(t, "0000000000000000", st["CapAmb"])
	assert.Equal(t, "2", st["Seccomp"])
	assert.Equal(t, "3", st["Seccomp_filters"], "vmflow's two (seccomp.go), installed by the setup stage, and QEMU's -sandbox")

	exe, err := proc.StatExecutable(qemu)
	require.NoError(t, err)
	found, err := FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Binary: qemu, Paths: cfg.Paths, UID: cfg.Confine.UID, Name: "jailed"})
	require.NoError(t, err)
	assert.Equal(t, []proc.Identity{vm.Identity()}, found, "found by uid, name and its binary %v: the bind is the same file", exe)

	root := fmt.Sprintf("/proc/%d/root", pid)
	top, err := os.ReadDir(root)
	require.NoError(t, err)
	var names []string
	for _, e := range top {
		names = append(names, e.Name())
	}
	assert.Subset(t, []string{"usr", "lib", "lib64", "dev", "proc", "etc"}, names, "only what QEMU needs: %v", names)
	etc, err := os.ReadDir(filepath.Join(root, "etc"))
	require.NoError(t, err)
	require.Len(t, etc, 1)
	assert.Equal(t, "ld.so.cache", etc[0].Name())
	assert.NoFileExists(t, filepath.Join(root, "etc/shadow"))
	assert.NoDirExists(t, filepath.Join(root, filepath.Dir(cfg.Paths.QMPSocket)), "not even its own instance directory")
	dev, err := os.ReadDir(filepath.Join(root, "dev"))
	require.NoError(t, err)
	var devs []string
	for _, e := range dev {
		devs = append(devs, e.Name())
	}
	want := []string{"null", "urandom", "zero"}
	if cfg.Spec.Accel == AccelKVM {
		want = append([]string{"kvm"}, want...)
	}
	assert.ElementsMatch(t, want, devs)
	bin, err := os.Stat(filepath.Join(root, qemu))
	require.NoError(t, err)
	host, err := os.Stat(qemu)
	require.NoError(t, err)
	assert.True(t, os.SameFile(bin, host), "the binary is bound, not copied")
	assert.Error(t, os.WriteFile(filepath.Join(root, "usr/x"), nil, 0o644), "the root is read-only")

	assertRunsThenStops(t, vm)
}

// The real guest (TCG) boots to its init inside the jail, from a kernel and
// initrd passed as /proc/self/fd/N (the jail's own procfs), and powers off
// on the ACPI button: QEMU exits by itself with status 0.
func TestJailedGuestPowersOff(t *testing.T) {
	requiresQEMU(t)
	requiresRoot(t)
	cfg := jailed(t, testLaunchConfig(t, "guest"))
	cfg.Spec = guestSpec(t)
	bootThenPowerOff(t, cfg, nil)
}

// guestSpec is the test guest (make guest; built here when missing) as a
// q35 TCG VM with its console in the log.
func guestSpec(t *testing.T) VMSpec {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	a, err := build.Build(ctx, build.Options{Log: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	kernel, err := os.Open(a.Kernel)
	require.NoError(t, err)
	initrd, err := os.Open(a.Initrd)
	require.NoError(t, err)
	return VMSpec{Name: "guest", VCPUs: 1, MemoryMiB: 256, Machine: MachineQ35, Accel: AccelTCG,
		Kernel: kernel, Initrd: initrd, Cmdline: guest.KernelCmdline, SerialToLog: true, NoReboot: true}
}

// bootThenPowerOff launches cfg's guest, waits for its init, runs up (when
// set) on the running VM, presses the power button and checks that QEMU
// ended by itself with status 0 after the guest said so.
func bootThenPowerOff(t *testing.T, cfg LaunchConfig, up func(*VM)) {
	t.Helper()
	vm, err := Launch(ctxT(t, 60*time.Second), cfg)
	require.NoError(t, err, "log: %s", readLog(cfg.Paths.Log))
	killOnCleanup(t, vm)
	require.Eventually(t, func() bool { return strings.Contains(readLog(cfg.Paths.Log), guest.UpLine) },
		2*time.Minute, 50*time.Millisecond, "the guest's init came up")
	if up != nil {
		up(vm)
	}
	m, err := vm.Monitor(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	require.NoError(t, m.SystemPowerdown(ctxT(t, 5*time.Second)))
	require.NoError(t, vm.Wait(ctxT(t, 60*time.Second)), "log: %s", readLog(cfg.Paths.Log))
	ex, ok := vm.Child().Exit()
	require.True(t, ok)
	assert.Equal(t, 0, ex.Code, "QEMU ended by itself: %+v", ex)
	assert.Contains(t, readLog(cfg.Paths.Log), guest.PowerOffLine)
}

func readLog(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

// A launch caught in the jail's setup stage (before QEMU is exec'd: here
// while OnStarted runs, the stage waiting for its go-ahead) is found by
// the instance's uid and name, as QEMU is later; another uid or name is
// not, nor a search that does not know the setup binary. The stage builds
// QEMU's root before its go-ahead (overlapping the agent's record write
// and cgroup placement), and is found once it has pivoted into it too.
func TestFindUnrecordedSeesJailSetup(t *testing.T) {
	qemu := requiresQEMU(t)
	requiresRoot(t)
	cfg := jailed(t, testLaunchConfig(t, "setup"))
	look := func(uid uint32, name, setup string) []proc.Identity {
		ids, err := FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Binary: qemu, Paths: cfg.Paths, UID: uid, Name: name, JailSetup: setup})
		require.NoError(t, err)
		return ids
	}
	var inSetup, pivoted, otherUID, otherName, noSetup []proc.Identity
	var rootBuilt bool
	cfg.OnStarted = func(id proc.Identity) error {
		inSetup = look(cfg.Confine.UID, "setup", os.Args[0])
		// No go-ahead yet: the root is built all the same.
		deadline := time.Now().Add(10 * time.Second)
		root := fmt.Sprintf("/proc/%d/root", id.PID)
		for !rootBuilt && time.Now().Before(deadline) {
			// Its own /dev, and not the host's folders (the instance's).
			_, dev := os.Stat(root + "/dev/null")
			_, inst := os.Stat(root + filepath.Dir(cfg.Paths.QMPSocket))
			rootBuilt = dev == nil && errors.Is(inst, fs.ErrNotExist)
			time.Sleep(5 * time.Millisecond)
		}
		pivoted = look(cfg.Confine.UID, "setup", os.Args[0])
		otherUID = look(cfg.Confine.UID+1, "setup", os.Args[0])
		otherName = look(cfg.Confine.UID, "setu", os.Args[0])
		noSetup = look(cfg.Confine.UID, "setup", "")
		return nil
	}
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err, "log: %s", readLog(cfg.Paths.Log))
	killOnCleanup(t, vm)
	assert.Equal(t, []proc.Identity{vm.Identity()}, inSetup, "the setup stage is the launch's process")
	assert.True(t, rootBuilt, "the setup stage built QEMU's root before its go-ahead")
	assert.Equal(t, []proc.Identity{vm.Identity()}, pivoted, "found in its own root too")
	assert.Empty(t, otherUID)
	assert.Empty(t, otherName)
	assert.Empty(t, noSetup)
}

// A --qemu that is a wrapper script runs jailed too: its interpreter, its
// folder and the QEMU it execs are in the root, and QEMU's own error
// reaches the launch's error (as unjailed).
func TestJailedWrapperScript(t *testing.T) {
	qemu := requiresQEMU(t)
	requiresRoot(t)
	d := filepath.Dir(testLaunchConfig(t, "x").Paths.QMPSocket)
	require.NoError(t, os.Chmod(d, 0o755))
	wrapper := filepath.Join(d, "qemu-bad-option")
	require.NoError(t, os.WriteFile(wrapper, []byte("#!/bin/sh\nexec "+qemu+" -jail-no-such-option \"$@\"\n"), 0o755))
	cfg := jailed(t, testLaunchConfig(t, "wrapped"))
	cfg.Binary = wrapper
	_, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.ErrorIs(t, err, ErrLaunchExited)
	assert.Contains(t, err.Error(), "-jail-no-such-option: invalid option")
}
