package vmm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
	"golang.org/x/sys/unix"

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
	// MemoryBytes is memory.max / memory.limit_in_bytes / MemoryMax, and
	// with no swap beside it: memory.swap.max 0, v1's
	// memory.memsw.limit_in_bytes equal to it, MemorySwapMax 0.
	MemoryBytes uint64
	Pids        uint64 // pids.max / TasksMax: the same bound as RLIMIT_NPROC
	CPUWeight   uint64 // cpu.weight / CPUWeight (1-10000); v1 cpu.shares = weight*1024/100
	// IO bounds the VM's disk I/O on IODevices (io.max, v1's
	// blkio.throttle.*, systemd's IO*Max); zero: unbounded.
	IO IOLimits
	// IODevices are the whole block devices ("major:minor") holding the
	// VM's disk files (ioDevices); empty without a disk or without IO.
	IODevices []string
	// CPUs and Mems are the cpuset (cpuset.cpus and cpuset.mems, systemd's
	// AllowedCPUs and AllowedMemoryNodes) in the kernel's list format;
	// both empty: no cpuset of its own, the agent's.
	CPUs, Mems string
}

// confined: l has a cpuset.
func (l CgroupLimits) confined() bool { return l.CPUs != "" || l.Mems != "" }

// IOLimits bound a VM's disk I/O, per block device; 0 leaves a bound off.
type IOLimits struct {
	ReadBPS   uint64 `json:"read_bps,omitempty"`
	WriteBPS  uint64 `json:"write_bps,omitempty"`
	ReadIOPS  uint64 `json:"read_iops,omitempty"`
	WriteIOPS uint64 `json:"write_iops,omitempty"`
}

// ioBound is one of IOLimits' bounds under the name a cgroup interface
// gives it.
type ioBound struct {
	name string
	v    uint64
}

// named is l's bounds with their names: read bytes/s, write bytes/s, read
// and write operations/s, in that order.
func (l IOLimits) named(rbps, wbps, riops, wiops string) []ioBound {
	return []ioBound{{rbps, l.ReadBPS}, {wbps, l.WriteBPS}, {riops, l.ReadIOPS}, {wiops, l.WriteIOPS}}
}

// IsZero: no bound is set.
func (l IOLimits) IsZero() bool { return l == IOLimits{} }

// Tighter is the stricter of l and o, bound by bound (0 is no bound): a
// caller's limit may lower the operator's, never lift it.
func (l IOLimits) Tighter(o IOLimits) IOLimits {
	t := func(a, b uint64) uint64 {
		if a == 0 || (b != 0 && b < a) {
			return b
		}
		return a
	}
	return IOLimits{ReadBPS: t(l.ReadBPS, o.ReadBPS), WriteBPS: t(l.WriteBPS, o.WriteBPS),
		ReadIOPS: t(l.ReadIOPS, o.ReadIOPS), WriteIOPS: t(l.WriteIOPS, o.WriteIOPS)}
}

// MemoryLimitMiB is all a VM with memoryMiB of guest RAM under accel may
// use of ordinary memory, QEMU's own included: its cgroup's memory limit,
// and what it holds of its host's capacity ledger. One definition, two
// users. Guest RAM in hugepages (hugepageKiB > 0) comes from the host's
// pool, which the memory cgroup does not charge (unless cgroup2 is
// mounted with memory_hugetlb_accounting): then only QEMU's own counts.
func MemoryLimitMiB(memoryMiB int, accel Accel, hugepageKiB int) uint64 {
	memoryMiB = max(memoryMiB, 0)
	mem := uint64(memoryMiB) + cgroupMemoryOverhead>>20
	if hugepageKiB > 0 && !HugetlbInMemcg() {
		mem -= uint64(memoryMiB)
	}
	if accel == AccelTCG {
		mem += cgroupTCGCodeBuffer >> 20
	}
	return mem
}

// HugetlbInMemcg reports whether the memory cgroup charges hugetlb pages
// (cgroup2 mounted with memory_hugetlb_accounting, Linux 6.6+), read once
// from /proc/self/mountinfo.
var HugetlbInMemcg = sync.OnceValue(func() bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return true // cannot tell: count guest RAM, the safe side
	}
	for _, line := range strings.Split(string(b), "\n") {
		_, post, ok := strings.Cut(line, " - ")
		if f := strings.Fields(post); ok && len(f) >= 3 && f[0] == "cgroup2" && slices.Contains(strings.Split(f[2], ","), "memory_hugetlb_accounting") {
			return true
		}
	}
	return false
})

// CgroupLimitsFor is spec's cgroup limits, without IODevices (see
// cgroupLimitsOf).
func CgroupLimitsFor(spec VMSpec) CgroupLimits {
	mem := MemoryLimitMiB(spec.MemoryMiB, spec.Accel, spec.Placement.HugepageKiB) << 20
	w := min(max(uint64(spec.VCPUs), 1)*cgroupCPUWeightPerVCPU, cgroupCPUWeightMax)
	var mems []string
	for _, n := range spec.Placement.Nodes {
		mems = append(mems, strconv.Itoa(n))
	}
	return CgroupLimits{MemoryBytes: mem, Pids: nprocBase + 2*uint64(spec.VCPUs), CPUWeight: w, IO: spec.IO,
		CPUs: spec.Placement.CPUs, Mems: strings.Join(mems, ",")}
}

// cgroupLimitsOf is CgroupLimitsFor with the block devices under spec's
// disk, when it has I/O limits: ErrIOUnbounded when a disk file lies on no
// block device the kernel can throttle.
func cgroupLimitsOf(spec VMSpec) (CgroupLimits, error) {
	l := CgroupLimitsFor(spec)
	if l.IO.IsZero() || spec.Disk == nil {
		return l, nil
	}
	devs, err := ioDevices(sysDevBlock, spec.Disk.Base, spec.Disk.Overlay)
	if err != nil {
		return CgroupLimits{}, err
	}
	l.IODevices = devs
	return l, nil
}

// sysDevBlock names every block device by major:minor.
const sysDevBlock = "/sys/dev/block"

// ioDevices are the whole block devices holding files, each once, as
// "major:minor". blk-throttle (v1 and v2 alike) takes a whole disk and
// refuses a partition (ENODEV), so a partition stands for its disk; a file
// system on no block device (tmpfs, overlayfs, NFS, btrfs's anonymous
// device numbers) cannot be bounded at all.
func ioDevices(sysfs string, files ...*os.File) ([]string, error) {
	var devs []string
	for _, f := range files {
		if f == nil {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			return nil, fmt.Errorf("disk I/O limits: stat %s: %w", f.Name(), err)
		}
		dev := fmt.Sprintf("%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
		node := filepath.Join(sysfs, dev)
		if unix.Major(st.Dev) == 0 {
			return nil, fmt.Errorf("%w: %s lies on %s, no block device", ErrIOUnbounded, f.Name(), dev)
		}
		if _, err := os.Stat(filepath.Join(node, "partition")); err == nil {
			// /sys/dev/block/8:1 -> ../../devices/.../block/sda/sda1: the
			// disk is the partition's parent folder.
			target, err := filepath.EvalSymlinks(node)
			if err != nil {
				return nil, fmt.Errorf("disk I/O limits: %w", err)
			}
			b, err := os.ReadFile(filepath.Join(filepath.Dir(target), "dev"))
			if err != nil {
				return nil, fmt.Errorf("disk I/O limits: the disk of partition %s: %w", dev, err)
			}
			dev = strings.TrimSpace(string(b))
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("disk I/O limits: %w", err)
		} else if _, err := os.Stat(node); err != nil {
			return nil, fmt.Errorf("%w: %s lies on %s: %w", ErrIOUnbounded, f.Name(), dev, err)
		}
		if !slices.Contains(devs, dev) {
			devs = append(devs, dev)
		}
	}
	return devs, nil
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

var (
	// ErrNoCgroups: this host offers no way to make a cgroup per VM.
	ErrNoCgroups = errdefs.Misconfigured.New("no cgroup per VM: neither systemd, cgroup v2 with memory, pids and cpu, nor cgroup v1 with them")
	// ErrIOUnbounded: a VM has disk I/O limits this host cannot apply (its
	// disk on no block device, or no io/blkio controller): refused rather
	// than run without the bound its caller or operator set.
	ErrIOUnbounded = errdefs.Misconfigured.New("disk I/O limits cannot be applied")
)

// cgroupV1Controllers are the v1 hierarchies a VM's cgroup is made in.
var cgroupV1Controllers = []string{"memory", "pids", "cpu"}

// CgroupV1 makes VM cgroups in cgroup v1 hierarchies: Root/<controller>/
// Parent/vm-<name>, for memory, pids and cpu, and blkio when the VM has I/O
// limits. Parent is relative to each hierarchy's root; CgroupsFor sets it
// under the agent's own cgroup.
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
		"pids": {{"pids.max", strconv.FormatUint(l.Pids, 10)}},
		"cpu":  {{"cpu.shares", strconv.FormatUint(l.CPUWeight*1024/100, 10)}},
	}
	ctrls := cgroupV1Controllers
	if len(l.IODevices) > 0 && !l.IO.IsZero() {
		if _, err := os.Stat(filepath.Join(c.Root, cgroupV1IO, "cgroup.procs")); err != nil {
			return fmt.Errorf("%w: no blkio hierarchy: %w", ErrIOUnbounded, err)
		}
		ctrls = append(slices.Clone(ctrls), cgroupV1IO)
		files[cgroupV1IO] = v1Throttle(l)
	}
	if l.confined() {
		if _, err := os.Stat(filepath.Join(c.Root, cgroupV1CPUSet, "cgroup.procs")); err != nil {
			return fmt.Errorf("%w: no cpuset hierarchy for a VM placed on CPUs %q, nodes %q: %w", ErrNoCgroups, l.CPUs, l.Mems, err)
		}
		ctrls = append(slices.Clone(ctrls), cgroupV1CPUSet)
	}
	for _, ctrl := range ctrls {
		dir := c.dir(ctrl, name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("cgroup v1 %s: %w", ctrl, err)
		}
		if ctrl == cgroupV1CPUSet {
			// Before cgroup.procs: a v1 cpuset with no CPUs or mems takes
			// no task (ENOSPC).
			if err := c.v1CPUSet(dir, l); err != nil {
				return err
			}
		}
		if ctrl == "memory" {
			if err := v1Memory(dir, l.MemoryBytes); err != nil {
				return err
			}
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

// cgroupV1IO is the v1 hierarchy of the I/O limits, made only for a VM
// that has them (and only required then).
const cgroupV1IO = "blkio"

// cgroupV1CPUSet is the v1 hierarchy of a VM's placement, made only for a
// VM that has one.
const cgroupV1CPUSet = "cpuset"

// v1CPUSet sets the cpuset of dir, a VM's cgroup: every folder above it up
// to the hierarchy's root that MkdirAll made has none yet (a v1 cpuset
// starts empty unless its parent says clone_children), so each gets its
// parent's, from the top down; then dir gets l's, its parent's where l
// leaves one empty.
func (c CgroupV1) v1CPUSet(dir string, l CgroupLimits) error {
	root := filepath.Join(c.Root, cgroupV1CPUSet)
	rel, err := filepath.Rel(root, dir)
	if err != nil || strings.HasPrefix(rel, "..") {
		return fmt.Errorf("cgroup v1 cpuset: %s is not under %s", dir, root)
	}
	parts := strings.Split(rel, string(filepath.Separator))
	at := root
	for i, part := range parts {
		parent := at
		at = filepath.Join(at, part)
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			want := ""
			if i == len(parts)-1 {
				want = map[string]string{"cpuset.cpus": l.CPUs, "cpuset.mems": l.Mems}[f]
			} else if have, err := readCgroup(at, f); (err != nil && !errors.Is(err, fs.ErrNotExist)) || have != "" {
				// A file not there is a folder not yet given one (only a
				// stand-in hierarchy: the kernel makes them with it).
				if err != nil {
					return err
				}
				continue
			}
			if want == "" {
				if want, err = readCgroup(parent, f); err != nil {
					return err
				}
			}
			if err := writeCgroup(at, f, want); err != nil {
				return err
			}
		}
	}
	return nil
}

// readCgroup is a cgroup file's value, trimmed.
func readCgroup(dir, file string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		return "", fmt.Errorf("cgroup %s: read %s: %w", dir, file, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// v1Memory sets a v1 memory cgroup's limit and, where swap accounting is
// on (memory.memsw.* exists), memory plus swap to the same value: no swap,
// as memory.swap.max 0 and MemorySwapMax 0 say on v2 and under systemd. The
// kernel wants memsw >= limit at every step, so a limit raised on a cgroup
// taken over (after an agent restart) goes memsw first.
func v1Memory(dir string, bytes uint64) error {
	v := strconv.FormatUint(bytes, 10)
	err := writeCgroup(dir, "memory.limit_in_bytes", v)
	if errors.Is(err, unix.EINVAL) {
		if err := writeCgroup(dir, "memory.memsw.limit_in_bytes", v); err != nil {
			return err
		}
		return writeCgroup(dir, "memory.limit_in_bytes", v)
	}
	if err != nil {
		return err
	}
	if err := writeCgroup(dir, "memory.memsw.limit_in_bytes", v); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// v1Throttle is l's blkio.throttle.* lines, one write per device and
// bound ("8:0 1048576"); a bound of 0 is not written (0 would remove it).
func v1Throttle(l CgroupLimits) [][2]string {
	var out [][2]string
	for _, b := range l.IO.named("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device",
		"blkio.throttle.read_iops_device", "blkio.throttle.write_iops_device") {
		if b.v == 0 {
			continue
		}
		for _, d := range l.IODevices {
			out = append(out, [2]string{b.name, d + " " + strconv.FormatUint(b.v, 10)})
		}
	}
	return out
}

// v2IOMax is l's io.max lines, one per device ("8:0 rbps=1048576 wbps=max
// riops=max wiops=max").
func v2IOMax(l CgroupLimits) []string {
	var kv []string
	for _, b := range l.IO.named("rbps", "wbps", "riops", "wiops") {
		v := "max"
		if b.v != 0 {
			v = strconv.FormatUint(b.v, 10)
		}
		kv = append(kv, b.name+"="+v)
	}
	var out []string
	for _, d := range l.IODevices {
		out = append(out, d+" "+strings.Join(kv, " "))
	}
	return out
}

// Remove implements Cgroups.
func (c CgroupV1) Remove(_ context.Context, name string) error {
	var errs []error
	for _, ctrl := range append(slices.Clone(cgroupV1Controllers), cgroupV1IO, cgroupV1CPUSet) {
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
	io := len(l.IODevices) > 0 && !l.IO.IsZero()
	if io {
		// Only a VM with I/O limits needs the io controller, so a host
		// without it runs the others.
		if err := writeCgroup(parent, "cgroup.subtree_control", "+io"); err != nil {
			return fmt.Errorf("%w: %w", ErrIOUnbounded, err)
		}
	}
	if l.confined() {
		// cpuset in every ancestor's subtree, from the root down (v2
		// enables a controller for a folder's children only where its
		// parent has it).
		for at := c.Root; ; {
			if err := writeCgroup(at, "cgroup.subtree_control", "+cpuset"); err != nil {
				return fmt.Errorf("cgroup v2 cpuset: %w", err)
			}
			if at == parent {
				break
			}
			rel, _ := filepath.Rel(at, parent)
			at = filepath.Join(at, strings.Split(rel, string(filepath.Separator))[0])
		}
	}
	dir := c.dir(name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("cgroup v2: %w", err)
	}
	files := [][2]string{
		{"memory.max", strconv.FormatUint(l.MemoryBytes, 10)},
		{"memory.swap.max", "0"},
		{"pids.max", strconv.FormatUint(l.Pids, 10)},
		{"cpu.weight", strconv.FormatUint(l.CPUWeight, 10)},
	}
	if l.CPUs != "" {
		files = append(files, [2]string{"cpuset.cpus", l.CPUs})
	}
	if l.Mems != "" {
		files = append(files, [2]string{"cpuset.mems", l.Mems})
	}
	for _, kv := range files {
		if err := writeCgroup(dir, kv[0], kv[1]); err != nil && !(kv[0] == "memory.swap.max" && errors.Is(err, fs.ErrNotExist)) {
			return err
		}
	}
	if io {
		for _, line := range v2IOMax(l) {
			if err := writeCgroup(dir, "io.max", line); err != nil {
				return err
			}
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
	if len(l.IODevices) > 0 {
		props = append(props, scopeIO(l)...)
	}
	for _, b := range []struct{ name, list string }{{"AllowedCPUs", l.CPUs}, {"AllowedMemoryNodes", l.Mems}} {
		if b.list == "" {
			continue
		}
		mask, err := cpuMask(b.list)
		if err != nil {
			return fmt.Errorf("scope %s: %s: %w", ScopeName(name), b.name, err)
		}
		props = append(props, sddbus.Property{Name: b.name, Value: dbus.MakeVariant(mask)})
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

// cpuMask is a CPU (or node) list as systemd's AllowedCPUs takes it over
// D-Bus: a byte array, bit i of byte i/8 for CPU i.
func cpuMask(list string) ([]byte, error) {
	var mask []byte
	for _, r := range strings.Split(list, ",") {
		lo, hi, ranged := strings.Cut(r, "-")
		a, err := strconv.Atoi(lo)
		b := a
		if ranged {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a || b >= 1<<14 {
			return nil, fmt.Errorf("%q is not a CPU list", list)
		}
		for i := a; i <= b; i++ {
			for len(mask) <= i/8 {
				mask = append(mask, 0)
			}
			mask[i/8] |= 1 << (i % 8)
		}
	}
	return mask, nil
}

// scopeIO is l's I/O bounds as a scope's IO*Max properties, a(st) of
// (device node, value); systemd resolves the node to its major:minor.
func scopeIO(l CgroupLimits) []sddbus.Property {
	type devMax struct {
		Path string
		Max  uint64
	}
	var props []sddbus.Property
	for _, b := range l.IO.named("IOReadBandwidthMax", "IOWriteBandwidthMax", "IOReadIOPSMax", "IOWriteIOPSMax") {
		if b.v == 0 {
			continue
		}
		var v []devMax
		for _, d := range l.IODevices {
			v = append(v, devMax{"/dev/block/" + d, b.v})
		}
		props = append(props, sddbus.Property{Name: b.name, Value: dbus.MakeVariant(v)})
	}
	return props
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
	for _, ctrl := range []string{cgroupV1IO, cgroupV1CPUSet} {
		if _, err := os.Stat(filepath.Join(root, ctrl, "cgroup.procs")); err == nil {
			c.parents[ctrl] = filepath.Join(own[ctrl], "vmflow")
		}
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
