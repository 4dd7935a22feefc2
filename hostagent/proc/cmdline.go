package proc

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"syscall"
)

// ReadCmdline returns pid's argv now (ErrNotFound when gone), unbounded: it
// takes the target's mmap lock (see Find). A zombie leader's is read from a
// live task of its group, as the leader has no memory map left.
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
