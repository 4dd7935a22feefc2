package vmm

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc/proctest"
	"vmflow/testsupport/stacktest"
)

// The escaped-QEMU suite: a stand-in for a QEMU a guest has taken over
// (vmmtest/escapee) is launched through the exact production path, the
// jail, its cgroup, its uid, rlimits and descriptors (QEMU's own -sandbox
// aside: the stand-in ignores its argv), and tries what such a QEMU would.
// Every try must fail: the Temporal frontend on the host's 127.0.0.1 (the
// jail's network namespace has no route to it), another instance's record
// and /etc/shadow (not in its root), writing anywhere (a read-only root, a
// /dev without the file), a descriptor the agent inherited (closed), more
// tasks than its pid limit, and memory past its cgroup's limit (the OOM
// killer ends it, inside its own cgroup).
func TestEscapedQEMUStaysJailed(t *testing.T) {
	requiresQEMU(t)
	cg := v1OrSkip(t)

	temporal, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer temporal.Close()
	go func() {
		for {
			c, err := temporal.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	other := filepath.Join(testDir(t), "record.json")
	require.NoError(t, os.WriteFile(other, []byte(`{"id":"other"}`), 0o600))

	bin := buildEscapee(t, "-X main.tcpAddr="+temporal.Addr().String()+" -X main.otherRecord="+other)

	leak, err := unix.Open("/etc/hostname", unix.O_RDONLY, 0) // inherited without close-on-exec
	require.NoError(t, err)
	defer unix.Close(leak)

	cfg := jailed(t, testLaunchConfig(t, "escapee"))
	cfg.Binary = bin
	cfg.Confine.Cgroups = cg
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err, "log: %s", readLog(cfg.Paths.Log))
	killOnCleanup(t, vm)
	t.Cleanup(func() { _ = cg.Remove(context.Background(), CgroupName("escapee", cfg.Confine.UID)) })
	require.NoError(t, vm.Wait(ctxT(t, 2*time.Minute)), "the stand-in outlived its memory limit: %s", readLog(cfg.Paths.Log))
	ex, _ := vm.Child().Exit()
	log := readLog(cfg.Paths.Log)
	t.Logf("exit %v\n%s", ex, regexp.MustCompile(`(?m)^escapee mem \d+\n`).ReplaceAllString(log, ""))

	lines := map[string]string{}
	for _, l := range strings.Split(log, "\n") {
		if rest, ok := strings.CutPrefix(l, "escapee "); ok {
			k, v, _ := strings.Cut(rest, ": ")
			lines[k] = v
		}
	}
	require.Contains(t, lines, "checks done", "the stand-in ran its tries: %s", log)
	for k, v := range lines {
		if strings.HasPrefix(k, "tcp ") || strings.HasPrefix(k, "read ") || strings.HasPrefix(k, "write ") {
			assert.True(t, strings.HasPrefix(v, "refused"), "%s: %s", k, v)
		}
	}
	tries := 0
	for k := range lines {
		if !strings.HasPrefix(k, "mem ") {
			tries++
		}
	}
	assert.Equal(t, 11, tries, "every try reported (tcp, 2 reads, 5 writes, fds, forks, done): %v", lines)

	fds := regexp.MustCompile(`(?m)^escapee fds (.*)$`).FindStringSubmatch(log)
	require.Len(t, fds, 2)
	for _, fd := range strings.Fields(fds[1]) {
		n, target, _ := strings.Cut(fd, "=")
		assert.NotEqual(t, "/etc/hostname", target, "the agent's inherited fd reached it as %s", n)
		assert.False(t, strings.HasPrefix(target, "/") && !strings.HasPrefix(target, "/proc/") && !strings.HasPrefix(target, "/dev/null"),
			"fd %s is a file of the host: %s", n, target)
	}

	forked := regexp.MustCompile(`(?m)^escapee forked (\d+): (.*)$`).FindStringSubmatch(log)
	require.Len(t, forked, 3)
	n, _ := strconv.Atoi(forked[1])
	assert.Less(t, n, int(CgroupLimitsFor(cfg.Spec).Pids), "no more tasks than its limit: %s", forked[2])
	assert.Contains(t, forked[2], "resource temporarily unavailable")

	assert.NotContains(t, log, "mem SURVIVED")
	assert.Equal(t, "killed", ex.Signal, "ended by the OOM killer in its own cgroup: %v", ex)
	mibs := regexp.MustCompile(`(?m)^escapee mem (\d+)$`).FindAllStringSubmatch(log, -1)
	require.NotEmpty(t, mibs)
	last, _ := strconv.Atoi(mibs[len(mibs)-1][1])
	assert.LessOrEqual(t, uint64(last)<<20, CgroupLimitsFor(cfg.Spec).MemoryBytes, "never past its memory limit")
}

// buildEscapee builds vmmtest/escapee with these -ldflags.
func buildEscapee(t *testing.T, ldflags string) string {
	return stacktest.BuildCommand(t, "./hostagent/vmm/vmmtest/escapee", ldflags)
}

// escapeeLines waits for the stand-in's "checks done" in its log and
// returns its tries by name.
func escapeeLines(t *testing.T, logPath string) map[string]string {
	t.Helper()
	lines := map[string]string{}
	require.Eventually(t, func() bool {
		for _, l := range strings.Split(readLog(logPath), "\n") {
			if rest, ok := strings.CutPrefix(l, "escapee "); ok {
				k, v, _ := strings.Cut(rest, ": ")
				lines[k] = v
			}
		}
		_, done := lines["checks done"]
		return done
	}, 30*time.Second, 50*time.Millisecond, "the stand-in ran its tries: %s", readLog(logPath))
	return lines
}

// A QEMU given a VFIO device sees, of /sys, that device's own folder
// (read-only) at the path it was given, its iommu_group link and its
// subsystem (an mdev), and nothing else: not another VM's mdev on the same
// GPU, not the rest of sysfs. Of /dev/vfio it sees the container and its
// own group's node. The tree is a stand-in shaped like the kernel's (the
// jail resolves it the same way); the nodes come from the supervisor's
// device root.
func TestJailShowsOnlyClaimedDevices(t *testing.T) {
	requiresRoot(t)
	base := proctest.ShortDir(t, "sys")
	gpu := filepath.Join(base, "sys/devices/pci0000:00/0000:00:02.0")
	own, other := filepath.Join(gpu, "5e1b5c4a-2c55-4b1e-9a34-7d0c3f2a9b10"), filepath.Join(gpu, "9a0c2b1d-1111-4c3e-8f00-3d2c1b0a9f8e")
	for _, d := range []string{own, other, filepath.Join(base, "sys/bus/mdev/devices"), filepath.Join(base, "sys/kernel/iommu_groups/7")} {
		require.NoError(t, os.MkdirAll(d, 0o755))
	}
	for _, d := range []string{own, other} {
		require.NoError(t, os.WriteFile(filepath.Join(d, "vendor"), []byte("0x10de\n"), 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(d, "remove"), nil, 0o666))
		require.NoError(t, os.Symlink("../../../../kernel/iommu_groups/7", filepath.Join(d, "iommu_group")))
		require.NoError(t, os.Symlink("../../../../bus/mdev", filepath.Join(d, "subsystem")))
	}
	sysfsdev := filepath.Join(base, "sys/bus/mdev/devices", filepath.Base(own))
	require.NoError(t, os.Symlink("../../../devices/pci0000:00/0000:00:02.0/"+filepath.Base(own), sysfsdev))
	devRoot := filepath.Join(base, "dev")
	require.NoError(t, os.MkdirAll(filepath.Join(devRoot, "vfio"), 0o755))
	for _, n := range []string{"vfio", "7", "8"} {
		require.NoError(t, os.WriteFile(filepath.Join(devRoot, "vfio", n), nil, 0o666))
	}

	cfg := jailed(t, testLaunchConfig(t, "sysview"))
	cfg.Spec.Machine, cfg.Spec.VFIO = MachineQ35, []string{sysfsdev}
	cfg.Confine.Jail.DevRoot = devRoot
	bin := buildEscapee(t, "-X main.sysfsdev="+sysfsdev+" -X main.sibling="+other)
	// The launch's own setup-stage command, with QEMU's rlimits but the
	// default memlock: a VFIO VM's is past a test's hard limit wherever
	// the test lacks CAP_SYS_RESOURCE (TestMemlockPastAgentLimitRefused).
	limits, err := LimitsFor(cfg.Spec)
	require.NoError(t, err)
	limits.Memlock = memlockSmall
	l := &launch{cfg: cfg}
	cmd, err := l.jailCmd(*cfg.Confine.Jail, bin, []string{bin}, limits, nil)
	require.NoError(t, err)
	out, err := os.Create(cfg.Paths.Log)
	require.NoError(t, err)
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	l.syncRead.Close()
	_, err = l.goAhead.Write([]byte{1})
	require.NoError(t, err)
	l.goAhead.Close()
	lines := escapeeLines(t, cfg.Paths.Log)

	assert.Equal(t, "READ 0x10de", lines["sys own"], "its own device, by the path it was given")
	assert.Equal(t, "../../../../kernel/iommu_groups/7 <nil>", lines["sys group"])
	assert.Equal(t, filepath.Join(base, "sys/bus/mdev")+" <nil>", lines["sys subsystem"], "QEMU tells an mdev by it")
	assert.Contains(t, lines["sys write"], "read-only file system")
	assert.True(t, strings.HasPrefix(lines["sys sibling"], "refused"), "another VM's mdev: %s", lines["sys sibling"])
	assert.True(t, strings.HasPrefix(lines["sys cpus"], "refused"), "the rest of sysfs: %s", lines["sys cpus"])
	assert.Equal(t, "7 vfio", lines["dev vfio"], "the container and its own group, not group 8")
}
