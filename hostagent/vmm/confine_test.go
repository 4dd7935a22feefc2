package vmm

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
)

// testUIDs hands each launch of this test process a uid of its own, far
// from any real user and from other test processes (keyed by pid).
var testUIDs atomic.Uint32

func testUID() uint32 {
	base := 3_000_000_000 + uint32(os.Getpid()%100_000)*1_000
	return base + testUIDs.Add(1)%1_000
}

// procStatus returns the named fields of /proc/<pid>/status.
var procStatus = proctest.Status

// procLimit returns the soft and hard value of a /proc/<pid>/limits row.
func procLimit(t *testing.T, pid int, row string) (string, string) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	require.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, row); ok {
			f := strings.Fields(rest)
			require.GreaterOrEqual(t, len(f), 2, line)
			return f[0], f[1]
		}
	}
	t.Fatalf("no %q in /proc/%d/limits", row, pid)
	return "", ""
}

func requiresRoot(t *testing.T) { proctest.RequiresRoot(t, "only root can exec QEMU as another uid") }

// Confinement on a real QEMU (-machine none, KVM here): exec'd
// as the launch's own uid and gid with the KVM group as its only
// supplementary group, no capabilities, under seccomp (the -sandbox
// filter), with PATH and LC_ALL=C as its whole environment, its rlimits
// set, QMP served on the listener the agent bound (the socket path stays
// the agent's, dialed by it), no pidfile, and the instance directory
// still root's 0700. The stop ladder stops it as it stops any QEMU.
func TestLaunchConfined(t *testing.T) {
	requiresQEMU(t)
	requiresRoot(t)
	cfg := testLaunchConfig(t, "confined")
	dir := filepath.Dir(cfg.Paths.QMPSocket)
	require.NoError(t, os.Chmod(dir, 0o700))
	t.Setenv("TEMPORAL_API_KEY", "secret-the-agent-has")
	// A descriptor the agent inherited without close-on-exec (from
	// whatever started it): QEMU must not get it.
	leak, err := unix.Open("/etc/hostname", unix.O_RDONLY, 0)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(leak) })
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)
	pid := vm.Identity().PID

	st := procStatus(t, pid)
	uid := strconv.FormatUint(uint64(cfg.Confine.UID), 10)
	assert.Equal(t, strings.Repeat(uid+" ", 3)+uid, st["Uid"])
	assert.Equal(t, strings.Repeat(uid+" ", 3)+uid, st["Gid"])
	wantGroups := ""
	if cfg.Spec.Accel == AccelKVM {
		wantGroups = strconv.FormatUint(uint64(cfg.Confine.KVM.GID), 10)
	}
	assert.Equal(t, wantGroups, st["Groups"], "only the KVM node's group, none of root's")
	assert.Equal(t, "0000000000000000", st["CapEff"])
	assert.Equal(t, "0000000000000000", st["CapPrm"])
	assert.Equal(t, "2", st["Seccomp"], "QEMU's -sandbox filter")
	assert.Equal(t, "3", st["Seccomp_filters"], "vmflow's two (seccomp.go), inherited from the thread the launch forked from, and QEMU's -sandbox")
	assert.Equal(t, "1", st["NoNewPrivs"])

	env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	require.NoError(t, err)
	assert.Equal(t, []string{"PATH=" + qemuPath, "LC_ALL=C"},
		strings.Split(string(bytes.TrimSuffix(env, []byte{0})), "\x00"), "exactly PATH and LC_ALL=C")

	soft, hard := procLimit(t, pid, "Max locked memory")
	assert.Equal(t, []string{"8388608", "8388608"}, []string{soft, hard})
	soft, hard = procLimit(t, pid, "Max processes")
	assert.Equal(t, []string{"130", "130"}, []string{soft, hard})
	lim, err := LimitsFor(cfg.Spec)
	require.NoError(t, err)
	for row, want := range map[string]uint64{"Max file size": lim.FSize, "Max open files": lim.NoFile, "Max core file size": 0} {
		soft, hard = procLimit(t, pid, row)
		assert.Equal(t, []string{strconv.FormatUint(want, 10), strconv.FormatUint(want, 10)}, []string{soft, hard}, row)
	}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	require.NoError(t, err)
	for _, e := range fds {
		target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
		assert.NotEqual(t, "/etc/hostname", target, "QEMU got the agent's inherited fd %d as its %s", leak, e.Name())
	}

	// The agent's socket: dialed by path (a second client after Launch's
	// own connection closes), QEMU holds only the fd.
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	assert.Equal(t, fs.ModeDir|0o700, fi.Mode())
	assert.Equal(t, uint32(0), fi.Sys().(*syscall.Stat_t).Uid)
	assert.NoFileExists(t, cfg.Paths.PIDFile)
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range ents {
		info, err := e.Info()
		require.NoError(t, err)
		assert.Equal(t, uint32(0), info.Sys().(*syscall.Stat_t).Uid, "%s is root's", e.Name())
	}
	assertRunsThenStops(t, vm)
}

// Root is never QEMU's uid: a launch without a uid of its own starts
// nothing.
func TestLaunchRefusesUnconfined(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "root")
	cfg.Confine.UID = 0
	var failed int
	cfg.OnFailed = func(_ proc.Identity, _ error) error { failed++; return nil }
	_, err := Launch(ctxT(t, 10*time.Second), cfg)
	require.ErrorIs(t, err, ErrNoQEMUUID)
	assert.Equal(t, 1, failed)
	assert.NoFileExists(t, cfg.Paths.QMPSocket)
}

// A KVM node its group cannot open (here 0604 and 0600) makes CheckKVM
// record a typed error naming the mode, every KVM launch returns it (before
// any fork), and TCG launches go on.
func TestKVMNodeGroupCannotOpen(t *testing.T) {
	requiresQEMU(t)
	requiresRoot(t)
	node := filepath.Join(t.TempDir(), "kvm")
	require.NoError(t, os.WriteFile(node, nil, 0o600))
	require.NoError(t, os.Chown(node, 0, 36))
	for _, mode := range []fs.FileMode{0o600, 0o604, 0o640} {
		require.NoError(t, os.Chmod(node, mode))
		k := CheckKVM(node)
		require.ErrorIs(t, k.Err, ErrKVMAccess, "%04o", mode)
		var ke *KVMAccessError
		require.ErrorAs(t, k.Err, &ke)
		assert.Equal(t, mode, ke.Mode)
		assert.Contains(t, k.Err.Error(), fmt.Sprintf("mode %04o", mode))
	}
	require.NoError(t, os.Chmod(node, 0o660))
	assert.NoError(t, CheckKVM(node).Err)
	assert.ErrorIs(t, CheckKVM(filepath.Join(t.TempDir(), "none")).Err, ErrKVMAccess)

	require.NoError(t, os.Chmod(node, 0o600))
	cfg := testLaunchConfig(t, "nokvm")
	cfg.Confine.KVM = CheckKVM(node)
	cfg.Spec.Accel = AccelKVM
	_, err := Launch(ctxT(t, 10*time.Second), cfg)
	require.ErrorIs(t, err, ErrKVMAccess)
	assert.Contains(t, err.Error(), "0600")

	cfg.Spec.Accel = AccelTCG
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err, "TCG needs no /dev/kvm")
	killOnCleanup(t, vm)
}

func TestLimitsFor(t *testing.T) {
	lim := func(spec VMSpec) Limits {
		t.Helper()
		l, err := LimitsFor(spec)
		require.NoError(t, err)
		return l
	}
	assert.Equal(t, Limits{Memlock: 8 << 20, NProc: 130, FSize: 1 << 20, NoFile: 264}, lim(VMSpec{VCPUs: 1, MemoryMiB: 64}),
		"no disk: QEMU writes no file")
	assert.Equal(t, Limits{Memlock: 4096<<20 + 1<<30, NProc: 136, FSize: 1 << 20, NoFile: 256 + 32 + 256},
		lim(VMSpec{VCPUs: 4, MemoryMiB: 4096, VFIO: []string{"/sys/bus/mdev/devices/x"}}), "VFIO pins guest RAM and opens more")

	// A disk: the overlay may grow to the base's size plus qcow2's
	// metadata (qemu-img measure: 320 KiB for 64 MiB, 16 MiB for 100 GiB).
	dir := t.TempDir()
	base, err := os.Create(filepath.Join(dir, "base"))
	require.NoError(t, err)
	defer base.Close()
	require.NoError(t, base.Truncate(100<<30))
	ov, err := os.Create(filepath.Join(dir, "ov"))
	require.NoError(t, err)
	defer ov.Close()
	l := lim(VMSpec{VCPUs: 1, MemoryMiB: 64, Disk: &Disk{Base: base, Overlay: ov}})
	assert.Equal(t, uint64(100<<30+(100<<30)/4096+1<<20), l.FSize)
	assert.Greater(t, l.FSize, uint64(107390828544), "qemu-img measure's fully allocated size of 100 GiB")

	// An overlay already past that (it never is, but a bound below its
	// size would kill QEMU at its first write at the end) keeps room.
	require.NoError(t, ov.Truncate(200<<30))
	assert.Equal(t, uint64(200<<30+1<<20), lim(VMSpec{VCPUs: 1, MemoryMiB: 64, Disk: &Disk{Base: base, Overlay: ov}}).FSize)

	closed, err := os.Create(filepath.Join(dir, "closed"))
	require.NoError(t, err)
	closed.Close()
	_, err = LimitsFor(VMSpec{VCPUs: 1, MemoryMiB: 64, Disk: &Disk{Base: closed, Overlay: ov}})
	assert.Error(t, err, "a base that cannot be stat'ed")
}

// A VFIO group node found through the device's iommu_group link is given
// to the instance's uid and taken back; a device without the link (the
// vGPU simulator's) or a node that does not exist is nothing to do.
func TestVFIOGroupOwnership(t *testing.T) {
	requiresRoot(t)
	sys, dev := t.TempDir(), t.TempDir()
	sysfsdev := filepath.Join(sys, "bus", "mdev", "devices", "5e1b5c4a-2c55-4b1e-9a34-7d0c3f2a9b10")
	require.NoError(t, os.MkdirAll(sysfsdev, 0o755))
	require.NoError(t, os.Symlink("../../../../kernel/iommu_groups/42", filepath.Join(sysfsdev, "iommu_group")))
	node, err := VFIOGroupNode(dev, sysfsdev)
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(dev, "vfio", "42"), node)

	require.NoError(t, GiveVFIOGroup(node, 3_000_000_123), "no node yet: skipped")
	require.NoError(t, os.MkdirAll(filepath.Dir(node), 0o755))
	require.NoError(t, os.WriteFile(node, nil, 0o600))
	require.NoError(t, GiveVFIOGroup(node, 3_000_000_123))
	fi, err := os.Stat(node)
	require.NoError(t, err)
	assert.Equal(t, uint32(3_000_000_123), fi.Sys().(*syscall.Stat_t).Uid)
	assert.Equal(t, uint32(3_000_000_123), fi.Sys().(*syscall.Stat_t).Gid)
	require.NoError(t, TakeBackVFIOGroup(node))
	fi, err = os.Stat(node)
	require.NoError(t, err)
	assert.Equal(t, uint32(0), fi.Sys().(*syscall.Stat_t).Uid)

	bare := filepath.Join(sys, "bus", "mdev", "devices", "sim")
	require.NoError(t, os.MkdirAll(bare, 0o755))
	node, err = VFIOGroupNode(dev, bare)
	require.NoError(t, err)
	assert.Empty(t, node)
	assert.NoError(t, GiveVFIOGroup(node, 1))
}

// proc.UIDsInUse sees the uid of a process exec'd as it (what keeps a
// held uid from being handed to a new instance).
func TestUIDSeenHeld(t *testing.T) {
	requiresRoot(t)
	uid := testUID()
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	used, err := proc.UIDsInUse(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	assert.True(t, used[uid], "uid %d is held by pid %d", uid, cmd.Process.Pid)
	assert.True(t, used[0])
	assert.False(t, used[uid+500_000], "a uid no process holds")
}

// A VFIO VM's memlock past the agent's own hard limit is refused, naming
// the unit setting; within it, or unlimited, it is not; a VM without VFIO
// never is.
func TestMemlockPastAgentLimitRefused(t *testing.T) {
	vfio := VMSpec{VCPUs: 1, MemoryMiB: 64, VFIO: []string{"/sys/bus/mdev/devices/x"}}
	err := CheckMemlock(vfio, 8<<20)
	require.ErrorIs(t, err, ErrMemlockLimit)
	assert.Contains(t, err.Error(), "LimitMEMLOCK=infinity")
	assert.Contains(t, err.Error(), "needs 1088 MiB, the hard limit is 8 MiB")
	assert.NoError(t, CheckMemlock(vfio, unix.RLIM_INFINITY))
	assert.NoError(t, CheckMemlock(vfio, 1088<<20))
	assert.NoError(t, CheckMemlock(vfio, 0), "a limit that could not be read refuses nothing")
	assert.NoError(t, CheckMemlock(VMSpec{VCPUs: 1, MemoryMiB: 64}, 8<<20), "a VM without VFIO pins nothing past the default")
}
