package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/proc/proctest"
)

func TestMain(m *testing.M) {
	proctest.RunHelperIfRequested()
	os.Exit(m.Run())
}

type procOut struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	BootID    string `json:"boot_id"`
	State     string `json:"state"`
	Tasks     int    `json:"tasks"`
	Alive     bool   `json:"alive"`
}

func runProc(t *testing.T, args ...string) (int, procOut, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := cli.Proc(context.Background(), args, cli.IO{Stdout: &stdout, Stderr: &stderr})
	var out procOut
	if stdout.Len() > 0 {
		dec := json.NewDecoder(&stdout)
		dec.DisallowUnknownFields()
		require.NoError(t, dec.Decode(&out), "stdout must be one JSON object")
	}
	return code, out, stderr.String()
}

func TestProcPrintsLiveness(t *testing.T) {
	code, out, _ := runProc(t, strconv.Itoa(os.Getpid()))
	assert.Equal(t, cli.ExitOK, code)
	assert.Equal(t, os.Getpid(), out.PID)
	assert.Equal(t, "running", out.State)
	assert.True(t, out.Alive)
	assert.NotZero(t, out.StartTime)
	assert.Len(t, out.BootID, 36)

	z := proctest.StartForeignZombie(t)
	code, out, _ = runProc(t, strconv.Itoa(z.PID))
	assert.Equal(t, cli.ExitOK, code)
	assert.Equal(t, "zombie-leader", out.State)
	assert.True(t, out.Alive)
	assert.Greater(t, out.Tasks, 1)
	z.Release(t)
}

func TestProcMissingPID(t *testing.T) {
	// pid_max bounds every pid; one above it can never have existed.
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	require.NoError(t, err)
	max, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	require.NoError(t, err)
	missing := strconv.Itoa(max + 1)

	code, out, stderr := runProc(t, missing)
	assert.Equal(t, cli.ExitUsage, code)
	assert.Equal(t, "exited", out.State)
	assert.False(t, out.Alive)
	assert.Contains(t, stderr, "does not exist")

	code, _, _ = runProc(t, "--wait", missing)
	assert.Equal(t, cli.ExitOK, code, "waiting for a process that is gone returns at once")
}

func TestProcBadArgs(t *testing.T) {
	for _, args := range [][]string{{}, {"abc"}, {"-5"}, {"0"}, {"1", "2"}, {"--bogus", "1"}} {
		code, _, _ := runProc(t, args...)
		assert.Equal(t, cli.ExitUsage, code, "%q", args)
	}
}

// TestProcWaitNonChild: --wait works on a process that is not this one's
// child (no wait(2), so no ECHILD), returns only once the thread group is
// empty, and times out with exit 3 while it is not.
func TestProcWaitNonChild(t *testing.T) {
	z := proctest.StartForeignZombie(t)
	code, out, stderr := runProc(t, "--wait", "--timeout", "100ms", strconv.Itoa(z.PID))
	assert.Equal(t, cli.ExitTimedOut, code, stderr)
	assert.Equal(t, "zombie-leader", out.State)

	type result struct {
		code int
		out  procOut
	}
	done := make(chan result, 1)
	go func() {
		code, out, _ := runProc(t, "--wait", "--timeout", "30s", strconv.Itoa(z.PID))
		done <- result{code, out}
	}()
	select {
	case r := <-done:
		t.Fatalf("--wait returned %d while the group was alive", r.code)
	case <-time.After(100 * time.Millisecond):
	}
	z.Release(t)
	select {
	case r := <-done:
		assert.Equal(t, cli.ExitOK, r.code)
		assert.Equal(t, "exited", r.out.State)
		assert.False(t, r.out.Alive)
	case <-time.After(10 * time.Second):
		t.Fatal("--wait did not return after the group exited")
	}
}
