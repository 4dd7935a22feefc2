package vmm

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/google/uuid"

	"vmflow/internal/errdefs"
)

// Machine is a QEMU machine type vmflow supports.
type Machine string

// The machine types Argv accepts.
const (
	// MachineNone has no devices, no guest memory layout and one CPU slot:
	// it starts in ~60 ms and answers QMP, which makes it the process-level
	// test machine. It has no ACPI, so it ignores system_powerdown.
	MachineNone    Machine = "none"
	MachineQ35     Machine = "q35"
	MachineMicroVM Machine = "microvm"
	MachinePC      Machine = "pc"
)

// Accel is a QEMU accelerator.
type Accel string

// The accelerators Argv accepts.
const (
	AccelKVM Accel = "kvm"
	AccelTCG Accel = "tcg"
)

// Limits Validate enforces. They keep argv sane, not host capacity:
// capacity is the scheduler's business.
const (
	MaxVCPUs     = 256
	MaxMemoryMiB = 4 << 20 // 4 TiB
	// MaxSocketPath is the longest path a Unix socket can bind
	// (sizeof(sun_path) - 1 on Linux).
	MaxSocketPath = 107
)

// VMSpec is everything Argv needs to build QEMU's command line. Every field
// maps to a fixed QEMU option: there is deliberately no way to pass raw
// arguments through.
type VMSpec struct {
	// Name is the guest name (-name guest=NAME). An instance id fits:
	// lower-case letters, digits, '-', '.', '_', at most 63 bytes.
	Name string `json:"name"`
	// UUID is the instance UUID (-uuid); an NVIDIA vGPU guest needs it.
	// Optional.
	UUID string `json:"uuid,omitempty"`
	// VCPUs is the number of virtual CPUs (-smp). MachineNone allows 1.
	VCPUs int `json:"vcpus"`
	// MemoryMiB is guest RAM in MiB (-m).
	MemoryMiB int `json:"memory_mib"`
	// Machine is the machine type (-machine).
	Machine Machine `json:"machine"`
	// Accel is the accelerator (-accel).
	Accel Accel `json:"accel"`
	// Kernel, Initrd and Cmdline boot a kernel directly (-kernel, -initrd,
	// -append). Initrd and Cmdline need Kernel. Kernel and Initrd are files
	// the agent opened (read-only): QEMU inherits them and is given
	// /proc/self/fd/N, never a path it would resolve again. QEMU re-opens
	// that magic link with a permission check on the file's own mode, which
	// is why the agent requires them world-readable (QEMU 7.2's -kernel does
	// not take /dev/fdset/N).
	Kernel  *os.File `json:"-"`
	Initrd  *os.File `json:"-"`
	Cmdline string   `json:"cmdline,omitempty"`
	// Disk is the boot disk, attached as virtio-blk: a read-only raw base
	// under the instance's own qcow2 overlay.
	Disk *Disk `json:"-"`
	// VFIO lists sysfs device paths passed through with
	// -device vfio-pci,sysfsdev=PATH,rombar=0: an mdev
	// (/sys/bus/mdev/devices/<uuid>), an SR-IOV VF or each function of a
	// whole GPU's IOMMU group (/sys/bus/pci/devices/<bdf>). Absolute,
	// clean paths.
	VFIO []string `json:"vfio,omitempty"`
	// SerialToLog connects the first serial port to QEMU's stdout, which
	// Launch sends to the log file.
	SerialToLog bool `json:"serial_to_log,omitempty"`
	// NoReboot makes a guest reboot end QEMU (-no-reboot).
	NoReboot bool `json:"no_reboot,omitempty"`
	// NIC is the guest's network card on a TAP the agent made and opened;
	// nil: no network.
	NIC *NIC `json:"-"`
	// IO bounds the disk's I/O through the VM's cgroup (not argv: QEMU's
	// own throttling would be the guest's to lift, were QEMU taken over).
	IO IOLimits `json:"io,omitzero"`
	// Placement inside the host (the capacity lease's): see Placement.
	Placement Placement `json:"placement,omitzero"`
}

// Placement is where a VM runs on its host. Its CPUs and nodes confine
// QEMU through its cgroup's cpuset (the agent has no CAP_SYS_NICE for
// QEMU's threads and QEMU's sandbox denies it resource control, so
// pinning is the cgroup's); its nodes and hugepages shape guest RAM in
// argv. The zero Placement is none: RAM from anywhere, any CPU.
type Placement struct {
	// CPUs is the cpuset, in the kernel's list format ("0-3,8"); empty:
	// not confined.
	CPUs string `json:"cpus,omitempty"`
	// Nodes are the host NUMA nodes guest RAM is bound to
	// (memory-backend host-nodes, policy=bind) and the cpuset's mems. With
	// more than one, the guest gets one NUMA node per host node, its vCPUs
	// and RAM split evenly, so its topology matches where it runs.
	Nodes []int `json:"nodes,omitempty"`
	// HugepageKiB backs guest RAM with hugepages of that size
	// (memory-backend-memfd,hugetlb=on: the jail has no hugetlbfs); 0:
	// ordinary pages.
	HugepageKiB int `json:"hugepage_kib,omitempty"`
}

// validate refuses a placement QEMU could not take for s.
func (p Placement) validate(s VMSpec) error {
	if p.CPUs != "" && (len(p.CPUs) > maxCPUList || !cpuListRe.MatchString(p.CPUs)) {
		return invalid("placement cpus %q: want a CPU list (0-3,8)", p.CPUs)
	}
	if len(p.Nodes) > maxNodes {
		return invalid("placement: %d NUMA nodes, at most %d", len(p.Nodes), maxNodes)
	}
	for _, n := range p.Nodes {
		if n < 0 || n >= 1024 {
			return invalid("placement node %d: want 0..1023", n)
		}
	}
	return SplitsOver(s.Machine, s.VCPUs, s.MemoryMiB, p.HugepageKiB, max(len(p.Nodes), 1))
}

// SplitsOver refuses (ErrInvalidSpec) a VM of machine m, vcpus and memMiB
// of guest RAM in pages of hugepageKiB (0: ordinary) that QEMU could not
// run over nodes host NUMA nodes, a guest node each: the one rule the
// capacity ledger's placement and the argv both keep.
func SplitsOver(m Machine, vcpus, memMiB, hugepageKiB, nodes int) error {
	if nodes > 1 {
		if m == MachineNone || m == MachineMicroVM {
			return invalid("placement on %d NUMA nodes: machine %s has no guest NUMA", nodes, m)
		}
		if vcpus < nodes || memMiB < nodes {
			return invalid("placement on %d NUMA nodes: %d vCPUs and %d MiB do not split", nodes, vcpus, memMiB)
		}
	}
	switch hugepageKiB {
	case 0:
	case 2048, 1 << 20:
		for _, mib := range split(memMiB, nodes) {
			if mib%(hugepageKiB/1024) != 0 {
				return invalid("memory %d MiB is not whole %d KiB hugepages on each of %d nodes", memMiB, hugepageKiB, nodes)
			}
		}
	default:
		return invalid("hugepage size %d KiB: want 2048 or 1048576", hugepageKiB)
	}
	return nil
}

// maxNodes bounds a VM's NUMA nodes: a host's sockets, not a list to walk.
const maxNodes = 16

// cpuListRe is the kernel's CPU list format, bounded.
var cpuListRe = regexp.MustCompile(`^[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?)*$`)

// maxCPUList bounds a cpuset's text: the kernel takes 100 + 6 bytes per
// CPU; a large host's pool left out of every other cpuset (alternate
// CPUs) needs some KiB.
const maxCPUList = 64 << 10

// HugepageKiB is a spec's hugepages ("2M", "1G") as a page size in KiB; 0
// for none or a size QEMU is not given (admission refuses those).
func HugepageKiB(size string) int {
	switch size {
	case "2M":
		return 2048
	case "1G":
		return 1 << 20
	}
	return 0
}

// IsZero: no placement.
func (p Placement) IsZero() bool { return p.CPUs == "" && len(p.Nodes) == 0 && p.HugepageKiB == 0 }

// NIC is a virtio-net card backed by a TAP descriptor: QEMU gets only the
// descriptor (-netdev tap,fd=N), so in its jail it opens no TAP and sees no
// network of the host's.
type NIC struct {
	// TAP is an open queue of the TAP (/dev/net/tun after TUNSETIFF).
	TAP *os.File
	// MAC is the card's address, unicast, "02:xx:xx:xx:xx:xx".
	MAC string
	// Address is the guest's address with its prefix, for logs; QEMU
	// does not use it.
	Address string
}

// Disk is a boot disk as QEMU gets it: two files the agent opened, passed
// with -add-fd and named /dev/fdset/N in an explicit -blockdev chain, so
// QEMU resolves no path and probes no format.
type Disk struct {
	// Base is the shared image, opened read-only: driver=file with
	// read-only=on under driver=raw. No VM can write it, and its format is
	// never probed (a raw image whose first bytes look like qcow2 stays raw).
	Base *os.File
	// Overlay is the instance's writable qcow2 over Base, opened
	// read-write; its backing is given as the base node (backing=), never
	// taken from the backing file name in its header.
	Overlay *os.File
}

// Close closes the spec's files (the agent's copies; a launched QEMU has
// its own). Already closed files are fine, so every holder may call it.
func (s VMSpec) Close() error {
	errs := []error{closeFile(s.Kernel), closeFile(s.Initrd)}
	if s.Disk != nil {
		errs = append(errs, closeFile(s.Disk.Base), closeFile(s.Disk.Overlay))
	}
	if s.NIC != nil {
		errs = append(errs, closeFile(s.NIC.TAP))
	}
	return errors.Join(errs...)
}

// Paths are the per-instance files QEMU uses.
type Paths struct {
	// QMPSocket is the Unix socket QEMU listens on for QMP, of any length
	// (a longer one than MaxSocketPath is bound and dialled through its
	// directory: viaShortPath).
	QMPSocket string `json:"qmp_socket"`
	// PIDFile is where an older agent had QEMU write its -pidfile. QEMU
	// gets none now (it could not write into the root-only instance
	// directory, and must not): the path is only read (a hint when
	// adopting a QEMU an older agent started) and removed. Optional.
	PIDFile string `json:"pid_file"`
	// Log receives QEMU's stdout and stderr (and the serial console with
	// VMSpec.SerialToLog). Argv does not use it; Launch does.
	Log string `json:"log"`
}

// ErrInvalidSpec is wrapped by every error Validate and Argv return.
var ErrInvalidSpec = errdefs.InvalidInput.New("invalid VM spec")

var (
	nameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
)

func invalid(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidSpec, fmt.Sprintf(format, a...))
}

// checkPath accepts an absolute, clean path without bytes that could end an
// argv element or a line in QEMU's option parser.
func checkPath(field, p string) error {
	switch {
	case p == "":
		return invalid("%s: empty path", field)
	case !filepath.IsAbs(p):
		return invalid("%s: %q is not absolute", field, p)
	case filepath.Clean(p) != p:
		return invalid("%s: %q is not clean (want %q)", field, p, filepath.Clean(p))
	case strings.ContainsAny(p, "\x00\n\r"):
		return invalid("%s: %q contains a NUL or newline", field, p)
	}
	return nil
}

// Validate checks the spec on its own. Argv calls it.
func (s VMSpec) Validate() error {
	if !nameRe.MatchString(s.Name) {
		return invalid("name %q: want 1-63 of [a-z0-9._-], starting with a letter or digit", s.Name)
	}
	if s.UUID != "" {
		u, err := uuid.Parse(s.UUID)
		// uuid.Parse also accepts urn: and {} forms; QEMU wants the plain one.
		if err != nil || u.String() != strings.ToLower(s.UUID) {
			return invalid("uuid %q: want the canonical 8-4-4-4-12 form", s.UUID)
		}
	}
	switch s.Machine {
	case MachineNone, MachineQ35, MachineMicroVM, MachinePC:
	default:
		return invalid("machine %q: want none, q35, microvm or pc", s.Machine)
	}
	switch s.Accel {
	case AccelKVM, AccelTCG:
	default:
		return invalid("accel %q: want kvm or tcg", s.Accel)
	}
	if s.VCPUs < 1 || s.VCPUs > MaxVCPUs {
		return invalid("vcpus %d: want 1..%d", s.VCPUs, MaxVCPUs)
	}
	if s.MemoryMiB < 1 || s.MemoryMiB > MaxMemoryMiB {
		return invalid("memory %d MiB: want 1..%d", s.MemoryMiB, MaxMemoryMiB)
	}
	if s.Initrd != nil && s.Kernel == nil {
		return invalid("initrd without kernel")
	}
	if s.Cmdline != "" {
		if s.Kernel == nil {
			return invalid("cmdline without kernel")
		}
		if strings.ContainsAny(s.Cmdline, "\x00\n\r") {
			return invalid("cmdline contains a NUL or newline")
		}
	}
	if s.Disk != nil && s.Disk.Base == nil {
		return invalid("disk without a base image")
	}
	if err := s.Placement.validate(s); err != nil {
		return err
	}
	if s.NIC != nil {
		if s.NIC.TAP == nil {
			return invalid("nic without a tap")
		}
		hw, err := net.ParseMAC(s.NIC.MAC)
		if err != nil || len(hw) != 6 || hw[0]&1 != 0 || hw.String() != s.NIC.MAC {
			return invalid("nic mac %q: want a unicast 02:xx:xx:xx:xx:xx", s.NIC.MAC)
		}
	}
	seen := map[string]bool{}
	for i, p := range s.VFIO {
		if err := checkPath(fmt.Sprintf("vfio[%d]", i), p); err != nil {
			return err
		}
		if seen[p] {
			return invalid("vfio[%d]: %q listed twice", i, p)
		}
		seen[p] = true
	}
	switch s.Machine {
	case MachineNone:
		// -machine none has one CPU slot, no buses, no serial port and
		// nothing to boot: QEMU refuses "-smp 2" and would silently ignore
		// the rest.
		if s.VCPUs != 1 {
			return invalid("machine none supports exactly 1 vcpu, not %d", s.VCPUs)
		}
		if s.Kernel != nil || s.Disk != nil || len(s.VFIO) > 0 || s.SerialToLog || s.NIC != nil {
			return invalid("machine none takes no kernel, disk, vfio device, nic or serial port")
		}
	case MachineMicroVM:
		// microvm has no firmware boot path worth supporting and no PCI bus
		// unless asked for; vmflow uses it only for direct kernel boot.
		if s.Kernel == nil {
			return invalid("machine microvm needs a kernel")
		}
		if len(s.VFIO) > 0 {
			return invalid("machine microvm has no PCI bus for vfio devices")
		}
	}
	return nil
}

// Validate checks the paths: absolute and clean.
func (p Paths) Validate() error {
	if err := checkPath("qmp socket", p.QMPSocket); err != nil {
		return err
	}
	if p.PIDFile != "" {
		if err := checkPath("pid file", p.PIDFile); err != nil {
			return err
		}
	}
	if p.Log != "" {
		if err := checkPath("log", p.Log); err != nil {
			return err
		}
	}
	return nil
}

// procSelfFD names inherited fd n for an option that takes only a path.
func procSelfFD(n int) string { return "/proc/self/fd/" + strconv.Itoa(n) }

// Node names of the disk's -blockdev chain, and the device's id.
const (
	nodeBaseFile    = "base-file"
	nodeBase        = "base"
	nodeOverlayFile = "overlay-file"
	nodeDisk        = "disk0"
	// DiskDeviceID is the virtio-blk device's id (QOM path
	// /machine/peripheral/vda).
	DiskDeviceID = "vda"
)

// diskArgs attaches d as a -blockdev chain, raw read-only base under a qcow2
// overlay, over one fdset per file. QEMU dups from an fdset the fd whose mode
// matches its open, so the base's O_RDONLY fd can never become writable.
func diskArgs(d *Disk, m Machine, fds *FDTable) []string {
	// Each fdset's id is its fd's number, unique by construction.
	base := fds.Add(d.Base)
	overlay := fds.Add(d.Overlay)
	dev := "virtio-blk-pci"
	if m == MachineMicroVM {
		dev = "virtio-blk-device" // virtio-mmio: microvm has no PCI bus by default
	}
	return []string{
		"-add-fd", fmt.Sprintf("fd=%d,set=%d", base, base),
		"-add-fd", fmt.Sprintf("fd=%d,set=%d", overlay, overlay),
		"-blockdev", fmt.Sprintf("driver=file,node-name=%s,filename=/dev/fdset/%d,read-only=on", nodeBaseFile, base),
		"-blockdev", fmt.Sprintf("driver=raw,node-name=%s,file=%s,read-only=on", nodeBase, nodeBaseFile),
		"-blockdev", fmt.Sprintf("driver=file,node-name=%s,filename=/dev/fdset/%d", nodeOverlayFile, overlay),
		"-blockdev", fmt.Sprintf("driver=qcow2,node-name=%s,file=%s,backing=%s", nodeDisk, nodeOverlayFile, nodeBase),
		"-device", fmt.Sprintf("%s,drive=%s,id=%s", dev, nodeDisk, DiskDeviceID),
	}
}

// NetdevID is the TAP backend's id; the card is its only user.
const NetdevID = "net0"

// nicArgs attaches n as virtio-net on its TAP descriptor: on PCI for q35
// and pc, with no option ROM (romfile=: iPXE's ROM is not in the jail and a
// direct kernel boot never runs it), on virtio-mmio for microvm.
func nicArgs(n *NIC, m Machine, fds *FDTable) []string {
	dev := "virtio-net-pci,netdev=" + NetdevID + ",mac=" + n.MAC + ",romfile="
	if m == MachineMicroVM {
		dev = "virtio-net-device,netdev=" + NetdevID + ",mac=" + n.MAC
	}
	return []string{"-netdev", fmt.Sprintf("tap,fd=%d,id=%s", fds.Add(n.TAP), NetdevID), "-device", dev}
}

// memoryBackendID names guest RAM's backends: vmflow-mem<guest node>.
const memoryBackendID = "vmflow-mem"

// memoryArgs shape guest RAM by spec's placement: none without one; one
// backend bound to the host node (the machine's memory-backend), or one per
// host node with a guest NUMA node each (-numa node,memdev), vCPUs and RAM
// split evenly. Hugepages come from a memfd (hugetlb=on), which needs no
// hugetlbfs mount in the jail.
func memoryArgs(spec VMSpec) []string {
	p := spec.Placement
	if len(p.Nodes) == 0 && p.HugepageKiB == 0 {
		return nil
	}
	nodes := p.Nodes
	if len(nodes) == 0 {
		nodes = []int{-1} // hugepages from any node
	}
	backend := func(id string, mib int, host int) string {
		kind := "memory-backend-ram"
		if p.HugepageKiB > 0 {
			kind = "memory-backend-memfd"
		}
		o := fmt.Sprintf("%s,id=%s,size=%dM", kind, id, mib)
		if p.HugepageKiB > 0 {
			o += fmt.Sprintf(",hugetlb=on,hugetlbsize=%dK", p.HugepageKiB)
		}
		if p.HugepageKiB > 0 {
			// Taken at start: a node short of pages fails the launch
			// rather than SIGBUS the guest later (reservations of a
			// shared memfd are not per node).
			o += ",prealloc=on"
		}
		if host >= 0 {
			o += fmt.Sprintf(",host-nodes=%d,policy=bind", host)
		}
		return o
	}
	if len(nodes) == 1 {
		id := memoryBackendID + "0"
		return []string{"-object", backend(id, spec.MemoryMiB, nodes[0]), "-machine", "memory-backend=" + id}
	}
	var a []string
	mibs, cpus := split(spec.MemoryMiB, len(nodes)), split(spec.VCPUs, len(nodes))
	first := 0
	for i, host := range nodes {
		id := memoryBackendID + strconv.Itoa(i)
		a = append(a, "-object", backend(id, mibs[i], host),
			"-numa", fmt.Sprintf("node,nodeid=%d,cpus=%d-%d,memdev=%s", i, first, first+cpus[i]-1, id))
		first += cpus[i]
	}
	return a
}

// split is n in k parts as even as they go, the larger first.
func split(n, k int) []int {
	out := make([]int, k)
	for i := range out {
		out[i] = n / k
		if i < n%k {
			out[i]++
		}
	}
	return out
}

// optValue escapes a value for QEMU's option parser (QemuOpts), where a
// comma separates options and ",," is a literal comma.
func optValue(v string) string { return strings.ReplaceAll(v, ",", ",,") }

// Argv returns QEMU's arguments (without argv[0]) for spec: BuildArgv with a
// fresh FDTable. Pure: it touches no file.
func Argv(spec VMSpec, paths Paths) ([]string, error) {
	return BuildArgv(spec, paths, &FDTable{})
}

// BuildArgv returns QEMU's arguments for spec, adding its files to fds in argv
// order after a number reserved for the QMP listener, so fds.Files() are the
// ExtraFiles that make those numbers real. It touches no file.
func BuildArgv(spec VMSpec, paths Paths, fds *FDTable) ([]string, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	if err := paths.Validate(); err != nil {
		return nil, err
	}
	if spec.Disk != nil && spec.Disk.Overlay == nil {
		// Only the overlay is writable: without one the guest would get
		// no disk it can write, and never the base.
		return nil, invalid("disk without an overlay")
	}
	a := make([]string, 0, 32+2*len(spec.VFIO))
	a = append(a,
		"-name", "guest="+spec.Name,
		"-machine", string(spec.Machine),
		"-accel", string(spec.Accel),
		// No default devices, no /etc/qemu config, no window: the argv is
		// the whole machine.
		"-nodefaults", "-no-user-config", "-display", "none",
	)
	// QMP on the listener Launch binds and passes (the table's first
	// number in a fresh table: QMPFD), no -pidfile (QEMU writes nothing by
	// path), and always the sandbox.
	a = append(a, qmpArgs(fds.Reserve())...)
	a = append(a, sandboxArgs()...)
	a = append(a, "-m", strconv.Itoa(spec.MemoryMiB), "-smp", strconv.Itoa(spec.VCPUs))
	a = append(a, memoryArgs(spec)...)
	if spec.UUID != "" {
		a = append(a, "-uuid", strings.ToLower(spec.UUID))
	}
	if spec.Kernel != nil {
		a = append(a, "-kernel", procSelfFD(fds.Add(spec.Kernel)))
	}
	if spec.Initrd != nil {
		a = append(a, "-initrd", procSelfFD(fds.Add(spec.Initrd)))
	}
	if spec.Cmdline != "" {
		a = append(a, "-append", spec.Cmdline)
	}
	if spec.Disk != nil {
		a = append(a, diskArgs(spec.Disk, spec.Machine, fds)...)
	}
	if spec.NIC != nil {
		a = append(a, nicArgs(spec.NIC, spec.Machine, fds)...)
	}
	for _, p := range spec.VFIO {
		// rombar=0: the guest sees no option ROM BAR, so it cannot read a
		// VBIOS image through QEMU nor write one back to a card the next
		// tenant gets. Guests of vmflow boot by -kernel, not the card's ROM.
		a = append(a, "-device", "vfio-pci,sysfsdev="+optValue(p)+",rombar=0")
	}
	if spec.SerialToLog {
		// stdio rather than file:PATH: the file chardev truncates unless
		// append=on, and stdout already is the log. signal=off: a ^C on a
		// terminal must never reach QEMU through its serial port.
		a = append(a, "-chardev", "stdio,id=serial0,signal=off", "-serial", "chardev:serial0")
	}
	if spec.NoReboot {
		a = append(a, "-no-reboot")
	}
	return a, nil
}
