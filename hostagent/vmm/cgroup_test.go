package vmm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
)

// hogEnv makes the re-executed test binary a process that, once told (a
// line on stdin), takes more than a VM's cgroup allows: "mem" touches 1 GiB,
// "fork" starts 64 sleeps. It prints what it got.
const hogEnv = "VMFLOW_VMM_TEST_HOG"

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == JailSetupCommand {
		// The jail's setup stage, as the agent's binary runs it.
		os.Exit(JailMain(os.Args[2:]))
	}
	if os.Getenv(listenEnv) != "" {
		runListenHelper()
	}
	runStage(os.Getenv(stageEnv))
	switch os.Getenv(hogEnv) {
	case "":
		os.Exit(m.Run())
	case "mem":
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		var chunks [][]byte
		for i := 1; i <= 64; i++ {
			c := make([]byte, 16<<20)
			for j := 0; j < len(c); j += 4096 {
				c[j] = 1
			}
			chunks = append(chunks, c)
			fmt.Printf("mib %d\n", i*16)
		}
		fmt.Printf("kept %d chunks\n", len(chunks)) // held to the end: all of it is charged at once
		os.Exit(0)
	case "fork":
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		var started []*exec.Cmd
		for range 64 {
			c := exec.Command("sleep", "60")
			if c.Start() == nil {
				started = append(started, c)
			}
		}
		fmt.Printf("started %d\n", len(started))
		for _, c := range started { // reaped here: no orphan is left to a PID 1 that never reaps
			_ = c.Process.Kill()
			_ = c.Wait()
		}
		os.Exit(0)
	}
}

// hog starts the test binary as kind, placed by cg as instance name with l,
// and returns what it printed once it exited, and how it exited.
func hog(t *testing.T, cg Cgroups, name, kind string, l CgroupLimits) (string, error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), hogEnv+"="+kind)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	var out strings.Builder
	cmd.Stdout = &out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		// rmdir fails with EBUSY until the killed tasks have left.
		assert.Eventually(t, func() bool { return cg.Remove(context.Background(), name) == nil }, 10*time.Second, 10*time.Millisecond)
	})
	require.NoError(t, cg.Place(ctxT(t, 10*time.Second), name, cmd.Process.Pid, l))
	_, err = stdin.Write([]byte("go\n"))
	require.NoError(t, err)
	err = cmd.Wait()
	return out.String(), err
}

func v1OrSkip(t *testing.T) Cgroups {
	t.Helper()
	requiresRoot(t)
	cg, err := CgroupsFor(ctxT(t, 5*time.Second), "/sys/fs/cgroup", nil)
	if errors.Is(err, ErrNoCgroups) {
		t.Skip(err)
	}
	require.NoError(t, err)
	return cg
}

// A VM's cgroup holds a process to its memory and pid limits: past the
// memory limit it is killed (the OOM killer, inside its own cgroup), past
// the pid limit its forks fail. Measured on cgroupfs here (v1 hybrid; v2
// where the host has it).
func TestCgroupLimitsHold(t *testing.T) {
	cg := v1OrSkip(t)
	name := fmt.Sprintf("test-%d", os.Getpid())

	out, err := hog(t, cg, name+"-mem", "mem", CgroupLimits{MemoryBytes: 256 << 20, Pids: 64, CPUWeight: 100})
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "the hog must not finish: %s", out)
	ws := ee.Sys().(syscall.WaitStatus)
	assert.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "killed by the OOM killer: %v", ws)
	assert.NotContains(t, out, "mib 1024")

	out, err = hog(t, cg, name+"-fork", "fork", CgroupLimits{MemoryBytes: 1 << 30, Pids: 24, CPUWeight: 100})
	require.NoError(t, err)
	var started int
	_, _ = fmt.Sscanf(out, "started %d", &started)
	assert.Less(t, started, 24, "no more tasks than pids.max: %s", out)
}

// A launched QEMU sits in its own cgroup, with the limits CgroupLimitsFor
// gives its spec; a failed launch, or Remove after the exit, leaves no
// cgroup behind.
func TestLaunchInCgroup(t *testing.T) {
	requiresQEMU(t)
	cg := v1OrSkip(t)
	cfg := testLaunchConfig(t, "cgroup")
	cfg.Confine.Cgroups = cg
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)
	want := CgroupLimitsFor(cfg.Spec)

	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", vm.Identity().PID))
	require.NoError(t, err)
	dirs := map[string]string{}
	switch c := cg.(type) {
	case CgroupV1:
		for _, ctrl := range cgroupV1Controllers {
			dirs[ctrl] = c.dir(ctrl, CgroupName(cfg.Spec.Name, cfg.Confine.UID))
			assert.Contains(t, string(b), ":"+strings.TrimPrefix(dirs[ctrl], filepath.Join(c.Root, ctrl))+"\n", "QEMU in its own %s cgroup", ctrl)
		}
		assert.Equal(t, strconv.FormatUint(want.MemoryBytes, 10), readTrim(t, dirs["memory"], "memory.limit_in_bytes"))
		assert.Equal(t, strconv.FormatUint(want.Pids, 10), readTrim(t, dirs["pids"], "pids.max"))
		assert.Equal(t, strconv.FormatUint(want.CPUWeight*1024/100, 10), readTrim(t, dirs["cpu"], "cpu.shares"))
	case CgroupV2:
		dirs["unified"] = c.dir(CgroupName(cfg.Spec.Name, cfg.Confine.UID))
		assert.Contains(t, string(b), "0::"+strings.TrimPrefix(dirs["unified"], c.Root)+"\n")
		assert.Equal(t, strconv.FormatUint(want.MemoryBytes, 10), readTrim(t, dirs["unified"], "memory.max"))
		assert.Equal(t, strconv.FormatUint(want.Pids, 10), readTrim(t, dirs["unified"], "pids.max"))
	default:
		t.Fatalf("unexpected %T", cg)
	}

	_, err = vm.Stop(ctxT(t, 30*time.Second), StopConfig{GracefulTimeout: time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, cg.Remove(ctxT(t, 5*time.Second), CgroupName(cfg.Spec.Name, cfg.Confine.UID)))
	for ctrl, dir := range dirs {
		assert.NoDirExists(t, dir, ctrl)
	}

	// A launch that fails after the placement removes its cgroup.
	bad := testLaunchConfig(t, "cgroup-bad")
	bad.Confine.Cgroups = cg
	bad.OnStarted = func(proc.Identity) error { return errors.New("refused") }
	_, err = Launch(ctxT(t, 30*time.Second), bad)
	require.ErrorIs(t, err, ErrHook)
	bad.OnStarted = nil
	bad.ReadyTimeout = 100 * time.Millisecond
	bad.Binary = "sleep" // forks, is placed, never answers QMP
	_, err = Launch(ctxT(t, 30*time.Second), bad)
	require.Error(t, err)
	if c, ok := cg.(CgroupV1); ok {
		assert.NoDirExists(t, c.dir("memory", CgroupName(bad.Spec.Name, bad.Confine.UID)))
	}
}

func readTrim(t *testing.T, dir, file string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, file))
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}

// fakeSystemd stands in for systemd's D-Bus API at the one boundary the
// scope crosses: it records the jobs and answers them.
type fakeSystemd struct {
	started []sddbus.Property
	name    string
	result  string
	stopErr error
	stopped []string
}

func (f *fakeSystemd) StartTransientUnitContext(_ context.Context, name, mode string, props []sddbus.Property, ch chan<- string) (int, error) {
	if mode != "fail" {
		return 0, fmt.Errorf("mode %s", mode)
	}
	f.name, f.started = name, props
	ch <- f.result
	return 1, nil
}

func (f *fakeSystemd) StopUnitContext(_ context.Context, name, _ string, ch chan<- string) (int, error) {
	if f.stopErr != nil {
		return 0, f.stopErr
	}
	f.stopped = append(f.stopped, name)
	ch <- "done"
	return 2, nil
}

// Under systemd a VM's QEMU goes into a transient scope in machine.slice
// with the same limits, asked for in one StartTransientUnit.
func TestSystemdScope(t *testing.T) {
	f := &fakeSystemd{result: "done"}
	s := SystemdScope{Conn: f, Slice: "machine.slice"}
	l := CgroupLimitsFor(VMSpec{Name: "vm1", VCPUs: 2, MemoryMiB: 512, Accel: AccelKVM})
	require.NoError(t, s.Place(ctxT(t, 5*time.Second), "vm1", 4242, l))
	assert.Equal(t, "vmflow-vm-vm1.scope", f.name)
	got := map[string]any{}
	for _, p := range f.started {
		got[p.Name] = p.Value.Value()
	}
	assert.Equal(t, "machine.slice", got["Slice"])
	assert.Equal(t, uint64(512<<20+cgroupMemoryOverhead), got["MemoryMax"])
	assert.Equal(t, uint64(nprocBase+4), got["TasksMax"])
	assert.Equal(t, uint64(200), got["CPUWeight"])
	assert.Equal(t, uint64(0), got["MemorySwapMax"])
	assert.Equal(t, []uint32{4242}, got["PIDs"], "QEMU is the scope's process")
	f.result = "failed"
	assert.ErrorContains(t, s.Place(ctxT(t, 5*time.Second), "vm1", 4242, l), "job failed")

	require.NoError(t, s.Remove(ctxT(t, 5*time.Second), "vm1"))
	assert.Equal(t, []string{"vmflow-vm-vm1.scope"}, f.stopped)
	f.stopErr = dbus.Error{Name: "org.freedesktop.systemd1.NoSuchUnit"}
	assert.NoError(t, s.Remove(ctxT(t, 5*time.Second), "vm1"), "an empty scope is gone already")
	f.stopErr = errors.New("bus gone")
	assert.Error(t, s.Remove(ctxT(t, 5*time.Second), "vm1"))
}

func TestCgroupLimitsFor(t *testing.T) {
	assert.Equal(t, CgroupLimits{MemoryBytes: 128<<20 + 256<<20 + 1<<30, Pids: 130, CPUWeight: 100},
		CgroupLimitsFor(VMSpec{VCPUs: 1, MemoryMiB: 128, Accel: AccelTCG}), "TCG: plus its code buffer")
	assert.Equal(t, CgroupLimits{MemoryBytes: 4096<<20 + 256<<20, Pids: 128 + 256, CPUWeight: 10000},
		CgroupLimitsFor(VMSpec{VCPUs: 128, MemoryMiB: 4096, Accel: AccelKVM}), "weight capped at 10000")
}
