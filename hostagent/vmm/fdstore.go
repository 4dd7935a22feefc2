package vmm

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
)

// Guest output across agent restarts. The agent holds the only read end of
// each VM's log pipe: killed, it leaves QEMU writing into a pipe nobody
// reads (EPIPE: the bytes are dropped), and a zombie-leader QEMU has an empty
// /proc/<pid>/fd, so the next agent cannot open the pipe again. systemd's
// file descriptor store keeps a copy of the read end for the unit across
// its restarts: FDSTORE=1 with the descriptor in SCM_RIGHTS over the notify
// socket (go-systemd's SdNotify sends no descriptors), FDNAME= to find it
// again, FDPOLL=0 (or systemd drops a pipe, unread bytes and all, as soon
// as QEMU closes its end), FDSTOREREMOVE=1 once the VM's log is drained. The
// next agent gets them back as LISTEN_FDS/LISTEN_FDNAMES and keeps them
// close-on-exec (or every QEMU would inherit every log pipe). The unit
// needs FileDescriptorStoreMax= sized to the most VMs a host runs. systemd
// 252 (Debian 12) keeps the store across a restart of the unit
// (Restart=always, systemctl restart), not across systemctl stop + start:
// the bytes written while no agent runs then are lost as without the store.
// Without systemd (make dev) there is no store: what QEMU writes while the
// agent is down is lost, and the pipe is opened again through
// /proc/<pid>/fd/1 (impossible for a zombie leader).

// FDStore keeps descriptors for the next agent: systemd's file descriptor
// store, or nothing.
type FDStore interface {
	// Store hands f (a copy: the caller keeps its own) to the store under
	// name.
	Store(name string, f *os.File) error
	// Take returns and forgets the descriptor an earlier agent stored
	// under name, nil if there is none.
	Take(name string) *os.File
	// Remove drops name from the store (the VM is gone, its log drained).
	Remove(name string) error
}

// LogFDName is the fd store name of the log pipe of id's QEMU running as uid
// (fits FDNAME's rules for any instance id).
func LogFDName(id string, uid uint32) string { return logFDPrefix + CgroupName(id, uid) }

const logFDPrefix = "vmflow-log."

// LogFDInstance is the instance id of a LogFDName, ok false for any other
// name.
func LogFDInstance(name string) (id string, ok bool) {
	rest, ok := strings.CutPrefix(name, logFDPrefix)
	i := strings.LastIndexByte(rest, '-')
	if !ok || i <= 0 {
		return "", false
	}
	if _, err := strconv.ParseUint(rest[i+1:], 10, 32); err != nil {
		return "", false
	}
	return rest[:i], true
}

// SystemdFDStore is systemd's store, over the notify socket at Socket
// ($NOTIFY_SOCKET), with the descriptors handed back at start.
type SystemdFDStore struct {
	Socket string

	mu     sync.Mutex
	handed map[string]*os.File
}

// NewSystemdFDStore is this process's store when systemd runs it with a notify
// socket, else nil; it takes the handed-back fds close-on-exec and unsets
// LISTEN_*, so nothing started later sees them.
func NewSystemdFDStore() (*SystemdFDStore, error) {
	sock := os.Getenv("NOTIFY_SOCKET")
	if sock == "" {
		return nil, nil
	}
	handed, err := listenFDs(os.Getpid(), os.Getenv("LISTEN_PID"), os.Getenv("LISTEN_FDS"), os.Getenv("LISTEN_FDNAMES"))
	for _, v := range []string{"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} {
		_ = os.Unsetenv(v)
	}
	if err != nil {
		return nil, err
	}
	return &SystemdFDStore{Socket: sock, handed: handed}, nil
}

// SystemdFDStoreFor is the store at notify socket sock with handed as what
// systemd handed back (for tests: a stand-in for systemd).
func SystemdFDStoreFor(sock string, handed map[string]*os.File) *SystemdFDStore {
	if handed == nil {
		handed = map[string]*os.File{}
	}
	return &SystemdFDStore{Socket: sock, handed: handed}
}

// listenFdsStart is SD_LISTEN_FDS_START: the first descriptor handed over.
const listenFdsStart = 3

// listenFDs parses what systemd handed pid: n descriptors from 3, named by
// the colon-separated names.
func listenFDs(pid int, lpid, lfds, names string) (map[string]*os.File, error) {
	out := map[string]*os.File{}
	if lfds == "" || lpid != strconv.Itoa(pid) {
		return out, nil
	}
	n, err := strconv.Atoi(lfds)
	if err != nil || n < 0 {
		return nil, fmt.Errorf("LISTEN_FDS=%q: not a count", lfds)
	}
	ns := strings.Split(names, ":")
	for i := range n {
		fd := listenFdsStart + i
		unix.CloseOnExec(fd)
		name := "unknown"
		if i < len(ns) && ns[i] != "" {
			name = ns[i]
		}
		out[name] = os.NewFile(uintptr(fd), name)
	}
	return out, nil
}

// Store implements FDStore.
func (s *SystemdFDStore) Store(name string, f *os.File) error {
	return s.notify("FDSTORE=1\nFDPOLL=0\nFDNAME="+name, int(f.Fd()))
}

// Remove implements FDStore.
func (s *SystemdFDStore) Remove(name string) error {
	return s.notify(removeState(name), -1)
}

func removeState(name string) string { return "FDSTOREREMOVE=1\nFDNAME=" + name }

// Take implements FDStore.
func (s *SystemdFDStore) Take(name string) *os.File {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := s.handed[name]
	delete(s.handed, name)
	return f
}

// Prune drops and closes every handed-back fd nobody took and keep does not
// claim (log pipes of deleted VMs, otherwise held for the unit's whole life)
// and returns their names.
func (s *SystemdFDStore) Prune(keep func(name string) bool) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var dropped []string
	var errs []error
	for name, f := range s.handed {
		if keep(name) {
			continue
		}
		if err := s.notify(removeState(name), -1); err != nil {
			errs = append(errs, err)
			continue // still stored: kept open with it, tried again at the next start
		}
		f.Close()
		delete(s.handed, name)
		dropped = append(dropped, name)
	}
	slices.Sort(dropped)
	return dropped, errors.Join(errs...)
}

// ErrFDName: a name systemd's store would refuse.
var ErrFDName = errdefs.Internal.New("invalid fd store name")

// notify sends state to the notify socket, with fd in SCM_RIGHTS unless -1.
func (s *SystemdFDStore) notify(state string, fd int) error {
	name := state[strings.LastIndex(state, "FDNAME=")+len("FDNAME="):]
	if name == "" || len(name) > 255 || strings.ContainsAny(name, ":\n") {
		return fmt.Errorf("%w: %q", ErrFDName, name)
	}
	fd2, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("fd store: %w", err)
	}
	defer unix.Close(fd2)
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	// An abstract socket ("@name") is spelled that way for x/sys too.
	if err := unix.Sendmsg(fd2, []byte(state), oob, &unix.SockaddrUnix{Name: s.Socket}, 0); err != nil {
		return fmt.Errorf("fd store: send %q: %w", strings.ReplaceAll(state, "\n", " "), err)
	}
	return nil
}
