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
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
)

// hogEnv makes the re-executed test binary a process that, once told (a
// line on stdin), takes more than a VM's cgroup allows: "mem" touches 1 GiB,
// "fork" starts 64 sleeps, "io:<file>" reads the file and writes it back
// (ioHog). It prints what it got.
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
	if path, ok := strings.CutPrefix(os.Getenv(hogEnv), "io:"); ok {
		ioHog(path)
	}
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

// A launched VM with a disk and I/O limits (q35, the disk's base and
// overlay on this machine's disk): its cgroup holds the bounds on the
// disk's block device (blkio.throttle.* on v1, io.max on v2) and no swap
// (memory.memsw.limit_in_bytes equal to the memory limit on v1), and
// loses them with the cgroup.
func TestLaunchIOLimitsInCgroup(t *testing.T) {
	requiresQEMU(t)
	proctest.RequiresBinary(t, DefaultQEMUImg, "make qemu installs qemu-utils")
	cg := v1OrSkip(t)
	base := dataFile(t, 1<<20)
	dir := filepath.Dir(base.Name())
	ov, _, err := OpenOverlay(ctxT(t, 30*time.Second), OverlayConfig{Path: filepath.Join(dir, "disk.qcow2"),
		Temp: filepath.Join(dir, ".tmp-disk.qcow2"), Base: base, BackingName: base.Name()})
	require.NoError(t, err)
	defer ov.Close()
	devs := ioDevicesOrSkip(t, base, ov)

	cfg := testLaunchConfig(t, "cgroup-io")
	cfg.Spec.Machine = MachineQ35
	cfg.Spec.Disk = &Disk{Base: base, Overlay: ov}
	cfg.Spec.IO = IOLimits{ReadBPS: 1 << 20, WriteBPS: 2 << 20, ReadIOPS: 100, WriteIOPS: 200}
	cfg.Confine.Cgroups = cg
	name := CgroupName(cfg.Spec.Name, cfg.Confine.UID)
	t.Cleanup(func() { // after killOnCleanup's kill, also when a check failed
		assert.Eventually(t, func() bool { return cg.Remove(context.Background(), name) == nil }, 10*time.Second, 10*time.Millisecond)
	})
	vm, err := Launch(ctxT(t, 60*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)
	want := CgroupLimitsFor(cfg.Spec)
	var gone []string
	switch c := cg.(type) {
	case CgroupV1:
		blkio, mem := c.dir("blkio", name), c.dir("memory", name)
		for file, v := range map[string]string{"read_bps": "1048576", "write_bps": "2097152", "read_iops": "100", "write_iops": "200"} {
			var lines []string
			for _, d := range devs {
				lines = append(lines, d+" "+v)
			}
			assert.Equal(t, strings.Join(lines, "\n"), readTrim(t, blkio, "blkio.throttle."+file+"_device"), file)
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", vm.Identity().PID))
		require.NoError(t, err)
		assert.Contains(t, string(b), ":blkio:"+strings.TrimPrefix(blkio, filepath.Join(c.Root, "blkio"))+"\n", "QEMU in its own blkio cgroup")
		limit := strconv.FormatUint(want.MemoryBytes, 10)
		assert.Equal(t, limit, readTrim(t, mem, "memory.limit_in_bytes"))
		if _, err := os.Stat(filepath.Join(mem, "memory.memsw.limit_in_bytes")); err == nil {
			assert.Equal(t, limit, readTrim(t, mem, "memory.memsw.limit_in_bytes"), "memory plus swap = memory: no swap")
		}
		gone = []string{blkio, mem}
	case CgroupV2:
		d := c.dir(name)
		assert.Equal(t, devs[0]+" rbps=1048576 wbps=2097152 riops=100 wiops=200", readTrim(t, d, "io.max"))
		assert.Equal(t, "0", readTrim(t, d, "memory.swap.max"))
		gone = []string{d}
	default:
		t.Fatalf("unexpected %T", cg)
	}

	_, err = vm.Stop(ctxT(t, 30*time.Second), StopConfig{GracefulTimeout: time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, cg.Remove(ctxT(t, 5*time.Second), name))
	for _, d := range gone {
		assert.NoDirExists(t, d)
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

// dataFile is a world-readable file of size zero bytes in a folder of the
// test's, open for reading, its pages on disk (else a direct read of it
// first writes them back, under a write bound).
func dataFile(t *testing.T, size int) *os.File {
	t.Helper()
	path := filepath.Join(t.TempDir(), "data")
	require.NoError(t, os.WriteFile(path, make([]byte, size), 0o644))
	f, err := os.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	require.NoError(t, f.Sync())
	return f
}

// ioDevicesOrSkip is ioDevices, skipping where the test's folder lies on
// no block device (tmpfs, an overlay).
func ioDevicesOrSkip(t *testing.T, files ...*os.File) []string {
	t.Helper()
	devs, err := ioDevices(sysDevBlock, files...)
	if errors.Is(err, ErrIOUnbounded) {
		t.Skip(err)
	}
	require.NoError(t, err)
	return devs
}

// ioHog reads path with O_DIRECT (past the page cache, as QEMU's
// cache.direct=on would), then writes as much again beside it through the
// page cache and fsyncs it (as QEMU does on a guest's flush), and prints how
// long each took.
func ioHog(path string) {
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	buf, err := unix.Mmap(-1, 0, 64<<10, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE) // aligned, as O_DIRECT needs
	must(err)
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_DIRECT, 0)
	must(err)
	start := time.Now()
	var n int
	for {
		k, err := f.Read(buf)
		n += k
		if k == 0 || err != nil {
			break
		}
	}
	fmt.Printf("read %d %d\n", n, time.Since(start).Milliseconds())
	start = time.Now()
	w, err := os.Create(path + ".w")
	must(err)
	for range n / len(buf) {
		_, err = w.Write(buf)
		must(err)
	}
	must(w.Sync())
	fmt.Printf("wrote %d %d\n", n, time.Since(start).Milliseconds())
	os.Exit(0)
}

func must(err error) {
	if err != nil {
		fmt.Println(err)
		os.Exit(2)
	}
}

// A VM's I/O limits bite on this kernel: in a cgroup with 1 MiB/s each
// way on the disk under the test's folder, reading 2 MiB past the page
// cache takes about 2 s, and writing 2 MiB through the page cache then
// fsyncing it about 2 s (on v1 the fsync's writeback is charged to the
// writer; the kernel's own background writeback is not). Without limits
// both take milliseconds here.
func TestCgroupIOLimitsBite(t *testing.T) {
	cg := v1OrSkip(t)
	f := dataFile(t, 2<<20)
	path := f.Name()
	devs := ioDevicesOrSkip(t, f)
	name := fmt.Sprintf("test-%d-io", os.Getpid())
	l := CgroupLimits{MemoryBytes: 1 << 30, Pids: 64, CPUWeight: 100,
		IO: IOLimits{ReadBPS: 1 << 20, WriteBPS: 1 << 20}, IODevices: devs}
	start := time.Now()
	out, err := hog(t, cg, name, "io:"+path, l)
	require.NoError(t, err, out)
	var n, readMS, wroteMS int
	_, err = fmt.Sscanf(out, "read %d %d\nwrote %d %d", &n, &readMS, &n, &wroteMS)
	require.NoError(t, err, out)
	t.Logf("%d bytes at 1 MiB/s: read %d ms, written and fsynced %d ms (all %s)", n, readMS, wroteMS, time.Since(start))
	assert.Equal(t, 2<<20, n)
	assert.GreaterOrEqual(t, readMS, 1500, "reads held to 1 MiB/s")
	assert.GreaterOrEqual(t, wroteMS, 1500, "fsynced writes held to 1 MiB/s")
}

// The block devices of a VM's disk: the whole disk under a file (a
// partition stands for its disk, which is what blk-throttle takes); a file
// on no block device (tmpfs) cannot be bounded.
func TestIODevices(t *testing.T) {
	f, err := os.Open(os.Args[0])
	require.NoError(t, err)
	defer f.Close()
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(int(f.Fd()), &st))
	dev := fmt.Sprintf("%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	if unix.Major(st.Dev) == 0 {
		t.Skipf("the test binary lies on %s, no block device", dev)
	}

	// A fake /sys/dev/block where dev is partition 1 of disk 254:99.
	sysfs := t.TempDir()
	disk := filepath.Join(sysfs, "devices", "block", "vdz")
	require.NoError(t, os.MkdirAll(filepath.Join(disk, "vdz1"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(disk, "dev"), []byte("254:99\n"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(disk, "vdz1", "partition"), []byte("1\n"), 0o644))
	require.NoError(t, os.MkdirAll(filepath.Join(sysfs, "dev", "block"), 0o755))
	require.NoError(t, os.Symlink("../../devices/block/vdz/vdz1", filepath.Join(sysfs, "dev", "block", dev)))
	got, err := ioDevices(filepath.Join(sysfs, "dev", "block"), f, nil, f)
	require.NoError(t, err)
	assert.Equal(t, []string{"254:99"}, got, "the partition's disk, once")

	// The same file against the real sysfs: a whole disk names itself.
	if _, err := os.Stat(filepath.Join(sysDevBlock, dev, "partition")); errors.Is(err, os.ErrNotExist) {
		got, err = ioDevices(sysDevBlock, f)
		require.NoError(t, err)
		assert.Equal(t, []string{dev}, got)
	}

	shm, err := os.CreateTemp("/dev/shm", "vmflow-io")
	if err != nil {
		t.Skip(err)
	}
	defer os.Remove(shm.Name())
	defer shm.Close()
	_, err = ioDevices(sysDevBlock, f, shm)
	assert.ErrorIs(t, err, ErrIOUnbounded, "tmpfs has no block device")
}

func TestIOLimitsTighter(t *testing.T) {
	op := IOLimits{ReadBPS: 100, WriteBPS: 100}
	assert.Equal(t, IOLimits{ReadBPS: 50, WriteBPS: 100, ReadIOPS: 7}, IOLimits{ReadBPS: 50, WriteBPS: 200, ReadIOPS: 7}.Tighter(op),
		"a caller lowers a bound and adds one, never lifts one")
	assert.Equal(t, op, IOLimits{}.Tighter(op))
	assert.True(t, IOLimits{}.Tighter(IOLimits{}).IsZero())
}

// cgroup v2's writer, against a folder tree standing in for the unified
// hierarchy (this machine's cgroup2 has no controllers): io.max per device
// with "max" for an unset bound, +io enabled in the parent only for a VM
// with limits, and no swap.
func TestCgroupV2Writes(t *testing.T) {
	root := t.TempDir()
	c := CgroupV2{Root: root, Parent: "vmflow"}
	l := CgroupLimits{MemoryBytes: 512 << 20, Pids: 130, CPUWeight: 200,
		IO: IOLimits{ReadBPS: 1 << 20, WriteIOPS: 300}, IODevices: []string{"254:0"}}
	require.NoError(t, c.Place(ctxT(t, 5*time.Second), "vm1", 4242, l))
	dir := c.dir("vm1")
	assert.Equal(t, "254:0 rbps=1048576 wbps=max riops=max wiops=300", readTrim(t, dir, "io.max"))
	assert.Equal(t, "0", readTrim(t, dir, "memory.swap.max"))
	assert.Equal(t, "536870912", readTrim(t, dir, "memory.max"))
	assert.Equal(t, "+io", readTrim(t, filepath.Join(root, "vmflow"), "cgroup.subtree_control"), "the last write: +io")
	assert.Equal(t, []string{"8:0 rbps=max wbps=2 riops=max wiops=max", "8:16 rbps=max wbps=2 riops=max wiops=max"},
		v2IOMax(CgroupLimits{IO: IOLimits{WriteBPS: 2}, IODevices: []string{"8:0", "8:16"}}))

	require.NoError(t, c.Place(ctxT(t, 5*time.Second), "vm2", 4243, CgroupLimits{MemoryBytes: 1, Pids: 1, CPUWeight: 1}))
	assert.NoFileExists(t, filepath.Join(c.dir("vm2"), "io.max"), "no limits: io.max untouched")
}

// Under systemd the same bounds are the scope's IO*Max properties, on the
// disk's device node; an unset bound is no property.
func TestSystemdScopeIO(t *testing.T) {
	f := &fakeSystemd{result: "done"}
	s := SystemdScope{Conn: f, Slice: "machine.slice"}
	l := CgroupLimitsFor(VMSpec{Name: "vm1", VCPUs: 1, MemoryMiB: 512, Accel: AccelKVM, IO: IOLimits{ReadBPS: 5, WriteIOPS: 7}})
	l.IODevices = []string{"254:0"}
	require.NoError(t, s.Place(ctxT(t, 5*time.Second), "vm1", 4242, l))
	got := map[string]dbus.Variant{}
	for _, p := range f.started {
		got[p.Name] = p.Value
	}
	for name, want := range map[string]string{"IOReadBandwidthMax": "[{/dev/block/254:0 5}]", "IOWriteIOPSMax": "[{/dev/block/254:0 7}]"} {
		assert.Equal(t, "a(st)", got[name].Signature().String(), name)
		assert.Equal(t, want, fmt.Sprint(got[name].Value()), name)
	}
	assert.NotContains(t, got, "IOWriteBandwidthMax")
	assert.NotContains(t, got, "IOReadIOPSMax")
}

// On v1 memory plus swap follows the memory limit down and up: a cgroup
// taken over after an agent restart with a larger limit takes it (the
// kernel refuses a limit above memsw, so memsw goes first).
func TestCgroupV1MemswFollowsLimit(t *testing.T) {
	cg := v1OrSkip(t)
	c, ok := cg.(CgroupV1)
	if !ok {
		t.Skipf("%T is not cgroup v1", cg)
	}
	cmd := exec.Command("sleep", "60")
	require.NoError(t, cmd.Start())
	name := fmt.Sprintf("test-%d-memsw", os.Getpid())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		assert.Eventually(t, func() bool { return cg.Remove(context.Background(), name) == nil }, 10*time.Second, 10*time.Millisecond)
	})
	dir := c.dir("memory", name)
	for _, mib := range []uint64{256, 512, 128} {
		require.NoError(t, cg.Place(ctxT(t, 5*time.Second), name, cmd.Process.Pid, CgroupLimits{MemoryBytes: mib << 20, Pids: 8, CPUWeight: 100}), "%d MiB", mib)
		want := strconv.FormatUint(mib<<20, 10)
		assert.Equal(t, want, readTrim(t, dir, "memory.limit_in_bytes"))
		if _, err := os.Stat(filepath.Join(dir, "memory.memsw.limit_in_bytes")); err == nil {
			assert.Equal(t, want, readTrim(t, dir, "memory.memsw.limit_in_bytes"))
		}
	}
}
