package vmm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
)

// How every QEMU is confined: exec'd already unprivileged, with
// a uid of its own and no capabilities, under vmflow's seccomp allowlist
// (seccomp.go) with QEMU's own -sandbox stacked on it, with
// an explicit minimal environment, its resources bounded by rlimits, and
// given what it must reach as file descriptors the agent opened (the QMP
// listener) or as a supplementary group (/dev/kvm) or an owner (its VFIO
// group node) — never as paths in the root-only instance directory.

// sandboxOption is QEMU's -sandbox for every launch: a denylist of a few
// families, on top of vmflow's allowlist (seccomp.go). elevateprivileges=deny
// is why QEMU must be exec'd unprivileged: with -runas it kills QEMU with
// SIGSYS (measured with QEMU 7.2).
const sandboxOption = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

// sandboxArgs is the -sandbox option Argv always adds.
func sandboxArgs() []string { return []string{"-sandbox", sandboxOption} }

// QMPFD is the fd number the QMP listening socket has in QEMU: BuildArgv
// reserves it first in a fresh FDTable (so it is the table's first number,
// exec.Cmd.ExtraFiles[0]) and names it in -chardev socket,fd=; Launch fills
// it once the listener is bound.
const QMPFD = firstInheritedFD

// qmpArgs is QMP over the listening socket the agent bound and passed as fd:
// QEMU never sees the socket's path (in the root-only instance directory).
func qmpArgs(fd int) []string {
	return []string{
		"-chardev", "socket,id=qmp,fd=" + strconv.Itoa(fd) + ",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
	}
}

// qemuPath is QEMU's PATH: fixed, not the agent's, so nothing the agent was
// started with reaches QEMU.
const qemuPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// qemuEnv is QEMU's whole environment, PATH and LC_ALL=C: a nil Env would hand
// QEMU the agent's, API and TLS keys included (measured).
func qemuEnv() []string { return []string{"PATH=" + qemuPath, "LC_ALL=C"} }

// ErrNoQEMUUID: a launch without a uid of its own. Unconfined QEMU is not a
// mode: root (uid 0) is refused too.
var ErrNoQEMUUID = errdefs.Misconfigured.New("qemu needs a uid of its own (not 0)")

// ErrMemlockLimit: a VFIO VM needs more locked memory than the agent's own
// hard RLIMIT_MEMLOCK, which its QEMU cannot exceed (raising it needs
// CAP_SYS_RESOURCE, which the agent does not keep): the unit's
// LimitMEMLOCK=infinity is missing.
var ErrMemlockLimit = errdefs.Misconfigured.New("the agent's hard RLIMIT_MEMLOCK is below what a VFIO VM pins (set LimitMEMLOCK=infinity)")

// MemlockLimit is this process's hard RLIMIT_MEMLOCK, which bounds every QEMU
// it starts; 0 when unreadable (nothing refused: the launch says what failed).
func MemlockLimit() uint64 {
	var own unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &own); err != nil {
		return 0
	}
	return own.Max
}

// CheckMemlock refuses a VFIO spec needing more locked memory than hard (0 or
// infinity: no bound), whose launch would fail with only "operation not
// permitted" in qemu.log.
func CheckMemlock(spec VMSpec, hard uint64) error {
	need := memlockFor(spec)
	if len(spec.VFIO) == 0 || hard == 0 || hard == unix.RLIM_INFINITY || need <= hard {
		return nil
	}
	return fmt.Errorf("%w: needs %d MiB, the hard limit is %d MiB", ErrMemlockLimit, need>>20, hard>>20)
}

// ErrKVMAccess: /dev/kvm cannot be opened through its group, so a KVM
// launch, exec'd unprivileged with that group as its only supplementary
// group, would fail. Returned as a *KVMAccessError naming the mode.
var ErrKVMAccess = errdefs.Misconfigured.New("/dev/kvm cannot be opened through its group")

// KVMAccessError says why /dev/kvm is unusable for a confined QEMU. It
// matches ErrKVMAccess with errors.Is.
type KVMAccessError struct {
	Path string
	Mode fs.FileMode // the node's permission bits (0 when it could not be stat'ed)
	GID  uint32
	Err  error // the stat error, if that is what failed
}

func (e *KVMAccessError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("%v: %s: %v", ErrKVMAccess, e.Path, e.Err)
	}
	return fmt.Sprintf("%v: %s has mode %04o (group %d): its group needs read and write (rw) for QEMU, which runs as its own uid with that group",
		ErrKVMAccess, e.Path, uint32(e.Mode.Perm()), e.GID)
}

// Is makes errors.Is(err, ErrKVMAccess), and so its class, true.
func (e *KVMAccessError) Is(target error) bool { return errors.Is(ErrKVMAccess, target) }

// Unwrap returns the stat error, if any.
func (e *KVMAccessError) Unwrap() error { return e.Err }

// DefaultKVMDevice is where CheckKVM looks by default.
const DefaultKVMDevice = "/dev/kvm"

// KVMAccess is /dev/kvm as the agent found it at start: the group a KVM
// QEMU gets as its supplementary group, or why it cannot have one.
type KVMAccess struct {
	GID uint32
	// Err is nil when the group can open the node read-write; otherwise a
	// *KVMAccessError every KVM launch returns (TCG launches go on).
	Err error
}

// CheckKVM stats the KVM node (DefaultKVMDevice when path is empty). It
// never fails the agent: an unusable node is recorded in KVMAccess.Err.
func CheckKVM(path string) KVMAccess {
	if path == "" {
		path = DefaultKVMDevice
	}
	fi, err := os.Stat(path)
	if err != nil {
		return KVMAccess{Err: &KVMAccessError{Path: path, Err: err}}
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return KVMAccess{Err: &KVMAccessError{Path: path, Err: errors.New("no stat data")}}
	}
	k := KVMAccess{GID: st.Gid}
	if fi.Mode().Perm()&0o060 != 0o060 || st.Gid == 0 {
		// A root group would make QEMU a member of group 0: not a
		// supplementary group to hand out.
		k.Err = &KVMAccessError{Path: path, Mode: fi.Mode().Perm(), GID: st.Gid}
	}
	return k
}

// Confinement is what a launch needs to confine QEMU.
type Confinement struct {
	// UID is QEMU's uid and primary gid: the instance's own (its record's
	// qemu_uid). Required, never 0. No passwd entry is needed.
	UID uint32
	// KVM is the agent's CheckKVM result; a KVM launch needs its Err nil.
	KVM KVMAccess
	// Cgroups, when set, places QEMU in a cgroup of its own with limits
	// (CgroupLimitsFor) right after the fork; nil leaves it in the agent's.
	Cgroups Cgroups
	// Jail, when set, runs QEMU in namespaces and a root of its own
	// (jail.go); nil runs it in the host's.
	Jail *Jail
}

// check refuses what Launch must not start.
func (c Confinement) check(accel Accel) error {
	if c.UID == 0 {
		return ErrNoQEMUUID
	}
	if accel == AccelKVM && c.KVM.Err != nil {
		return c.KVM.Err
	}
	return nil
}

// sysProcAttr execs QEMU as c.UID:c.UID with only the KVM node's group under
// KVM (setgroups replaces root's); setting the uid from root leaves CapEff 0.
func (c Confinement) sysProcAttr(accel Accel) *syscall.SysProcAttr {
	groups := []uint32{}
	if accel == AccelKVM {
		groups = append(groups, c.KVM.GID)
	}
	return &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: c.UID, Gid: c.UID, Groups: groups}}
}

// Rlimit values. memlockSmall is the kernel's own default since 5.16:
// enough for QEMU without VFIO, which locks nothing. A vGPU guest's RAM is
// pinned for DMA, so it gets its RAM plus memlockVFIOMargin (libvirt's
// margin for VFIO: ROMs, MSI-X tables, the IOMMU's own mappings).
const (
	memlockSmall      = 8 << 20
	memlockVFIOMargin = 1 << 30
	// nprocBase counts every task of the uid (threads included): QEMU's
	// main, RCU and I/O threads and its thread pool (up to 64 workers) and
	// vhost workers; each vCPU adds a thread and possibly a vhost worker.
	nprocBase = 128

	// fsizeMargin is room above the largest file QEMU may write. QEMU
	// writes no file by path (no -pidfile, its output goes to a pipe), so
	// without a disk this is the whole bound. With a disk the only file it
	// extends is the overlay, up to the base's size (its virtual size) plus
	// qcow2's metadata: qemu-img measure (QEMU 7.2, 64 KiB clusters) gives
	// 320 KiB for 64 MiB, 1.8 MiB for 10 GiB, 16 MiB for 100 GiB and 160 MiB
	// for 1 TiB, under virtual/qcow2MetadataDivisor + fsizeMargin at every
	// size. Past the bound a write fails and QEMU dies of SIGXFSZ: a guest
	// cannot fill the host's disk beyond its own.
	fsizeMargin          = 1 << 20
	qcow2MetadataDivisor = 4096

	// nofile: measured open descriptors of QEMU 7.2 (TCG, q35, virtio-blk
	// on a qcow2 overlay, virtio-net, serial on stdout): 19 with one vCPU,
	// 25 with four; -machine none 11. KVM adds a descriptor and eventfds per
	// vCPU, a VFIO device its device, group and container descriptors and an
	// eventfd per interrupt vector. The base is ten times what was measured;
	// Firecracker's jailer defaults to 2048 for any VM.
	nofileBase    = 256
	nofilePerVCPU = 8
	nofilePerVFIO = 256
)

// Limits are the rlimits a QEMU gets, soft and hard. RLIMIT_CORE is 0
// always: a QEMU core holds guest memory.
type Limits struct {
	Memlock uint64 // RLIMIT_MEMLOCK, bytes
	NProc   uint64 // RLIMIT_NPROC: tasks of QEMU's uid (its own: per VM)
	FSize   uint64 // RLIMIT_FSIZE, bytes: the largest file QEMU may extend
	NoFile  uint64 // RLIMIT_NOFILE
}

// LimitsFor is spec's rlimits. With a disk it stats the base and the
// overlay (the agent's descriptors), so it fails only when they cannot be.
func LimitsFor(spec VMSpec) (Limits, error) {
	l := Limits{
		Memlock: memlockFor(spec),
		NProc:   nprocBase + 2*uint64(spec.VCPUs),
		FSize:   fsizeMargin,
		NoFile:  nofileBase + nofilePerVCPU*uint64(spec.VCPUs) + nofilePerVFIO*uint64(len(spec.VFIO)),
	}
	if d := spec.Disk; d != nil {
		virtual, err := fileSize(d.Base)
		if err != nil {
			return Limits{}, fmt.Errorf("rlimits: base image: %w", err)
		}
		have, err := fileSize(d.Overlay)
		if err != nil {
			return Limits{}, fmt.Errorf("rlimits: overlay: %w", err)
		}
		l.FSize = max(virtual+virtual/qcow2MetadataDivisor, have) + fsizeMargin
	}
	return l, nil
}

// memlockFor is what spec's QEMU may lock: a VFIO VM pins all its RAM for
// DMA, plus a margin.
func memlockFor(spec VMSpec) uint64 {
	if len(spec.VFIO) == 0 {
		return memlockSmall
	}
	return uint64(spec.MemoryMiB)<<20 + memlockVFIOMargin
}

func fileSize(f *os.File) (uint64, error) {
	if f == nil {
		return 0, invalid("no file")
	}
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return uint64(fi.Size()), nil
}

// LimitWrapper is util-linux's prlimit(1) (Essential in Debian): exec'd
// as QEMU's uid, it lowers its own rlimits, soft and hard, and execs QEMU,
// which therefore has them from its first instruction. Go's exec has no
// hook between fork and exec, and prlimit(2) on the child after the fork
// both races QEMU's start-up and needs CAP_SYS_RESOURCE over another uid's
// process (measured here: EPERM for a root without it); lowering one's own
// limits needs no capability. Cost: one exec of a small binary (see
// BenchmarkLaunch). Raising is not possible this way: the agent's own hard
// limit must cover a vGPU guest's RAM (the unit sets LimitMEMLOCK=infinity),
// or the wrapper fails and QEMU never starts (its message in qemu.log).
const LimitWrapper = "prlimit"

// wrapperArgs is the wrapper's argv that runs bin with argv under l.
func wrapperArgs(l Limits, bin string, argv []string) []string {
	both := func(opt string, v uint64) string {
		n := strconv.FormatUint(v, 10)
		return "--" + opt + "=" + n + ":" + n
	}
	return append([]string{LimitWrapper,
		both("memlock", l.Memlock), both("nproc", l.NProc), both("fsize", l.FSize), both("nofile", l.NoFile), both("core", 0),
		"--", bin}, argv...)
}

// closeRangeCloexec is CLOSE_RANGE_CLOEXEC (linux/close_range.h, 5.11).
const closeRangeCloexec = 1 << 2

// closeInheritedOnExec marks every fd above stderr close-on-exec before a
// fork, so no descriptor the agent inherited reaches QEMU; the fds a launch
// names are dup'ed in the child, which clears the flag on the copies only.
func closeInheritedOnExec() error {
	if err := unix.CloseRange(3, ^uint(0), closeRangeCloexec); err != nil {
		return fmt.Errorf("mark inherited descriptors close-on-exec: %w", err)
	}
	return nil
}

// listenQMP listens on the QMP socket at path, in the root-only instance dir,
// and returns it as the file QEMU gets as QMPFD: QEMU only accepts on the fd.
func listenQMP(path string) (*os.File, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("qmp socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: path}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("bind qmp socket %s: %w", path, err)
	}
	if err := unix.Listen(fd, 8); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("listen on qmp socket %s: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// VFIOGroupNode is the VFIO group node (<devRoot>/vfio/<group>) of a sysfs
// device, "" when it has no iommu_group link (the simulator, or gone).
func VFIOGroupNode(devRoot, sysfsdev string) (string, error) {
	target, err := os.Readlink(filepath.Join(sysfsdev, "iommu_group"))
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("iommu group of %s: %w", sysfsdev, err)
	}
	return filepath.Join(devRoot, "vfio", filepath.Base(target)), nil
}

// GiveVFIOGroup makes uid:uid own a VFIO group node while the instance holds
// the claim, for unprivileged QEMU to open; a missing node is nothing to give,
// a symlink is not followed.
func GiveVFIOGroup(node string, uid uint32) error {
	return chownNode(node, int(uid))
}

// TakeBackVFIOGroup returns a VFIO group node to root, so no later holder
// of the instance's uid can open the device.
func TakeBackVFIOGroup(node string) error { return chownNode(node, 0) }

func chownNode(node string, id int) error {
	if node == "" {
		return nil
	}
	if err := os.Lchown(node, id, id); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("chown %s to %d: %w", node, id, err)
	}
	return nil
}
