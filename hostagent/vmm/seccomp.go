package vmm

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"unsafe"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
)

// vmflow's own seccomp allowlist for QEMU. QEMU's -sandbox (sandboxOption)
// is a denylist: it closes a few families (obsolete, set*id, spawn,
// resource control) and leaves the rest of the kernel open, every ioctl
// included. This filter is the other way round: the syscalls QEMU was seen
// making, with the machines and devices vmflow launches, are allowed; the
// rest fail with EPERM; the ones an escaped guest would reach for first
// kill the process. It goes on the thread that execs QEMU, after
// no_new_privs (the jail's setup stage, or the locked thread the unjailed
// launch forks from), so QEMU runs under it from its first instruction and
// cannot remove it; seccomp and prctl stay allowed so QEMU's own -sandbox
// stacks on top (the kernel applies the strictest answer of all filters).
//
// How the list was derived (QEMU 7.2, Debian 12, TCG; the argv BuildArgv
// writes): strace -f -X raw of qemu-system-x86_64 with -machine none and
// QMP qmp_capabilities, query-status, quit; and of a q35 boot of the test
// guest (make guest) with a virtio-blk qcow2 overlay over a raw base by
// fdset, virtio-net on a TAP descriptor (IFF_TAP|IFF_NO_PI|IFF_VNET_HDR,
// made in a network namespace), the serial console on stdout, up to the
// guest's init and system_powerdown; and of the prlimit wrapper the unjailed
// launch execs first. The syscalls only the agent's own fork path makes
// (below), and those of KVM, VFIO and disk writes, which that trace could
// not show (no /dev/kvm here; the guest's init never writes its disk), are
// added by reading QEMU's and Go's sources, each group saying why.

// ErrSeccomp: the allowlist could not be built or installed (a kernel
// without seccomp filters, or an architecture it does not know): QEMU is
// never started without it.
var ErrSeccomp = errdefs.Misconfigured.New("qemu's seccomp allowlist cannot be installed")

// seccompKilled are killed (SECCOMP_RET_KILL_PROCESS) rather than refused:
// no QEMU vmflow launches makes them, and each is kernel attack surface an
// escaped guest reaches for first. A QEMU that makes one is compromised;
// ending it at once beats letting it probe. io_uring_setup is not here:
// QEMU 7.2 probes it at every start (fdmon-io_uring, the block layer) and
// falls back to ppoll and thread-pool I/O on EPERM; without a ring the
// other io_uring calls have nothing to act on, so they are killed.
var seccompKilled = []string{
	"io_uring_enter", "io_uring_register", // io_uring: a long list of kernel CVEs
	"bpf",                              // the verifier and JIT
	"userfaultfd",                      // stretches kernel races at will
	"perf_event_open",                  // PMU drivers, kernel pointers
	"keyctl", "add_key", "request_key", // the keyring subsystem
	"kexec_load", "kexec_file_load", // a new kernel
	"init_module", "finit_module", "delete_module", // kernel modules
	"ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", // other processes' memory and descriptors
	"open_by_handle_at", "name_to_handle_at", // files by handle, past the mount namespace
	"unshare", "setns", // new namespaces: user namespaces open the kernel's root-only paths
	"iopl", "ioperm", // port I/O
}

// seccompAllowed are allowed whatever their arguments.
var seccompAllowed = []string{
	// Traced, hottest first (the filter is a linear list): the main loop,
	// vCPU and I/O threads.
	"futex", "ppoll", "poll", "read", "write", "readv", "writev", "recvmsg", "sendmsg",
	"mmap", "munmap", "mprotect", "madvise", "brk", "clock_nanosleep",
	"rt_sigprocmask", "rt_sigaction", "lseek", "pread64", "close", "fcntl",
	"openat", "newfstatat", "access", "readlink", "getdents64", "fchdir", "statfs",
	"eventfd2", "signalfd4", "memfd_create", "accept4", "listen", "getsockname", "getpeername", "getsockopt",
	"set_robust_list", "rseq", "set_tid_address", "gettid", "arch_prctl", "getrandom",
	"sysinfo", "sched_getaffinity", "get_mempolicy", "set_mempolicy", "prlimit64",
	"execve", "exit", "exit_group",
	// QEMU's own -sandbox installs through these (and prctl sets
	// no_new_privs): its filter then stacks on this one.
	"seccomp", "prctl",
	// Not in the trace. Disk writes to the overlay and their flushes
	// (block/file-posix.c, aio=threads): the test guest never writes.
	"preadv", "pwritev", "pwrite64", "fdatasync", "fsync", "fallocate", "ftruncate", "fstat", "fstatfs",
	// The main loop without io_uring (fdmon-epoll takes over past a
	// number of descriptors; util/fdmon-epoll.c).
	"epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2",
	// KVM: vCPU threads are kicked with a signal (SIG_IPI, tgkill) whose
	// handler returns through rt_sigreturn; host-nodes= binds guest RAM.
	"rt_sigreturn", "tgkill", "getpid", "rt_sigtimedwait", "mbind", "sched_yield",
	// kill reaches no further than tgkill (its uid is its own, jailed its
	// pid namespace too); a wrapper script or a stand-in stops its
	// children with it (Go does when pidfds are refused).
	"kill",
	// The unjailed launch forks QEMU from a thread under this filter
	// (startConfined): Go's runtime on that thread and its fork child
	// before the exec (setsid, the uid and groups, descriptors, then
	// execve). set*id stay harmless: QEMU has no capability left, and
	// its -sandbox elevateprivileges=deny kills them.
	"sigaltstack", "nanosleep", "pipe2", "dup3", "chdir", "setsid", "setgroups", "setgid", "setuid",
	"wait4", "waitid",
	// A --qemu that is a wrapper script (a shell adding options, then
	// exec'ing QEMU; jailFiles supports it): traced with dash.
	"dup2", "getcwd", "getuid", "geteuid", "getgid", "getegid", "getppid", "vfork",
	// Path lookups of other libcs and Go (readlink's *at form).
	"readlinkat",
}

// cloneNamespaceFlags are clone's new-namespace flags, refused: threads and
// the fork child never ask for one, and a user namespace would open the
// kernel's root-only paths to QEMU.
const cloneNamespaceFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
	unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET

// ioctls QEMU makes, by request number.
const (
	// On its stdio chardev (isatty and the terminal's mode).
	ioctlTCGETS = 0x5401
	ioctlTCSETS = 0x5402
	// The TAP: reads of its name, features and header size, and the
	// offloads and send buffer of its own queue (net/tap-linux.c); never
	// TUNSETIFF, TUNSETOWNER, TUNSETPERSIST, TUNSETGROUP, TUNSETLINK,
	// SIOCSIFHWADDR nor any other interface or socket ioctl.
	ioctlTUNGETFEATURES   = 0x800454cf
	ioctlTUNSETOFFLOAD    = 0x400454d0
	ioctlTUNGETIFF        = 0x800454d2
	ioctlTUNSETSNDBUF     = 0x400454d4
	ioctlTUNGETVNETHDRSZ  = 0x800454d7
	ioctlTUNSETVNETHDRSZ  = 0x400454d8
	ioctlKVMType          = 0xAE   // linux/kvm.h: every KVM ioctl is _IOC(dir, 0xAE, nr, size)
	ioctlVFIOFirst        = 0x3B64 // linux/vfio.h: _IO(';', 100 + n)
	ioctlVFIOLast         = 0x3B7F // ';' 0x80 and up is iommufd, which QEMU 7.2 does not use
	ioctlRequestTypeShift = 8
)

// seccompIoctls are the exact ioctl requests allowed besides the KVM and
// VFIO ranges.
var seccompIoctls = []uint64{
	ioctlTCGETS, ioctlTCSETS,
	ioctlTUNGETFEATURES, ioctlTUNSETOFFLOAD, ioctlTUNGETIFF, ioctlTUNSETSNDBUF, ioctlTUNGETVNETHDRSZ, ioctlTUNSETVNETHDRSZ,
}

// ioctlConditions are the ioctl request conditions (argument 1) that allow
// the call: one condition set per exact request, the KVM type byte, the VFIO
// range. The kernel reads the request as 32 bits (unsigned int cmd), and a
// request above 0x7fffffff passed through an int is sign-extended to 64
// bits: both spellings are allowed. Whatever passes, its low 32 bits are an
// allowed request.
func ioctlConditions() []seccomp.NameWithConditions {
	var out []seccomp.NameWithConditions
	eq := func(v uint64) {
		out = append(out, seccomp.NameWithConditions{Name: "ioctl", Conditions: seccomp.ArgumentConditions{
			{Argument: 1, Operation: seccomp.Equal, Value: v},
		}})
	}
	for _, r := range seccompIoctls {
		eq(r)
		if r&0x80000000 != 0 {
			eq(r | 0xffffffff00000000)
		}
	}
	// (request & 0xff00) == 0xAE00: the library's BitsSet is "any of", so
	// each set bit of the type is its own condition, and the clear ones
	// one BitsNotSet.
	kvm := seccomp.ArgumentConditions{{Argument: 1, Operation: seccomp.BitsNotSet, Value: (^uint64(ioctlKVMType) & 0xff) << ioctlRequestTypeShift}}
	for b := uint64(1); b < 0x100; b <<= 1 {
		if ioctlKVMType&b != 0 {
			kvm = append(kvm, seccomp.Condition{Argument: 1, Operation: seccomp.BitsSet, Value: b << ioctlRequestTypeShift})
		}
	}
	out = append(out,
		seccomp.NameWithConditions{Name: "ioctl", Conditions: kvm},
		seccomp.NameWithConditions{Name: "ioctl", Conditions: seccomp.ArgumentConditions{
			{Argument: 1, Operation: seccomp.GreaterOrEqual, Value: ioctlVFIOFirst},
			{Argument: 1, Operation: seccomp.LessOrEqual, Value: ioctlVFIOLast},
		}},
	)
	return out
}

// qemuSeccompPolicies are the allowlist as two policies, installed as two
// stacked filters (the kernel takes the strictest answer of all). They are
// two because go-seccomp-bpf v1.6.0 mis-assembles a syscall with argument
// conditions that anything follows: when its last condition fails it jumps
// to the next syscall's number check with an argument word still in the
// accumulator, so ioctl(fd, TUNSETIFF | 1<<32) compared 1 with the allowed
// numbers, matched write(2) and was allowed (the kernel truncates the
// request to TUNSETIFF). A conditional syscall is safe only as the very
// last check before the default action, so each policy has one:
//
//   - the allowlist: killed first, clone3 as ENOSYS (its flags are behind
//     a pointer no filter can read; glibc then falls back to clone), the
//     allowed, and last the ioctls whose request passes; EPERM for the rest;
//   - the clone check: clone asking for a new namespace is EPERM, all else
//     passes on to the allowlist's answer.
func qemuSeccompPolicies() []seccomp.Policy {
	return []seccomp.Policy{
		{
			DefaultAction: seccomp.ActionErrno, // EPERM
			Syscalls: []seccomp.SyscallGroup{
				{Action: seccomp.ActionKillProcess, Names: seccompKilled},
				{Action: seccomp.ActionErrno | seccomp.Action(unix.ENOSYS), Names: []string{"clone3"}},
				{Action: seccomp.ActionAllow, Names: append(slices.Clone(seccompAllowed), "clone")},
				{Action: seccomp.ActionAllow, NamesWithCondtions: ioctlConditions()},
			},
		},
		{
			DefaultAction: seccomp.ActionAllow,
			Syscalls: []seccomp.SyscallGroup{{Action: seccomp.ActionErrno, NamesWithCondtions: []seccomp.NameWithConditions{{
				Name: "clone", Conditions: seccomp.ArgumentConditions{{Argument: 0, Operation: seccomp.BitsSet, Value: cloneNamespaceFlags}},
			}}}},
		},
	}
}

// seccompDataArch and seccompDataNr are offsets in struct seccomp_data.
const (
	seccompDataNr   = 0
	seccompDataArch = 4
	// x32SyscallBit marks the x32 ABI's syscalls on an x86_64 kernel.
	x32SyscallBit = 0x40000000
)

// qemuSeccompPrograms are the policies assembled, each behind a check of
// its own: a syscall of another architecture (int 0x80's i386 table) or of
// the x32 ABI is killed, not refused. The library's own arch check falls
// through to the default action (EPERM or allow), and its x32 check
// answers ENOSYS.
func qemuSeccompPrograms() ([][]bpf.Instruction, error) {
	if runtime.GOARCH != "amd64" {
		return nil, fmt.Errorf("%w: the allowlist is x86_64's, this is %s", ErrSeccomp, runtime.GOARCH)
	}
	kill := bpf.RetConstant{Val: uint32(seccomp.ActionKillProcess)}
	var progs [][]bpf.Instruction
	for _, p := range qemuSeccompPolicies() {
		body, err := p.Assemble()
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrSeccomp, err)
		}
		progs = append(progs, append([]bpf.Instruction{
			bpf.LoadAbsolute{Off: seccompDataArch, Size: 4},
			bpf.JumpIf{Cond: bpf.JumpEqual, Val: unix.AUDIT_ARCH_X86_64, SkipTrue: 1},
			kill,
			bpf.LoadAbsolute{Off: seccompDataNr, Size: 4},
			bpf.JumpIf{Cond: bpf.JumpBitsSet, Val: x32SyscallBit, SkipFalse: 1},
			kill,
		}, body...))
	}
	return progs, nil
}

// installQEMUSeccomp sets no_new_privs and installs the allowlist on the
// calling thread (seccomp filters are per thread and inherited by its
// children and across execve). The caller must be locked to its thread.
func installQEMUSeccomp() error {
	progs, err := qemuSeccompPrograms()
	if err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("%w: no_new_privs: %w", ErrSeccomp, err)
	}
	for _, prog := range progs {
		raw, err := bpf.Assemble(prog)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrSeccomp, err)
		}
		filter := make([]unix.SockFilter, len(raw))
		for i, r := range raw {
			filter[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
		}
		fprog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
		// No SECCOMP_FILTER_FLAG_TSYNC: only this thread, the one that
		// forks or execs QEMU, is filtered.
		if _, _, errno := unix.RawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&fprog))); errno != 0 {
			return fmt.Errorf("%w: %w", ErrSeccomp, errno)
		}
		runtime.KeepAlive(filter)
	}
	return nil
}

// startConfined runs start (the fork and exec of the unjailed launch) on a
// thread of its own under the allowlist, so the child inherits the filter
// at the fork and carries it through the exec. Go's exec has no hook
// between fork and exec; the thread is never handed back to the runtime (its
// goroutine exits locked, so Go ends the thread), and Go starts no new
// thread from a locked one (it uses its template thread), so nothing else
// of the agent ever runs filtered.
func startConfined(start func() error) error {
	// os/exec settles once whether pidfds work (pidfd_open, waitid,
	// pidfd_send_signal, which the filter refuses): settle it here,
	// unfiltered, or the agent would go without pidfds for its life.
	if p, err := os.FindProcess(os.Getpid()); err == nil {
		_ = p.Release()
	}
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the filter cannot be removed, so the thread
		// must end with this goroutine.
		if err := installQEMUSeccomp(); err != nil {
			done <- err
			return
		}
		done <- start()
	}()
	return <-done
}
