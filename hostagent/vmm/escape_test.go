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

	bin := filepath.Join(proctest.ShortDir(t, "esc"), "escapee")
	require.NoError(t, os.Chmod(filepath.Dir(bin), 0o755))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	require.NoError(t, stacktest.GoBuild(ctx, "-o", bin, "-ldflags",
		"-X main.tcpAddr="+temporal.Addr().String()+" -X main.otherRecord="+other, "./hostagent/vmm/vmmtest/escapee"))

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
