package proc

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
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

// Holders returns the processes that have path open.
//
// It scans /proc/<pid>/task/<tid>/fd rather than /proc/<pid>/fd: once a
// leader has called exit(2) its own fd table reads empty while the threads
// that remain (vhost workers, kvm-nx-lpage-re) still hold the files, VFIO
// devices included. A task that vanishes mid-scan is skipped; one that cannot
// be read is reported Uncertain, never taken as "does not hold".
func Holders(ctx context.Context, path string) ([]Holder, error) {
	target, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("holders of %s: %w", path, err)
	}
	if resolved, err := filepath.EvalSymlinks(target); err == nil {
		target = resolved
	}
	pids, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, fmt.Errorf("holders of %s: %w", path, err)
	}
	var out []Holder
	for _, e := range pids {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("holders of %s: %w", path, err)
		}
		out = append(out, holdersOfPID(pid, target)...)
	}
	return out, nil
}

func holdersOfPID(pid int, target string) []Holder {
	uncertain := func(tid int, err error) []Holder {
		// One entry per process is enough to make a caller refuse; the
		// rest of its tasks would only repeat it.
		return []Holder{{PID: pid, TID: tid, FD: -1, Uncertain: true, Err: err.Error()}}
	}
	tids, err := os.ReadDir(taskDir(pid))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return uncertain(pid, err)
	}
	seen := map[int]bool{} // fd numbers already reported: threads usually share one table
	var out []Holder
	for _, t := range tids {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		fdDir := taskDir(pid) + "/" + t.Name() + "/fd"
		fds, err := os.ReadDir(fdDir)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			return uncertain(tid, err)
		}
		for _, f := range fds {
			fd, err := strconv.Atoi(f.Name())
			if err != nil || seen[fd] {
				continue
			}
			link, err := os.Readlink(fdDir + "/" + f.Name())
			if err != nil {
				if errors.Is(err, fs.ErrNotExist) {
					continue
				}
				// EACCES here, even as root, when the target has
				// capabilities the caller lacks (ptrace access check).
				return uncertain(tid, err)
			}
			if link == target {
				seen[fd] = true
				out = append(out, Holder{PID: pid, TID: tid, FD: fd})
			}
		}
	}
	return out
}
