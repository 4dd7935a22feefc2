package vmm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"

	"vmflow/internal/errdefs"
)

// A cgroup per VM bounds what a QEMU a guest took over can take from the
// host: memory (the VM's RAM plus QEMU's own), tasks, and CPU against the
// other VMs. Under systemd it is a transient scope in machine.slice
// (libvirt's layout), made over D-Bus; without systemd the agent writes
// cgroupfs itself, v2 where the memory, pids and cpu controllers are there,
// v1 otherwise (this project's test machines: a v1 hybrid whose cgroup2 has
// no controllers, and PID 1 is not systemd).

// Memory beyond guest RAM a QEMU may use: its own heap, device state, I/O
// buffers (cgroupMemoryOverhead), and under TCG the translated-code buffer,
// which QEMU 7.2 caps at 1 GiB and fills as the guest runs new code. Measured
// here (TCG, q35, 2 vCPUs, the test guest booted in a v1 memory cgroup):
// peak memory.max_usage_in_bytes 219 MiB with -m 256 and 234 MiB with
// -m 1024, guest pages, page cache and QEMU together.
const (
	cgroupMemoryOverhead = 256 << 20
	cgroupTCGCodeBuffer  = 1 << 30
	// cgroupCPUWeightPerVCPU is cgroup v2's (and systemd's) default weight,
	// per vCPU: a 4-vCPU VM weighs four 1-vCPU ones.
	cgroupCPUWeightPerVCPU = 100
	cgroupCPUWeightMax     = 10000
)

// CgroupLimits are the limits of a VM's own cgroup.
type CgroupLimits struct {
	MemoryBytes uint64 // memory.max / memory.limit_in_bytes / MemoryMax
	Pids        uint64 // pids.max / TasksMax: the same bound as RLIMIT_NPROC
	CPUWeight   uint64 // cpu.weight / CPUWeight (1-10000); v1 cpu.shares = weight*1024/100
}

// CgroupLimitsFor is spec's cgroup limits.
func CgroupLimitsFor(spec VMSpec) CgroupLimits {
	mem := uint64(spec.MemoryMiB)<<20 + cgroupMemoryOverhead
	if spec.Accel == AccelTCG {
		mem += cgroupTCGCodeBuffer
	}
	w := min(max(uint64(spec.VCPUs), 1)*cgroupCPUWeightPerVCPU, cgroupCPUWeightMax)
	return CgroupLimits{MemoryBytes: mem, Pids: nprocBase + 2*uint64(spec.VCPUs), CPUWeight: w}
}

// CgroupName names the cgroup of instance id's QEMU running as uid: the uid
// makes it unique on the machine (agents have disjoint ranges), the id readable.
func CgroupName(id string, uid uint32) string { return id + "-" + strconv.FormatUint(uint64(uid), 10) }

// Cgroups places a launched QEMU in a cgroup of its own, named by
// CgroupName.
type Cgroups interface {
	// Place moves pid, QEMU right after its fork, into name's cgroup with
	// limits, creating it (or taking it over, after an agent restart).
	Place(ctx context.Context, name string, pid int, l CgroupLimits) error
	// Remove removes name's cgroup once nothing runs in it; a cgroup that
	// does not exist is removed already.
	Remove(ctx context.Context, name string) error
}

// ErrNoCgroups: this host offers no way to make a cgroup per VM.
var ErrNoCgroups = errdefs.Misconfigured.New("no cgroup per VM: neither systemd, cgroup v2 with memory, pids and cpu, nor cgroup v1 with them")

// cgroupV1Controllers are the v1 hierarchies a VM's cgroup is made in.
var cgroupV1Controllers = []string{"memory", "pids", "cpu"}

// CgroupV1 makes VM cgroups in cgroup v1 hierarchies: Root/<controller>/
// Parent/vm-<name>, for memory, pids and cpu. Parent is relative to each
// hierarchy's root; CgroupsFor sets it under the agent's own cgroup.
type CgroupV1 struct {
	Root   string // "/sys/fs/cgroup"
	Parent string // per controller: the agent's own cgroup plus "vmflow"
	// parents, when set, gives each controller its own Parent (the agent
	// sits at different paths in different v1 hierarchies).
	parents map[string]string
}

func (c CgroupV1) dir(ctrl, name string) string {
	parent := c.Parent
	if p, ok := c.parents[ctrl]; ok {
		parent = p
	}
	return filepath.Join(c.Root, ctrl, parent, "vm-"+name)
}

// Place implements Cgroups.
func (c CgroupV1) Place(_ context.Context, name string, pid int, l CgroupLimits) error {
	files := map[string][][2]string{
		"memory": {{"memory.limit_in_bytes", strconv.FormatUint(l.MemoryBytes, 10)}},
		"pids":   {{"pids.max", strconv.FormatUint(l.Pids, 10)}},
		"cpu":    {{"cpu.shares", strconv.FormatUint(l.CPUWeight*1024/100, 10)}},
	}
	for _, ctrl := range cgroupV1Controllers {
		dir := c.dir(ctrl, name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("cgroup v1 %s: %w", ctrl, err)
		}
		for _, kv := range files[ctrl] {
			if err := writeCgroup(dir, kv[0], kv[1]); err != nil {
				return err
			}
		}
		if err := writeCgroup(dir, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// Remove implements Cgroups.
func (c CgroupV1) Remove(_ context.Context, name string) error {
	var errs []error
	for _, ctrl := range cgroupV1Controllers {
		if err := removeCgroup(c.dir(ctrl, name)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// CgroupV2 makes VM cgroups in the unified hierarchy: Root/Parent/vm-<name>,
// with memory, pids and cpu enabled in Parent's subtree.
type CgroupV2 struct {
	Root   string // "/sys/fs/cgroup"
	Parent string // "vmflow"
}

func (c CgroupV2) dir(name string) string { return filepath.Join(c.Root, c.Parent, "vm-"+name) }

// Place implements Cgroups.
func (c CgroupV2) Place(_ context.Context, name string, pid int, l CgroupLimits) error {
	parent := filepath.Join(c.Root, c.Parent)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("cgroup v2: %w", err)
	}
	// Parent holds no process itself (the no-internal-process rule lets
	// its children have controllers only then).
	if err := writeCgroup(parent, "cgroup.subtree_control", "+memory +pids +cpu"); err != nil {
		return err
	}
	dir := c.dir(name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("cgroup v2: %w", err)
	}
	for _, kv := range [][2]string{
		{"memory.max", strconv.FormatUint(l.MemoryBytes, 10)},
		{"memory.swap.max", "0"},
		{"pids.max", strconv.FormatUint(l.Pids, 10)},
		{"cpu.weight", strconv.FormatUint(l.CPUWeight, 10)},
	} {
		if err := writeCgroup(dir, kv[0], kv[1]); err != nil && !(kv[0] == "memory.swap.max" && errors.Is(err, fs.ErrNotExist)) {
			return err
		}
	}
	return writeCgroup(dir, "cgroup.procs", strconv.Itoa(pid))
}

// Remove implements Cgroups.
func (c CgroupV2) Remove(_ context.Context, name string) error { return removeCgroup(c.dir(name)) }

// ScopeConn is the part of go-systemd's D-Bus connection (*dbus.Conn) a
// scope needs; tests stand in for systemd here.
type ScopeConn interface {
	StartTransientUnitContext(ctx context.Context, name, mode string, props []sddbus.Property, ch chan<- string) (int, error)
	StopUnitContext(ctx context.Context, name, mode string, ch chan<- string) (int, error)
}

var _ ScopeConn = (*sddbus.Conn)(nil)

// SystemdScope places each QEMU in a transient scope of its own,
// vmflow-vm-<name>.scope in Slice, as libvirt does with machine.slice:
// systemd makes the cgroup, sets its limits, and removes it when the scope
// is empty. This replaces running QEMU under systemd-run --scope.
type SystemdScope struct {
	Conn  ScopeConn
	Slice string // "machine.slice"
}

// ScopeName is the unit of instance name's QEMU.
func ScopeName(name string) string { return "vmflow-vm-" + name + ".scope" }

// Place implements Cgroups.
func (s SystemdScope) Place(ctx context.Context, name string, pid int, l CgroupLimits) error {
	props := []sddbus.Property{
		sddbus.PropDescription("vmflow VM " + name),
		sddbus.PropSlice(s.Slice),
		sddbus.PropPids(uint32(pid)),
		{Name: "MemoryMax", Value: dbus.MakeVariant(l.MemoryBytes)},
		{Name: "MemorySwapMax", Value: dbus.MakeVariant(uint64(0))},
		{Name: "TasksMax", Value: dbus.MakeVariant(l.Pids)},
		{Name: "CPUWeight", Value: dbus.MakeVariant(l.CPUWeight)},
		// A QEMU killed by the OOM killer ends its own scope only.
		{Name: "OOMPolicy", Value: dbus.MakeVariant("stop")},
	}
	done := make(chan string, 1)
	if _, err := s.Conn.StartTransientUnitContext(ctx, ScopeName(name), "fail", props, done); err != nil {
		return fmt.Errorf("start scope %s: %w", ScopeName(name), err)
	}
	select {
	case r := <-done:
		if r != "done" {
			return fmt.Errorf("start scope %s: job %s", ScopeName(name), r)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("start scope %s: %w", ScopeName(name), ctx.Err())
	}
}

// Remove implements Cgroups: systemd removes an empty scope by itself; a
// scope still there (a stop that raced the exit) is stopped.
func (s SystemdScope) Remove(ctx context.Context, name string) error {
	done := make(chan string, 1)
	if _, err := s.Conn.StopUnitContext(ctx, ScopeName(name), "replace", done); err != nil {
		var de dbus.Error
		if errors.As(err, &de) && de.Name == "org.freedesktop.systemd1.NoSuchUnit" {
			return nil
		}
		return fmt.Errorf("stop scope %s: %w", ScopeName(name), err)
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stop scope %s: %w", ScopeName(name), ctx.Err())
	}
}

// CgroupsFor picks how this host makes a cgroup per VM: a systemd scope when
// systemd runs, cgroup v2 with memory, pids and cpu, else v1 under the agent's.
func CgroupsFor(ctx context.Context, root string, dial func(context.Context) (ScopeConn, error)) (Cgroups, error) {
	if _, err := os.Stat("/run/systemd/system"); err == nil && dial != nil {
		conn, err := dial(ctx)
		if err != nil {
			return nil, fmt.Errorf("cgroups: systemd runs but D-Bus does not answer: %w", err)
		}
		return SystemdScope{Conn: conn, Slice: "machine.slice"}, nil
	}
	if b, err := os.ReadFile(filepath.Join(root, "cgroup.controllers")); err == nil {
		have := strings.Fields(string(b))
		if hasAll(have, "memory", "pids", "cpu") {
			return CgroupV2{Root: root, Parent: "vmflow"}, nil
		}
	}
	own, err := ownV1Cgroups()
	if err != nil {
		return nil, err
	}
	c := CgroupV1{Root: root, parents: map[string]string{}}
	for _, ctrl := range cgroupV1Controllers {
		if _, err := os.Stat(filepath.Join(root, ctrl, "cgroup.procs")); err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrNoCgroups, ctrl, err)
		}
		c.parents[ctrl] = filepath.Join(own[ctrl], "vmflow")
	}
	return c, nil
}

// ownV1Cgroups is this process's cgroup in each v1 hierarchy, from
// /proc/self/cgroup ("4:memory:/a/b"; "2:cpu,cpuacct:/" names two).
func ownV1Cgroups() (map[string]string, error) {
	f, err := os.Open("/proc/self/cgroup")
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	defer f.Close()
	own := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, ctrl := range strings.Split(parts[1], ",") {
			own[ctrl] = parts[2]
		}
	}
	return own, sc.Err()
}

func hasAll(have []string, want ...string) bool {
	for _, w := range want {
		found := false
		for _, h := range have {
			found = found || h == w
		}
		if !found {
			return false
		}
	}
	return true
}

func writeCgroup(dir, file, value string) error {
	if err := os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644); err != nil {
		return fmt.Errorf("cgroup %s: write %s: %w", dir, file, err)
	}
	return nil
}

// removeCgroup removes a cgroup directory (rmdir: the kernel refuses with
// EBUSY while a task is in it); one already gone is fine.
func removeCgroup(dir string) error {
	if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove cgroup %s: %w", dir, err)
	}
	return nil
}
