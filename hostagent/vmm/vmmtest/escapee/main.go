// Command escapee stands in for a QEMU a guest has taken over, for the
// escaped-QEMU suite (hostagent/vmm escape_test.go): launched through the
// agent's exact path in place of QEMU, it answers QMP on fd 3 so the launch
// succeeds, then tries what such a QEMU would and prints one line per try
// to its stdout (the guest log): a connection to the Temporal frontend on
// the host's loopback, reading another instance's record and /etc/shadow,
// writing outside its own folder, the descriptors it holds, forking past
// its task limit, and last allocating past its memory limit. Its targets
// are set at build time (-ldflags -X). Never built into a product.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Set by the test with -ldflags "-X main.tcpAddr=... -X main.otherRecord=...".
// With sysfsdev set it tries only what a QEMU given that VFIO device reads
// of /sys and /dev (and sibling, a device it was not given), then waits.
// With zombieLeader set it tries nothing: its leader thread exits at once
// and another thread writes a numbered line every 20 ms, as a QEMU whose
// leader is a zombie while its vCPU threads still print. With syscalls set
// it tries only what vmflow's seccomp allowlist closes (trySyscalls).
var (
	tcpAddr      string
	otherRecord  string
	sysfsdev     string
	sibling      string
	zombieLeader string
	syscalls     string
)

func init() {
	if zombieLeader != "" {
		runtime.LockOSThread() // main runs on the leader thread, which it ends
	}
}

func main() {
	if os.Getenv("ESCAPEE_CHILD") != "" {
		time.Sleep(time.Hour)
		return
	}
	if os.Getenv("ESCAPEE_USERFAULTFD") != "" {
		// In a child of its own: the allowlist kills the process.
		fd, _, errno := unix.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|uffdUserModeOnly, 0, 0)
		if errno != 0 {
			os.Exit(3)
		}
		syscall.Close(int(fd))
		return
	}
	go serveQMP()
	say := func(format string, a ...any) { fmt.Printf("escapee "+format+"\n", a...) }
	if zombieLeader != "" {
		go func() {
			runtime.LockOSThread()
			for i := 0; ; i++ {
				say("tick %d", i)
				time.Sleep(20 * time.Millisecond)
			}
		}()
		// exit(2) of the leader alone, not exit_group(2) (proctest's zombie
		// helper does the same).
		_, _, _ = syscall.Syscall(syscall.SYS_EXIT, 0, 0, 0)
	}
	if syscalls != "" {
		trySyscalls(say)
		say("checks done")
		time.Sleep(time.Hour)
		return
	}
	if sysfsdev != "" {
		trySys(say)
		say("checks done")
		time.Sleep(time.Hour)
		return
	}

	if c, err := net.DialTimeout("tcp", tcpAddr, 2*time.Second); err != nil {
		say("tcp %s: refused: %v", tcpAddr, err)
	} else {
		c.Close()
		say("tcp %s: CONNECTED", tcpAddr)
	}
	for _, p := range []string{otherRecord, "/etc/shadow"} {
		if _, err := os.ReadFile(p); err != nil {
			say("read %s: refused: %v", p, err)
		} else {
			say("read %s: READ", p)
		}
	}
	for _, p := range []string{"/escapee", "/tmp/escapee", "/usr/escapee", "/dev/escapee", otherRecord + ".escapee"} {
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			say("write %s: refused: %v", p, err)
		} else {
			say("write %s: WRITTEN", p)
		}
	}
	if ents, err := os.ReadDir("/proc/self/fd"); err == nil {
		var fds []string
		for _, e := range ents {
			t, _ := os.Readlink("/proc/self/fd/" + e.Name())
			fds = append(fds, e.Name()+"="+t)
		}
		say("fds %s", strings.Join(fds, " "))
	} else {
		say("fds: %v", err)
	}
	var children []*exec.Cmd
	var ferr error
	for len(children) < 1000 {
		c := exec.Command("/proc/self/exe")
		c.Env = []string{"ESCAPEE_CHILD=1"}
		if ferr = c.Start(); ferr != nil {
			break
		}
		children = append(children, c)
	}
	say("forked %d: %v", len(children), ferr)
	for _, c := range children { // the tasks back, for the memory try
		_ = c.Process.Kill()
		_ = c.Wait()
	}
	say("checks done")
	var hog [][]byte
	for mib := 64; mib <= 8192; mib += 64 {
		b := make([]byte, 64<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		hog = append(hog, b)
		say("mem %d", mib)
	}
	say("mem SURVIVED %d chunks", len(hog))
	time.Sleep(time.Hour)
}

// serveQMP answers the agent on the QMP listener it passed as fd 3: the
// greeting, then {"return": ...} to every command (query-status: running).
func serveQMP() {
	l, err := net.FileListener(os.NewFile(3, "qmp"))
	if err != nil {
		fmt.Println("escapee qmp:", err)
		return
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			fmt.Fprintln(c, `{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": "escapee"}, "capabilities": []}}`)
			sc := bufio.NewScanner(c)
			for sc.Scan() {
				var cmd struct {
					Execute string          `json:"execute"`
					ID      json.RawMessage `json:"id"`
				}
				if json.Unmarshal(sc.Bytes(), &cmd) != nil {
					return
				}
				ret := `{}`
				if cmd.Execute == "query-status" {
					ret = `{"status": "running", "running": true}`
				}
				if len(cmd.ID) == 0 {
					cmd.ID = json.RawMessage(`null`)
				}
				fmt.Fprintf(c, `{"return": %s, "id": %s}`+"\n", ret, cmd.ID)
			}
		}()
	}
}

// trySys reports what of sysfs and /dev/vfio the jail shows: its own device,
// another VM's, and the rest of sysfs.
func trySys(say func(string, ...any)) {
	read := func(what, p string) {
		if b, err := os.ReadFile(p); err != nil {
			say("%s: refused: %v", what, err)
		} else {
			say("%s: READ %s", what, strings.TrimSpace(string(b)))
		}
	}
	read("sys own", filepath.Join(sysfsdev, "vendor"))
	g, err := os.Readlink(filepath.Join(sysfsdev, "iommu_group"))
	say("sys group: %s %v", g, err)
	sub, err := filepath.EvalSymlinks(filepath.Join(sysfsdev, "subsystem"))
	say("sys subsystem: %s %v", sub, err)
	if err := os.WriteFile(filepath.Join(sysfsdev, "remove"), []byte("1"), 0o200); err != nil {
		say("sys write: refused: %v", err)
	} else {
		say("sys write: WRITTEN")
	}
	read("sys sibling", filepath.Join(sibling, "vendor"))
	read("sys cpus", "/sys/devices/system/cpu/online")
	if ents, err := os.ReadDir("/dev/vfio"); err != nil {
		say("dev vfio: %v", err)
	} else {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		say("dev vfio: %s", strings.Join(names, " "))
	}
}

// uffdUserModeOnly is UFFD_USER_MODE_ONLY (linux/userfaultfd.h): with it
// an unprivileged process gets a userfaultfd whatever
// vm.unprivileged_userfaultfd says.
const uffdUserModeOnly = 1

// trySyscalls reports what a QEMU taken over would try beyond the jail's
// files: an io_uring, a userfaultfd (in a child: the allowlist kills it),
// and on the TAP descriptor it was given (-netdev tap,fd=N in its argv) a
// new MAC, a new owner, persistence, another TAP. Each line is
// "NAME: refused: why" or "NAME: DONE".
func trySyscalls(say func(string, ...any)) {
	report := func(what string, errno syscall.Errno) {
		if errno != 0 {
			say("%s: refused: %v", what, errno)
		} else {
			say("%s: DONE", what)
		}
	}
	var params [120]byte // struct io_uring_params
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, 1, uintptr(unsafe.Pointer(&params[0])), 0)
	if errno == 0 {
		syscall.Close(int(fd))
	}
	report("io_uring_setup", errno)

	c := exec.Command("/proc/self/exe")
	c.Env = []string{"ESCAPEE_USERFAULTFD=1"}
	if err := c.Run(); err != nil {
		say("userfaultfd: refused: %v", err)
	} else {
		say("userfaultfd: DONE")
	}

	tap := -1
	for i, a := range os.Args {
		if a == "-netdev" && i+1 < len(os.Args) {
			if _, err := fmt.Sscanf(os.Args[i+1], "tap,fd=%d", &tap); err != nil {
				tap = -1
			}
		}
	}
	if tap < 0 {
		say("tap: none in argv %q", os.Args)
		return
	}
	ioctl := func(req, arg uintptr) syscall.Errno {
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(tap), req, arg)
		return errno
	}
	var ifr [40]byte // struct ifreq: name, then the hardware address
	ifr[16] = 1      // ARPHRD_ETHER, little-endian
	copy(ifr[18:], []byte{0x02, 0, 0, 0, 0, 0x66})
	report("tap SIOCSIFHWADDR", ioctl(unix.SIOCSIFHWADDR, uintptr(unsafe.Pointer(&ifr[0]))))
	report("tap TUNSETOWNER", ioctl(unix.TUNSETOWNER, uintptr(os.Getuid())))
	report("tap TUNSETPERSIST", ioctl(unix.TUNSETPERSIST, 0)) // 0: a no-op on this TAP, never a TAP left behind
	var set [40]byte
	copy(set[:], "vmflowx0")
	set[16] = 0x02 // IFF_TAP
	report("tap TUNSETIFF", ioctl(unix.TUNSETIFF, uintptr(unsafe.Pointer(&set[0]))))
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "Seccomp_filters:") {
				say("seccomp filters: %s", strings.TrimSpace(strings.TrimPrefix(l, "Seccomp_filters:")))
			}
		}
	}
}
