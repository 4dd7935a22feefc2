package vmmtest

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
)

// Systemd stands in for systemd at its notify socket (Path): it keeps what
// FDSTORE=1 sends (SCM_RIGHTS) under its FDNAME and drops it on
// FDSTOREREMOVE=1, as systemd's fd store does.
type Systemd struct {
	Path string
	mu   sync.Mutex
	fds  map[string]*os.File
	msgs []string
}

// NewSystemd listens on a fresh notify socket until the test ends.
func NewSystemd(t testing.TB) *Systemd {
	t.Helper()
	f := &Systemd{Path: filepath.Join(proctest.ShortDir(t, "nt"), "notify"), fds: map[string]*os.File{}}
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: f.Path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	go func() {
		buf, oob := make([]byte, 4096), make([]byte, 1024)
		for {
			n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
			if err != nil {
				return
			}
			state := string(buf[:n])
			kv := map[string]string{}
			for _, l := range strings.Split(state, "\n") {
				k, v, _ := strings.Cut(l, "=")
				kv[k] = v
			}
			var got []int
			if scms, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
				for _, m := range scms {
					fds, _ := unix.ParseUnixRights(&m)
					got = append(got, fds...)
				}
			}
			f.mu.Lock()
			f.msgs = append(f.msgs, state)
			switch {
			case kv["FDSTORE"] == "1" && kv["FDPOLL"] == "0" && len(got) == 1:
				f.fds[kv["FDNAME"]] = os.NewFile(uintptr(got[0]), kv["FDNAME"])
			case kv["FDSTOREREMOVE"] == "1":
				if old := f.fds[kv["FDNAME"]]; old != nil {
					old.Close()
				}
				delete(f.fds, kv["FDNAME"])
			}
			f.mu.Unlock()
		}
	}()
	return f
}

// Stored is the descriptor kept under name, nil for none.
func (f *Systemd) Stored(name string) *os.File {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fds[name]
}

// Restarted is the store a restarted agent has: what systemd handed back.
func (f *Systemd) Restarted() *vmm.SystemdFDStore {
	f.mu.Lock()
	defer f.mu.Unlock()
	handed := map[string]*os.File{}
	for k, v := range f.fds {
		handed[k] = v
	}
	return vmm.SystemdFDStoreFor(f.Path, handed)
}

// Messages are the states received, oldest first.
func (f *Systemd) Messages() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.msgs...)
}
