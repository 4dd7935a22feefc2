package vmm

import (
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"time"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/proc/proctest"
)

// seccompRet runs the assembled filters on one syscall as the kernel
// would, and returns the strictest answer (the kernel's precedence: the
// action's high half as a signed number, lowest first). struct
// seccomp_data is read in native-endian 32-bit words, the BPF VM reads
// big-endian ones: each word is written big-endian at its native offset.
func seccompRet(t *testing.T, vms []*bpf.VM, arch uint32, nr uint32, args ...uint64) uint32 {
	t.Helper()
	var data [64]byte
	binary.BigEndian.PutUint32(data[0:], nr)
	binary.BigEndian.PutUint32(data[4:], arch)
	for i, a := range args {
		off := 16 + 8*i
		binary.BigEndian.PutUint32(data[off:], uint32(a))       // low word first (little-endian u64)
		binary.BigEndian.PutUint32(data[off+4:], uint32(a>>32)) // then the high one
	}
	best := uint32(unix.SECCOMP_RET_ALLOW)
	for _, vm := range vms {
		r, err := vm.Run(data[:])
		require.NoError(t, err)
		ret := uint32(r)
		if int32(ret&unix.SECCOMP_RET_ACTION_FULL) < int32(best&unix.SECCOMP_RET_ACTION_FULL) {
			best = ret
		}
	}
	return best
}

// seccompVMs are the allowlist's filters, ready to run.
func seccompVMs(t *testing.T) []*bpf.VM {
	progs, err := qemuSeccompPrograms()
	require.NoError(t, err)
	var vms []*bpf.VM
	for _, prog := range progs {
		raw, err := bpf.Assemble(prog)
		require.NoError(t, err)
		require.Less(t, len(raw), 4096, "BPF_MAXINSNS")
		vm, err := bpf.NewVM(prog)
		require.NoError(t, err)
		vms = append(vms, vm)
	}
	return vms
}

// The allowlist decides as documented, checked against the program itself
// (bpf and perf_event_open are closed on this machine by its sysctls
// anyway, so only the filter can show they are killed): the dangerous
// syscalls kill, anything unlisted is EPERM, ioctls pass only by request
// number (KVM's type, VFIO's range, the TAP's reads and offloads), clone
// asking for a namespace is refused, clone3 is ENOSYS, and a foreign
// architecture or the x32 ABI kills.
func TestSeccompAllowlistDecides(t *testing.T) {
	vm := seccompVMs(t)

	const (
		kill   = unix.SECCOMP_RET_KILL_PROCESS
		allow  = unix.SECCOMP_RET_ALLOW
		eperm  = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
		enosys = unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)
		x86    = unix.AUDIT_ARCH_X86_64
	)
	threadFlags := uint64(unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES | unix.CLONE_SIGHAND | unix.CLONE_THREAD |
		unix.CLONE_SYSVSEM | unix.CLONE_SETTLS | unix.CLONE_PARENT_SETTID | unix.CLONE_CHILD_CLEARTID)
	for _, tc := range []struct {
		name string
		arch uint32
		nr   uint32
		args []uint64
		want uint32
	}{
		{"bpf", x86, unix.SYS_BPF, nil, kill},
		{"perf_event_open", x86, unix.SYS_PERF_EVENT_OPEN, nil, kill},
		{"userfaultfd", x86, unix.SYS_USERFAULTFD, nil, kill},
		{"io_uring_enter", x86, unix.SYS_IO_URING_ENTER, nil, kill},
		{"io_uring_register", x86, unix.SYS_IO_URING_REGISTER, nil, kill},
		{"keyctl", x86, unix.SYS_KEYCTL, nil, kill},
		{"add_key", x86, unix.SYS_ADD_KEY, nil, kill},
		{"kexec_load", x86, unix.SYS_KEXEC_LOAD, nil, kill},
		{"finit_module", x86, unix.SYS_FINIT_MODULE, nil, kill},
		{"ptrace", x86, unix.SYS_PTRACE, nil, kill},
		{"process_vm_writev", x86, unix.SYS_PROCESS_VM_WRITEV, nil, kill},
		{"unshare", x86, unix.SYS_UNSHARE, []uint64{unix.CLONE_NEWUSER}, kill},
		{"io_uring_setup: QEMU probes it", x86, unix.SYS_IO_URING_SETUP, nil, eperm},
		{"socket", x86, unix.SYS_SOCKET, []uint64{unix.AF_INET, unix.SOCK_STREAM, 0}, eperm},
		{"connect", x86, unix.SYS_CONNECT, nil, eperm},
		{"unlisted: mount", x86, unix.SYS_MOUNT, nil, eperm},
		{"read", x86, unix.SYS_READ, nil, allow},
		{"ppoll", x86, unix.SYS_PPOLL, nil, allow},
		{"seccomp: QEMU's -sandbox", x86, unix.SYS_SECCOMP, nil, allow},
		{"prctl: QEMU's -sandbox", x86, unix.SYS_PRCTL, []uint64{unix.PR_SET_NO_NEW_PRIVS, 1}, allow},
		{"clone a thread", x86, unix.SYS_CLONE, []uint64{threadFlags}, allow},
		{"clone the fork child", x86, unix.SYS_CLONE, []uint64{unix.CLONE_VFORK | unix.CLONE_VM | unix.CLONE_PIDFD | uint64(unix.SIGCHLD)}, allow},
		{"clone a user namespace", x86, unix.SYS_CLONE, []uint64{unix.CLONE_NEWUSER | uint64(unix.SIGCHLD)}, eperm},
		{"clone a network namespace", x86, unix.SYS_CLONE, []uint64{threadFlags | unix.CLONE_NEWNET}, eperm},
		{"clone3: flags unreadable, glibc falls back", x86, unix.SYS_CLONE3, nil, enosys},
		{"ioctl KVM_RUN", x86, unix.SYS_IOCTL, []uint64{5, 0xAE80}, allow},
		{"ioctl KVM_GET_REGS (_IOR)", x86, unix.SYS_IOCTL, []uint64{5, 0x8090AE81}, allow},
		{"ioctl KVM_SET_USER_MEMORY_REGION (_IOW)", x86, unix.SYS_IOCTL, []uint64{5, 0x4020AE46}, allow},
		{"ioctl VFIO_DEVICE_GET_INFO", x86, unix.SYS_IOCTL, []uint64{5, 0x3B6B}, allow},
		{"ioctl iommufd", x86, unix.SYS_IOCTL, []uint64{5, 0x3B80}, eperm},
		{"ioctl vhost (0xAF)", x86, unix.SYS_IOCTL, []uint64{5, 0x4008AF00}, eperm},
		{"ioctl TUNGETIFF", x86, unix.SYS_IOCTL, []uint64{5, unix.TUNGETIFF}, allow},
		{"ioctl TUNGETIFF sign-extended", x86, unix.SYS_IOCTL, []uint64{5, 0xffffffff00000000 | unix.TUNGETIFF}, allow},
		{"ioctl TUNSETOFFLOAD", x86, unix.SYS_IOCTL, []uint64{5, unix.TUNSETOFFLOAD}, allow},
		{"ioctl TUNSETVNETHDRSZ", x86, unix.SYS_IOCTL, []uint64{5, unix.TUNSETVNETHDRSZ}, allow},
		{"ioctl TCGETS", x86, unix.SYS_IOCTL, []uint64{1, unix.TCGETS}, allow},
		{"ioctl SIOCSIFHWADDR", x86, unix.SYS_IOCTL, []uint64{5, unix.SIOCSIFHWADDR}, eperm},
		{"ioctl TUNSETOWNER", x86, unix.SYS_IOCTL, []uint64{5, unix.TUNSETOWNER}, eperm},
		{"ioctl TUNSETPERSIST", x86, unix.SYS_IOCTL, []uint64{5, unix.TUNSETPERSIST}, eperm},
		{"ioctl TUNSETIFF", x86, unix.SYS_IOCTL, []uint64{5, unix.TUNSETIFF}, eperm},
		{"ioctl TUNSETIFF, high bits set", x86, unix.SYS_IOCTL, []uint64{5, 0x100000000 | unix.TUNSETIFF}, eperm},
		{"ioctl TUNSETLINK", x86, unix.SYS_IOCTL, []uint64{5, unix.TUNSETLINK}, eperm},
		{"ioctl TIOCSTI", x86, unix.SYS_IOCTL, []uint64{1, unix.TIOCSTI}, eperm},
		{"i386 (int 0x80)", unix.AUDIT_ARCH_I386, 3, nil, kill},
		{"x32 read", x86, 0x40000000, nil, kill},
	} {
		assert.Equal(t, tc.want, seccompRet(t, vm, tc.arch, tc.nr, tc.args...), tc.name)
	}
}

// A refused ioctl stays refused whatever its request's high word (the
// kernel reads the request as 32 bits): go-seccomp-bpf v1.6.0, when an
// argument check failed, went on comparing that argument word with the
// next syscall numbers, so a high word equal to an allowed number (1:
// write) let TUNSETIFF through. Every high word up to past the last
// syscall number, for each refused request.
func TestSeccompIoctlHighWordNoBypass(t *testing.T) {
	vm := seccompVMs(t)
	for _, req := range []uint64{unix.TUNSETIFF, unix.TUNSETOWNER, unix.TUNSETPERSIST, unix.SIOCSIFHWADDR, unix.TIOCSTI, 0x3B80} {
		for hi := uint64(0); hi < 600; hi++ {
			got := seccompRet(t, vm, unix.AUDIT_ARCH_X86_64, unix.SYS_IOCTL, 5, hi<<32|req)
			require.Equal(t, unix.SECCOMP_RET_ERRNO|uint32(unix.EPERM), got, "ioctl 0x%x", hi<<32|req)
		}
	}
	for hi := uint64(0); hi < 600; hi++ {
		got := seccompRet(t, vm, unix.AUDIT_ARCH_X86_64, unix.SYS_CLONE, hi<<32|unix.CLONE_NEWUSER)
		require.Equal(t, unix.SECCOMP_RET_ERRNO|uint32(unix.EPERM), got, "clone 0x%x", hi<<32|unix.CLONE_NEWUSER)
	}
}

// The lists are what the filter's policy holds: every name known to the
// library for x86_64, none both allowed and killed.
func TestSeccompListsDisjoint(t *testing.T) {
	killed := map[string]bool{}
	for _, n := range seccompKilled {
		killed[n] = true
	}
	for _, n := range seccompAllowed {
		assert.False(t, killed[n], "%s both allowed and killed", n)
	}
	ps := qemuSeccompPolicies()
	for _, p := range ps {
		_, err := p.Assemble()
		require.NoError(t, err)
	}
	assert.Equal(t, seccomp.ActionErrno, ps[0].DefaultAction, "the allowlist refuses what it does not name")
}

// An escaped QEMU (the stand-in, launched through the production path with
// a TAP descriptor, as a VM with a network is) cannot set up an io_uring or
// a userfaultfd, nor re-address, re-own, persist or re-attach its TAP:
// jailed, where the setup stage installs the allowlist, and unjailed
// (--jail=false), where the fork inherits it.
func TestSeccompClosesEscapedQEMU(t *testing.T) {
	requiresQEMU(t)
	requiresRoot(t)
	bin := buildEscapee(t, "-X main.syscalls=1")
	for _, jail := range []bool{true, false} {
		name := map[bool]string{true: "jailed", false: "unjailed"}[jail]
		t.Run(name, func(t *testing.T) {
			tap := testTAP(t)
			cfg := testLaunchConfig(t, "seccomp")
			if jail {
				cfg = jailed(t, cfg)
			}
			cfg.Binary = bin
			cfg.Spec.Machine = MachineQ35
			cfg.Spec.NIC = &NIC{TAP: tap, MAC: "02:00:00:00:00:01"}
			vm, err := Launch(ctxT(t, 30*time.Second), cfg)
			require.NoError(t, err, "log: %s", readLog(cfg.Paths.Log))
			killOnCleanup(t, vm)
			lines := escapeeLines(t, cfg.Paths.Log)
			t.Logf("%v", lines)
			for _, try := range []string{"io_uring_setup", "tap SIOCSIFHWADDR", "tap TUNSETOWNER", "tap TUNSETPERSIST", "tap TUNSETIFF"} {
				assert.Equal(t, "refused: operation not permitted", lines[try], try)
			}
			assert.Equal(t, "refused: signal: bad system call", lines["userfaultfd"], "killed by the filter")
			assert.Equal(t, "2", lines["seccomp filters"], "vmflow's two filters (the stand-in has no -sandbox of its own)")
		})
	}
}

// testTAP is an open queue of a TAP made in a network namespace of the
// test's own, as the agent opens one for a VM with a network.
func testTAP(t *testing.T) *os.File {
	t.Helper()
	ns := nettest.Namespace(t)
	var tap *os.File
	require.NoError(t, nettest.In(t, ns, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		ifr, err := unix.NewIfreq("vmtapseccomp")
		if err != nil {
			unix.Close(fd)
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return err
		}
		tap = os.NewFile(uintptr(fd), "tap")
		return nil
	}))
	return tap
}

// The devices vmflow launches work under the allowlist: the test guest
// (q35, TCG) boots jailed with a virtio-blk qcow2 overlay over a raw base
// and virtio-net on a TAP descriptor, to its init, and powers off on
// system_powerdown: QEMU exits by itself with status 0, not EPERM's error
// nor SIGSYS.
func TestGuestWithDiskAndNICUnderSeccomp(t *testing.T) {
	requiresQEMU(t)
	requiresRoot(t)
	proctest.RequiresBinary(t, "qemu-img", "make qemu installs it")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := proctest.ShortDir(t, "img")
	basePath := filepath.Join(dir, "base.raw")
	require.NoError(t, os.WriteFile(basePath, make([]byte, 4<<20), 0o644))
	base, err := os.Open(basePath)
	require.NoError(t, err)
	ov, _, err := OpenOverlay(ctx, OverlayConfig{Path: filepath.Join(dir, "disk.qcow2"), Temp: filepath.Join(dir, ".tmp-disk.qcow2"),
		Base: base, BackingName: basePath})
	require.NoError(t, err)

	cfg := jailed(t, testLaunchConfig(t, "guest"))
	cfg.Spec = guestSpec(t)
	cfg.Spec.Disk = &Disk{Base: base, Overlay: ov}
	cfg.Spec.NIC = &NIC{TAP: testTAP(t), MAC: "02:00:00:00:00:02"}
	bootThenPowerOff(t, cfg, func(vm *VM) {
		assert.Equal(t, "3", procStatus(t, vm.Identity().PID)["Seccomp_filters"], "vmflow's two and QEMU's -sandbox")
	})
}
