package proc_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
)

// reuseHelperEnv makes the test binary the pid-reuse helper: pid 1 of a new
// pid namespace, where it can hand a dead process's pid to a stranger.
const reuseHelperEnv = "VMFLOW_PROC_REUSE_HELPER"

// reuseResult is what the helper saw, as one JSON line on stdout.
type reuseResult struct {
	Setup          string `json:"setup,omitempty"` // why the helper could not run the scenario
	OrigPID        int    `json:"orig_pid"`
	StrangerPID    int    `json:"stranger_pid"`
	OpenErr        string `json:"open_err"`
	Mismatch       bool   `json:"mismatch"`
	StrangerKilled bool   `json:"stranger_killed"`
}

// TestOpenVerifiesAfterPidfdOpen guards the order in proc.Open (invariant
// 3): pidfd_open first, then the identity check. Between the caller reading
// a record and pidfd_open the recorded process can die and its pid go to a
// stranger; a pidfd opened then is bound to the stranger, and only a check
// made after opening sees it. The test does exactly that, with a real pid
// reuse (ns_last_pid in a pid namespace of its own) at the instant before
// pidfd_open: Open must refuse with ErrIdentityMismatch and the stranger
// must live. Moving the identity check before pidfd_open makes Open return
// a handle on the stranger, which the helper then SIGKILLs: the test fails.
func TestOpenVerifiesAfterPidfdOpen(t *testing.T) {
	proctest.RequiresRoot(t, "a pid namespace and ns_last_pid")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), reuseHelperEnv+"=1")
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS,
		Pdeathsig:  syscall.SIGKILL,
	}
	out, err := cmd.Output()
	require.NoError(t, err, "helper: %s", out)
	var res reuseResult
	require.NoError(t, json.Unmarshal(out, &res), "helper said %q", out)
	require.Empty(t, res.Setup, "the helper could not set the scene")
	require.Equal(t, res.OrigPID, res.StrangerPID, "the stranger got the recorded pid")

	assert.True(t, res.Mismatch, "Open must refuse a pid that a stranger took before pidfd_open: %s", res.OpenErr)
	assert.False(t, res.StrangerKilled, "the stranger was signalled through the handle Open returned")
}

// runReuseHelperIfRequested runs the helper and exits when the environment
// asks for it; it returns otherwise.
func runReuseHelperIfRequested() {
	if os.Getenv(reuseHelperEnv) == "" {
		return
	}
	res := runReuseHelper()
	b, _ := json.Marshal(res)
	fmt.Println(string(b))
	os.Exit(0)
}

func runReuseHelper() (res reuseResult) {
	// Our own /proc: the namespace's pids are not the host's.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		res.Setup = fmt.Sprintf("make mounts private: %v", err)
		return res
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		res.Setup = fmt.Sprintf("mount proc: %v", err)
		return res
	}
	orig, err := proc.Start(exec.Command("sleep", "60"))
	if err != nil {
		res.Setup = fmt.Sprintf("start the recorded process: %v", err)
		return res
	}
	id := orig.Identity()
	res.OrigPID = id.PID
	// Start times count clock ticks (USER_HZ, 10 ms): a stranger started
	// in the original's tick would carry its identity, pid and start time
	// alike, and no check could tell them apart. Let two ticks pass.
	if err := waitUptimePast(id.StartTime+2, 5*time.Second); err != nil {
		res.Setup = err.Error()
		return res
	}
	var stranger *proc.Child
	h, err := proc.Open(id, proc.WithBeforePidfd(func() {
		// The recorded process dies and is reaped; the next fork in this
		// namespace gets its pid.
		_ = unix.Kill(id.PID, unix.SIGKILL)
		<-orig.Done()
		if err := os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(strconv.Itoa(id.PID-1)), 0); err != nil {
			res.Setup = fmt.Sprintf("ns_last_pid: %v", err)
			return
		}
		s, err := proc.Start(exec.Command("sleep", "60"))
		if err != nil {
			res.Setup = fmt.Sprintf("start the stranger: %v", err)
			return
		}
		stranger = s
		res.StrangerPID = s.Identity().PID
	}))
	if err != nil {
		res.OpenErr = err.Error()
	}
	res.Mismatch = errors.Is(err, proc.ErrIdentityMismatch)
	if h != nil && stranger != nil {
		// What a caller does with the handle Open returned: stop "its" VM.
		_ = h.Signal(syscall.SIGKILL)
		h.Close()
		t := time.NewTimer(5 * time.Second)
		defer t.Stop()
		select {
		case <-stranger.Done():
			res.StrangerKilled = true
		case <-t.C:
		}
	}
	return res
}

// waitUptimePast waits until the system has been up for more than ticks
// clock ticks (/proc/uptime, in hundredths of a second as USER_HZ is).
func waitUptimePast(ticks uint64, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		b, err := os.ReadFile("/proc/uptime")
		if err != nil {
			return fmt.Errorf("read uptime: %w", err)
		}
		var sec, cs uint64
		if _, err := fmt.Sscanf(string(b), "%d.%d", &sec, &cs); err != nil {
			return fmt.Errorf("parse uptime %q: %w", b, err)
		}
		if sec*100+cs > ticks {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("uptime %d.%02d never passed tick %d", sec, cs, ticks)
		}
		time.Sleep(time.Millisecond)
	}
}
