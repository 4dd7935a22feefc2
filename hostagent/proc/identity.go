package proc

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"vmflow/internal/errdefs"
)

// procRoot is where procfs is mounted. A constant rather than a knob: every
// caller of this package wants the kernel's answer, never a copy of it.
const procRoot = "/proc"

// Identity names one process across its whole life and nothing else: a pid
// alone is reused, a pid with its start time is unique within a boot, and the
// boot id rules out a record that survived a reboot (ARCHITECTURE invariant 3).
type Identity struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	BootID    string `json:"boot_id"`
}

func (id Identity) String() string {
	return fmt.Sprintf("pid %d (start %d, boot %.8s)", id.PID, id.StartTime, id.BootID)
}

// Valid reports whether the identity is filled in enough to act on.
func (id Identity) Valid() bool { return id.PID > 0 && id.StartTime > 0 && id.BootID != "" }

var (
	// ErrNotFound means no process with that pid exists now.
	ErrNotFound = errdefs.NotFound.New("no such process")
	// ErrIdentityMismatch means a process exists under that pid but it is not
	// the one recorded (another start time or another boot): a stranger that
	// must never be signalled.
	ErrIdentityMismatch = errdefs.NotFound.New("process identity mismatch")
	// ErrIncompleteIdentity means the identity lacks a pid, start time or
	// boot id: a bad record, not a sign that the process is gone.
	ErrIncompleteIdentity = errdefs.IdentityIncomplete.New("incomplete process identity")
)

var bootID = sync.OnceValues(func() (string, error) {
	b, err := os.ReadFile(procRoot + "/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("read boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
})

// BootID returns this boot's id from /proc/sys/kernel/random/boot_id.
func BootID() (string, error) { return bootID() }

func statPath(pid int) string { return procRoot + "/" + strconv.Itoa(pid) + "/stat" }

// gone reports a /proc read that failed because the process went away:
// ENOENT before the open, ESRCH when it was reaped between open and read.
func gone(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH)
}

// ReadStat reads and parses /proc/<pid>/stat. A missing pid is ErrNotFound.
func ReadStat(pid int) (Stat, error) {
	if pid <= 0 {
		return Stat{}, fmt.Errorf("pid %d: %w", pid, ErrNotFound)
	}
	b, err := os.ReadFile(statPath(pid))
	return statFromRead(pid, b, err)
}

// statFromRead is ReadStat's answer to one read of the stat file.
func statFromRead(pid int, b []byte, err error) (Stat, error) {
	if err != nil {
		if gone(err) {
			return Stat{}, fmt.Errorf("pid %d: %w", pid, ErrNotFound)
		}
		return Stat{}, fmt.Errorf("read stat of pid %d: %w", pid, err)
	}
	st, err := ParseStat(b)
	if err != nil {
		return Stat{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	return st, nil
}

// ReadIdentity returns the identity of the process that has pid now.
func ReadIdentity(pid int) (Identity, error) {
	st, err := ReadStat(pid)
	if err != nil {
		return Identity{}, err
	}
	boot, err := BootID()
	if err != nil {
		return Identity{}, err
	}
	return Identity{PID: pid, StartTime: st.StartTime, BootID: boot}, nil
}

// Verify checks the process holding id.PID now is id's: ErrNotFound when the
// pid is free, ErrIdentityMismatch for another process or boot.
func Verify(id Identity) error {
	if !id.Valid() {
		return fmt.Errorf("%v: %w", id, ErrIncompleteIdentity)
	}
	boot, err := BootID()
	if err != nil {
		return err
	}
	if id.BootID != boot {
		return fmt.Errorf("%v recorded in boot %s, this is boot %s: %w", id, id.BootID, boot, ErrIdentityMismatch)
	}
	st, err := ReadStat(id.PID)
	if err != nil {
		return err
	}
	if st.StartTime != id.StartTime {
		return fmt.Errorf("%v: pid now has start time %d: %w", id, st.StartTime, ErrIdentityMismatch)
	}
	return nil
}
