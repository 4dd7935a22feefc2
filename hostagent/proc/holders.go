package proc

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Holder is one open file descriptor on the path asked about, or a process
// whose descriptors could not be read and so may hold it.
type Holder struct {
	PID int    `json:"pid"`
	TID int    `json:"tid"`
	FD  int    `json:"fd"` // -1 when Uncertain
	Err string `json:"error,omitempty"`
	// Uncertain: the descriptors could not be read (permission, or a /proc
	// quirk). Callers guarding a device must treat it as a holder.
	Uncertain bool `json:"uncertain,omitempty"`
}

func (h Holder) String() string {
	if h.Uncertain {
		return fmt.Sprintf("pid %d (tid %d) may hold it: %s", h.PID, h.TID, h.Err)
	}
	return fmt.Sprintf("pid %d holds it as fd %d", h.PID, h.FD)
}

// Holders returns the processes that have path open: one ScanFDs for one path
// (ask one FDScan about several).
func Holders(ctx context.Context, path string) ([]Holder, error) {
	target, err := resolve(path)
	if err != nil {
		return nil, err
	}
	s, err := ScanFDs(ctx)
	if err != nil {
		return nil, fmt.Errorf("holders of %s: %w", path, err)
	}
	return s.holdersOf(target), nil
}

// FDScan is one walk of every file descriptor table on the host: what each
// descriptor points at, and the processes whose tables could not be read.
type FDScan struct {
	byTarget  map[string][]Holder
	uncertain []Holder
	tables    map[int]int // pid -> fd tables read
	everyTask bool
}

// ScanFDs reads every process's descriptors once, per task: an exited leader's
// table reads empty while its threads (vhost, kvm-nx-lpage-re) still hold
// VFIO files. An unreadable task is Uncertain, never "holds nothing".
func ScanFDs(ctx context.Context) (*FDScan, error) { return scanFDs(ctx, false) }

// scanFDs is ScanFDs; everyTask reads every task's table, shared or not
// (the benchmarks' baseline).
func scanFDs(ctx context.Context, everyTask bool) (*FDScan, error) {
	s := &FDScan{byTarget: map[string][]Holder{}, tables: map[int]int{}, everyTask: everyTask}
	if err := eachPID(ctx, func(pid int) error { s.scanPID(pid); return nil }); err != nil {
		return nil, fmt.Errorf("scan descriptors: %w", err)
	}
	return s, nil
}

// Holders returns the descriptors on path the scan saw, and every process
// whose descriptors it could not read.
func (s *FDScan) Holders(path string) ([]Holder, error) {
	target, err := resolve(path)
	if err != nil {
		return nil, err
	}
	return s.holdersOf(target), nil
}

func (s *FDScan) holdersOf(target string) []Holder {
	out := append([]Holder(nil), s.byTarget[target]...)
	return append(out, s.uncertain...)
}

// resolve is path as /proc shows a descriptor on it: absolute, symlinks
// followed.
func resolve(path string) (string, error) {
	target, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("holders of %s: %w", path, err)
	}
	if resolved, err := filepath.EvalSymlinks(target); err == nil {
		target = resolved
	}
	return target, nil
}

func (s *FDScan) scanPID(pid int) {
	uncertain := func(tid int, err error) {
		// One entry per process is enough to make a caller refuse; the
		// rest of its tasks would only repeat it.
		s.uncertain = append(s.uncertain, Holder{PID: pid, TID: tid, FD: -1, Uncertain: true, Err: err.Error()})
	}
	tids, err := os.ReadDir(taskDir(pid))
	if err != nil {
		if !gone(err) {
			uncertain(pid, err)
		}
		return
	}
	var read []int // tasks whose (non-empty) table was read
	for _, t := range tids {
		tid, err := strconv.Atoi(t.Name())
		// Threads usually share one table (CLONE_FILES), but an empty table
		// never stands for another's: a zombie leader and vhost tasks have none.
		if err != nil || (!s.everyTask && sharesTable(read, tid)) {
			continue
		}
		fdDir := taskDir(pid) + "/" + t.Name() + "/fd"
		fds, err := os.ReadDir(fdDir)
		if err != nil {
			if gone(err) {
				continue
			}
			uncertain(tid, err)
			return
		}
		s.tables[pid]++
		n := 0
		for _, f := range fds {
			fd, err := strconv.Atoi(f.Name())
			if err != nil {
				continue
			}
			link, err := os.Readlink(fdDir + "/" + f.Name())
			if err != nil {
				if gone(err) {
					continue
				}
				// EACCES here, even as root, when the target has
				// capabilities the caller lacks (ptrace access check).
				uncertain(tid, err)
				return
			}
			n++
			s.byTarget[link] = append(s.byTarget[link], Holder{PID: pid, TID: tid, FD: fd})
		}
		if n > 0 {
			read = append(read, tid)
		}
	}
}

// kcmpFiles is KCMP_FILES (linux/kcmp.h): compare two tasks' fd tables.
const kcmpFiles = 2

// sharesTable reports whether tid's fd table is one of read's; a kcmp error is
// "not shared", so the table is read: slower, never wrong.
func sharesTable(read []int, tid int) bool {
	for _, r := range read {
		ret, _, errno := unix.Syscall6(unix.SYS_KCMP, uintptr(r), uintptr(tid), kcmpFiles, 0, 0, 0)
		if errno == 0 && ret == 0 {
			return true
		}
	}
	return false
}
