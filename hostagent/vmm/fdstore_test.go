package vmm_test

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	"vmflow/testsupport/stacktest"
)

func TestSystemdFDStoreSendsAndRemoves(t *testing.T) {
	n := vmmtest.NewSystemd(t)
	st := vmm.SystemdFDStoreFor(n.Path, nil)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	require.NoError(t, st.Store("vmflow-log.vm1-7", r))
	require.Eventually(t, func() bool { return n.Stored("vmflow-log.vm1-7") != nil }, 5*time.Second, time.Millisecond)
	_, err = w.Write([]byte("guest\n"))
	require.NoError(t, err)
	line, err := bufio.NewReader(n.Stored("vmflow-log.vm1-7")).ReadString('\n')
	require.NoError(t, err)
	assert.Equal(t, "guest\n", line, "the stored descriptor is the same pipe")
	require.NoError(t, st.Remove("vmflow-log.vm1-7"))
	require.Eventually(t, func() bool { return n.Stored("vmflow-log.vm1-7") == nil }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"FDSTORE=1\nFDPOLL=0\nFDNAME=vmflow-log.vm1-7", "FDSTOREREMOVE=1\nFDNAME=vmflow-log.vm1-7"}, n.Messages())
	assert.ErrorIs(t, st.Store("a:b", r), vmm.ErrFDName)
}

// What systemd handed back and no VM took is dropped from the store and
// closed unless kept: a deleted VM's pipe goes, a kept one stays (and can
// still be taken).
func TestFDStorePruneDropsUntaken(t *testing.T) {
	n := vmmtest.NewSystemd(t)
	pipe := func() (*os.File, *os.File) {
		r, w, err := os.Pipe()
		require.NoError(t, err)
		t.Cleanup(func() { r.Close(); w.Close() })
		return r, w
	}
	gone, goneW := pipe()
	kept, _ := pipe()
	taken, _ := pipe()
	st := vmm.SystemdFDStoreFor(n.Path, map[string]*os.File{"vmflow-log.gone-7": gone, "vmflow-log.kept-8": kept, "vmflow-log.live-9": taken})
	require.Equal(t, taken, st.Take("vmflow-log.live-9"))
	dropped, err := st.Prune(func(name string) bool { return name == "vmflow-log.kept-8" })
	require.NoError(t, err)
	assert.Equal(t, []string{"vmflow-log.gone-7"}, dropped)
	require.Eventually(t, func() bool { return len(n.Messages()) > 0 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"FDSTOREREMOVE=1\nFDNAME=vmflow-log.gone-7"}, n.Messages())
	_, err = goneW.Write([]byte("x"))
	assert.ErrorIs(t, err, syscall.EPIPE, "the agent's copy is closed too")
	assert.Equal(t, kept, st.Take("vmflow-log.kept-8"))
}

func TestLogFDInstance(t *testing.T) {
	for name, want := range map[string]string{vmm.LogFDName("vm-1", 1900000007): "vm-1", vmm.LogFDName("a.b_c", 0): "a.b_c",
		"vmflow-log.vm1": "", "vmflow-log.-7": "", "vmflow-log.vm-x": "", "other.vm-7": "", "vmflow-log.vm-99999999999": ""} {
		id, ok := vmm.LogFDInstance(name)
		assert.Equal(t, want != "", ok, name)
		assert.Equal(t, want, id, name)
	}
}

// A restarted agent gets the stored pipe back as LISTEN_FDS (from fd 3,
// named by LISTEN_FDNAMES, for its pid), keeps it close-on-exec so no QEMU
// inherits it, and hides the variables from what it starts.
func TestListenFDsHandBack(t *testing.T) {
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	_, err = w.Write([]byte("written while no agent ran\n"))
	require.NoError(t, err)
	// LISTEN_PID is the pid systemd forked: sh's, kept by its exec.
	cmd := exec.Command("sh", "-c", `LISTEN_PID=$$ exec "$0" -test.run=^$`, os.Args[0])
	cmd.Env = append(os.Environ(), "VMFLOW_VMM_TEST_LISTEN=1", "NOTIFY_SOCKET=/nonexistent", "LISTEN_FDS=1", "LISTEN_FDNAMES=vmflow-log.vm1-7")
	cmd.ExtraFiles = []*os.File{r}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	assert.Equal(t, "line written while no agent ran\ncloexec\nenv unset\n", string(out))
}

// Across an agent restart (its pump gone, a new one attached), the stored
// read end keeps the pipe open: a guest writing its serial port in a loop
// fills the pipe's 64 KiB while no agent runs (without a reader QEMU gets
// EPIPE and the bytes are gone), and the next agent's CaptureLog takes that
// very pipe from the store and writes those bytes into the log.
func TestGuestLogKeptAcrossRestartInFDStore(t *testing.T) {
	bin, spec := vmmtest.SerialFlood(t, "flood")
	n := vmmtest.NewSystemd(t)
	d := proctest.ShortDir(t, "fs")
	cfg := vmm.LaunchConfig{Binary: bin, Spec: spec, ReadyTimeout: 30 * time.Second, Confine: vmmtest.Confine(),
		Paths:   vmm.Paths{QMPSocket: filepath.Join(d, "qemu.sock"), Log: filepath.Join(d, "qemu.log")},
		FDStore: vmm.SystemdFDStoreFor(n.Path, nil)}
	vm, err := vmm.Launch(proctest.Context(t, 30*time.Second), cfg)
	require.NoError(t, err, "log: %s", readFile(cfg.Paths.Log))
	t.Cleanup(func() { _ = proc.Signal(vm.Identity(), syscall.SIGKILL) })
	name := vmm.LogFDName("flood", cfg.Confine.UID)
	require.NotNil(t, n.Stored(name), "stored before the fork")

	// The agent dies: its pump and its read end are gone; QEMU writes on.
	id := vm.Identity()
	require.NoError(t, vm.Close())
	before := logSize(t, cfg.Paths.Log)
	stored := n.Stored(name)
	require.Eventually(t, func() bool {
		q, err := unix.IoctlGetInt(int(stored.Fd()), unix.TIOCINQ) // FIONREAD: the bytes the pipe holds
		return err == nil && q >= 64<<10
	}, 30*time.Second, 5*time.Millisecond, "the pipe fills while no agent reads")

	next, err := vmm.Attach(id, cfg.Paths)
	require.NoError(t, err)
	defer next.Close()
	next.UseFDStore(n.Restarted(), "flood", cfg.Confine.UID)
	require.NoError(t, next.CaptureLog())
	require.Eventually(t, func() bool { return logSize(t, cfg.Paths.Log) >= before+64<<10 }, 30*time.Second, 5*time.Millisecond,
		"what the pipe held while no agent ran reached the log")

	_, err = next.Stop(proctest.Context(t, 30*time.Second), vmm.StopConfig{GracefulTimeout: time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, next.Close())
	require.Eventually(t, func() bool { return n.Stored(name) == nil }, 5*time.Second, time.Millisecond, "removed once drained")
}

// A zombie leader's /proc/<pid>/fd is empty, so a restarted agent cannot
// open its log pipe again there; from the fd store it can. A stand-in QEMU
// whose leader thread has exited while another thread of it prints on is
// launched, the agent dies, and the next one captures that thread's lines
// from the stored pipe (without the store, the capture fails).
func TestZombieLeaderLogFromFDStore(t *testing.T) {
	bin := stacktest.BuildCommand(t, "./hostagent/vmm/vmmtest/escapee", "-X main.zombieLeader=1")
	n := vmmtest.NewSystemd(t)
	d := proctest.ShortDir(t, "zl")
	cfg := vmm.LaunchConfig{Binary: bin, ReadyTimeout: 30 * time.Second, Confine: vmmtest.Confine(),
		Spec:    vmm.VMSpec{Name: "zl", VCPUs: 1, MemoryMiB: 64, Machine: vmm.MachineNone, Accel: vmm.AccelTCG},
		Paths:   vmm.Paths{QMPSocket: filepath.Join(d, "qemu.sock"), Log: filepath.Join(d, "qemu.log")},
		FDStore: vmm.SystemdFDStoreFor(n.Path, nil)}
	vm, err := vmm.Launch(proctest.Context(t, 30*time.Second), cfg)
	require.NoError(t, err, "log: %s", readFile(cfg.Paths.Log))
	id := vm.Identity()
	t.Cleanup(func() { _ = proc.Signal(id, syscall.SIGKILL) })
	require.Eventually(t, func() bool { return strings.HasPrefix(proctest.Status(t, id.PID)["State"], "Z") },
		10*time.Second, 5*time.Millisecond, "the leader is a zombie")
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", id.PID))
	require.NoError(t, err)
	require.Empty(t, fds, "a zombie leader shows no descriptors")
	require.NoError(t, vm.Close()) // the agent dies

	bare, err := vmm.Attach(id, cfg.Paths)
	require.NoError(t, err)
	assert.Error(t, bare.CaptureLog(), "no store: the pipe cannot be opened again")
	require.NoError(t, bare.Close())

	next, err := vmm.Attach(id, cfg.Paths)
	require.NoError(t, err)
	next.UseFDStore(n.Restarted(), "zl", cfg.Confine.UID)
	require.NoError(t, next.CaptureLog())
	before := strings.Count(readFile(cfg.Paths.Log), "escapee tick ")
	require.Eventually(t, func() bool { return strings.Count(readFile(cfg.Paths.Log), "escapee tick ") >= before+10 },
		30*time.Second, 5*time.Millisecond, "the live thread's lines reach the log through the stored pipe")

	_, err = next.Stop(proctest.Context(t, 30*time.Second), vmm.StopConfig{GracefulTimeout: time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, next.Close())
}

func logSize(t *testing.T, path string) int64 {
	t.Helper()
	var total int64
	ms, _ := filepath.Glob(path + "*")
	for _, m := range ms {
		if fi, err := os.Stat(m); err == nil {
			total += fi.Size()
		}
	}
	return total
}

func readFile(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}
