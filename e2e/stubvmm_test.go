package e2e

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/testsupport/stacktest"
)

// TestStubVMM is the smoke test of the stub VMM make bench-scale runs
// thousands of (hostagent/vmm/vmmtest/stubvmm): the real agent, given it
// as --qemu, launches it through the real jail (its namespaces and root,
// its uid, its cgroup, the seccomp allowlist), where it runs as one thread,
// PID 1 of its pid namespace, under the filter; the agent is killed -9 and
// started again, and the delete's system_powerdown reaches the stub over
// a new QMP connection (a ladder that had to fall back to signals would
// log quit_sent), which ends it.
func TestStubVMM(t *testing.T) {
	timeTest(t)
	stub := stacktest.BuildStubVMM(t)
	e := newEnv(t, envOptions{qemu: stub})
	id := "e2e-stub-" + suffix(t)
	e.spawn(e.noneSpawn(id, false))
	vm := identityOf(e.record(id))

	st := procStatus(t, vm.PID)
	assert.Equal(t, "1", st["Threads"], "one thread")
	assert.Equal(t, "2", st["Seccomp"], "under a seccomp filter")
	nspid := strings.Fields(st["NSpid"])
	assert.Equal(t, "1", nspid[len(nspid)-1], "PID 1 of a pid namespace of its own: %v", nspid)
	uid, err := strconv.ParseUint(strings.Fields(st["Uid"])[0], 10, 32)
	require.NoError(t, err)
	assert.True(t, e.uids.Contains(uint32(uid)), "a uid of the agent's range: %d", uid)
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", vm.PID))
	require.NoError(t, err)
	assert.Equal(t, stub, exe)
	t.Logf("stub VM %v: VmRSS %s, RssAnon %s", vm, st["VmRSS"], st["RssAnon"])

	e.agent.Kill(t)
	require.True(t, proc.Inspect(vm).Alive, "the stub outlives its agent")
	e.agent.Start(t)
	require.NoError(t, e.startDelete(id, 5).Get(e.ctx(time.Minute), nil))
	assert.Equal(t, []string{"powerdown_sent", "gone"}, e.agentStopSteps(id), "powered off over QMP by the restarted agent")
	assertNoProcess(t, vm)
	e.assertNothingLeft()
}

// procStatus reads /proc/<pid>/status as key → value.
func procStatus(t *testing.T, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	m := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}
