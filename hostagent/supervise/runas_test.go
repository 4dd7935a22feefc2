package supervise

import (
	"fmt"
	"os"
	"os/user"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/vmm"
)

// With Config.RunAs every QEMU the supervisor launches runs as that user,
// and an exit nobody asked for is reported to OnExitRecorded once the
// record says so (the agent's vmflow_exit_detect_seconds).
func TestRunAsAndExitRecordedHook(t *testing.T) {
	e := newEnv(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root: QEMU drops to another user only when started as root")
	}
	nobody, err := user.Lookup("nobody")
	if err != nil {
		t.Skipf("no user nobody: %v", err)
	}
	v, err := vmm.DetectVersion(ctxT(t, 10*time.Second), "")
	require.NoError(t, err)
	detected := make(chan time.Duration, 1)
	sup := e.newSupervisor(func(c *Config) {
		c.RunAs, c.RunWith = "nobody", vmm.RunWithSupported(v)
		c.OnExitRecorded = func(d time.Duration) { detected <- d }
	})
	// The record's spec names no user: the supervisor's applies.
	e.create("vm1", "never", 0)
	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)

	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", res.Identity.PID))
	require.NoError(t, err)
	var uids []string
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			uids = strings.Fields(rest)
		}
	}
	assert.Equal(t, []string{nobody.Uid, nobody.Uid, nobody.Uid, nobody.Uid}, uids, "QEMU %s", v)

	killFromOutside(t, e, "vm1")
	select {
	case d := <-detected:
		assert.GreaterOrEqual(t, d, time.Duration(0))
		assert.Less(t, d, 5*time.Second)
		t.Logf("exit detect: %s", d)
	case <-ctxT(t, 20*time.Second).Done():
		t.Fatal("OnExitRecorded was not called for a QEMU killed from outside")
	}
	rec := e.get("vm1")
	assert.Nil(t, rec.GetProcess())
	assert.Equal(t, "signal: killed", rec.GetLastExitStatus())
}
