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
)

// Set by the test with -ldflags "-X main.tcpAddr=... -X main.otherRecord=...".
// With sysfsdev set it tries only what a QEMU given that VFIO device reads
// of /sys and /dev (and sibling, a device it was not given), then waits.
// With zombieLeader set it tries nothing: its leader thread exits at once
// and another thread writes a numbered line every 20 ms, as a QEMU whose
// leader is a zombie while its vCPU threads still print.
var (
	tcpAddr      string
	otherRecord  string
	sysfsdev     string
	sibling      string
	zombieLeader string
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
