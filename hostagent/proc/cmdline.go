package proc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"syscall"
)

// ReadCmdline returns the argv of the process that has pid now, as
// /proc/<pid>/cmdline shows it (NUL-separated). A missing pid is ErrNotFound.
//
// A leader that has exited while other tasks of its group live (a zombie
// leader) has no memory map of its own any more and shows an empty cmdline;
// its tasks still share the map, so their cmdline is read instead.
func ReadCmdline(pid int) ([]string, error) {
	b, err := os.ReadFile(procRoot + "/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
			return nil, fmt.Errorf("pid %d: %w", pid, ErrNotFound)
		}
		return nil, fmt.Errorf("read cmdline of pid %d: %w", pid, err)
	}
	if len(b) == 0 {
		b = taskCmdline(pid)
	}
	return splitCmdline(b), nil
}

// taskCmdline is the first non-empty cmdline among pid's tasks, or nil.
func taskCmdline(pid int) []byte {
	tids, err := os.ReadDir(taskDir(pid))
	if err != nil {
		return nil
	}
	for _, t := range tids {
		b, err := os.ReadFile(taskDir(pid) + "/" + t.Name() + "/cmdline")
		if err == nil && len(b) > 0 {
			return b
		}
	}
	return nil
}

func splitCmdline(b []byte) []string {
	b = bytes.TrimSuffix(b, []byte{0})
	if len(b) == 0 {
		return nil
	}
	parts := bytes.Split(b, []byte{0})
	out := make([]string, len(parts))
	for i, p := range parts {
		out[i] = string(p)
	}
	return out
}

// FindByCmdline returns the identities of the processes whose argv match
// says yes to, this process excluded. Each identity is read around the
// cmdline (the start time before and after it must agree), so a pid that
// died and was reused during the scan is never reported under the new
// process's identity. A process that vanishes mid-scan is skipped; one whose
// cmdline cannot be read for another reason fails the scan: "can't tell"
// must not read as "none".
func FindByCmdline(ctx context.Context, match func(argv []string) bool) ([]Identity, error) {
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, fmt.Errorf("scan processes: %w", err)
	}
	boot, err := BootID()
	if err != nil {
		return nil, err
	}
	self := os.Getpid()
	var out []Identity
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("scan processes: %w", err)
		}
		before, err := ReadStat(pid)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("scan processes: %w", err)
		}
		argv, err := ReadCmdline(pid)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("scan processes: %w", err)
		}
		if !match(argv) {
			continue
		}
		after, err := ReadStat(pid)
		if errors.Is(err, ErrNotFound) || (err == nil && after.StartTime != before.StartTime) {
			continue // gone (or replaced) while we read it
		}
		if err != nil {
			return nil, fmt.Errorf("scan processes: %w", err)
		}
		out = append(out, Identity{PID: pid, StartTime: before.StartTime, BootID: boot})
	}
	return out, nil
}
