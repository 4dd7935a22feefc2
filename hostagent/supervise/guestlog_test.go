package supervise

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// floodLog is the state of a guest log and its rotations: their total and
// the newest file's identity and size, checked against the bound.
type floodLog struct {
	total int64
	ino   uint64
	size  int64
}

func readFloodLog(t *testing.T, path string) floodLog {
	t.Helper()
	var l floodLog
	for i, f := range vmm.LogFiles(path) {
		fi, err := os.Stat(f)
		if err != nil {
			continue
		}
		require.LessOrEqual(t, fi.Size(), int64(vmm.DefaultLogMaxBytes), "%s is over one file's bound", f)
		l.total += fi.Size()
		if i == 0 {
			l.ino, l.size = fi.Sys().(*syscall.Stat_t).Ino, fi.Size()
		}
	}
	require.LessOrEqual(t, l.total, int64(vmm.DefaultLogFiles*vmm.DefaultLogMaxBytes), "qemu.log and its rotations are over the bound")
	return l
}

// waitLogGrows waits, checking the bound at every look, until qemu.log has
// taken more than `more` bytes of new output since from. A rotation between
// two looks counts what the old file had left to fill.
func waitLogGrows(t *testing.T, path string, from floodLog, more int64, bound *vmmtest.FloodStall) floodLog {
	t.Helper()
	prev, grown := from, int64(0)
	for {
		l := readFloodLog(t, path)
		switch {
		case l.ino == prev.ino:
			grown += l.size - prev.size
		case prev.ino == 0:
			grown += l.size
		default:
			grown += int64(vmm.DefaultLogMaxBytes) - prev.size + l.size
		}
		prev = l
		if grown > more {
			return l
		}
		if err := bound.Check(grown); err != nil {
			t.Fatalf("%s took %d bytes of new guest output, want %d: %v", path, grown, more, err)
		}
		time.Sleep(20 * time.Millisecond) // polling a file size: there is no event for it
	}
}

// An agent restart does not end the capture: the next agent re-opens QEMU's
// stdout pipe through /proc/<pid>/fd/1 and the log stays bounded. Fails if
// QEMU appends to qemu.log itself (without bound).
func TestReattachKeepsCapturingGuestLog(t *testing.T) {
	e := newEnv(t)
	bin, spec := vmmtest.SerialFlood(t, "flood")
	flood := func(c *Config) {
		c.QEMU = bin
		c.ReadyTimeout = 30 * time.Second
		c.PrepareLaunch = func(context.Context, *store.Locked, *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
			return spec, nil
		}
	}
	e.create("vm1", "never", 0)
	sup := e.newSupervisor(flood)
	_, err := sup.Start(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	res, err := sup.Launch(ctxT(t, 60*time.Second), "vm1")
	require.NoError(t, err)
	paths, err := e.st.Paths("vm1")
	require.NoError(t, err)

	waitLogGrows(t, paths.Log, floodLog{}, vmm.DefaultLogMaxBytes/4, vmmtest.DefaultFloodStall())
	// The agent goes away: nobody reads the pipe.
	require.NoError(t, sup.Close())
	l := readFloodLog(t, paths.Log)

	sup2 := e.newSupervisor(flood)
	rep, err := sup2.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	require.Equal(t, 1, rep.Attached, "%+v", rep)
	st, err := sup2.Status("vm1")
	require.NoError(t, err)
	require.Equal(t, res.Identity, st.Process, "the same QEMU, re-attached")
	assert.True(t, st.Liveness.Alive, "QEMU survived writing to a pipe nobody read (it ignores SIGPIPE)")

	// A whole file's worth of new output: captured, rotated, bounded.
	waitLogGrows(t, paths.Log, l, vmm.DefaultLogMaxBytes, vmmtest.DefaultFloodStall())
}

// Guest output the log cannot take is dropped, never blocking QEMU, and
// counted for the operator: OnGuestLogDropped (the agent's
// vmflow_guest_log_dropped_bytes_total) gets the bytes lost once the VM's
// log pump ends. qemu.log made a directory stands in for a failing disk.
func TestGuestLogDropsAreCounted(t *testing.T) {
	e := newEnv(t)
	bin, spec := vmmtest.SerialFlood(t, "flood")
	dropped := make(chan uint64, 1)
	e.create("vm1", "never", 0)
	paths, err := e.st.Paths("vm1")
	require.NoError(t, err)
	require.NoError(t, os.Mkdir(paths.Log, 0o700))
	sup := e.newSupervisor(func(c *Config) {
		c.QEMU = bin
		c.ReadyTimeout = 30 * time.Second
		c.PrepareLaunch = func(context.Context, *store.Locked, *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
			return spec, nil
		}
		c.OnGuestLogDropped = func(n uint64) { dropped <- n }
	})
	_, err = sup.Start(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	res, err := sup.Launch(ctxT(t, 60*time.Second), "vm1")
	require.NoError(t, err)
	// The guest has written (QEMU's write counter in /proc/<pid>/io) before
	// anything is asked of the count.
	require.Eventually(t, func() bool { return qemuWrote(res.Identity.PID) > 64<<10 }, 30*time.Second, 10*time.Millisecond,
		"the flood guest wrote its serial port")
	st, err := sup.Status("vm1")
	require.NoError(t, err)
	require.True(t, st.Liveness.Alive, "QEMU is not blocked by a log that cannot be written")
	require.NoError(t, proc.Signal(res.Identity, syscall.SIGKILL))
	select {
	case n := <-dropped:
		assert.Greater(t, n, uint64(0))
	case <-time.After(30 * time.Second):
		t.Fatal("OnGuestLogDropped was not called for a VM whose output could not be written")
	}
}

// qemuWrote is the bytes process pid has written so far (wchar of
// /proc/<pid>/io), 0 when it cannot be read.
func qemuWrote(pid int) uint64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "wchar: "); ok {
			n, _ := strconv.ParseUint(v, 10, 64)
			return n
		}
	}
	return 0
}
