package fsx

import (
	"bytes"
	"os"
	"strconv"
)

// QEMU gets no -pidfile since the agent hands it a QMP listener fd and a uid
// of its own (it could not write into the root-only instance directory, and
// must not). A QEMU an older agent started still has one: it is read as a
// hint when adopting, and removed once that QEMU is gone.

// ReadPIDFile is the positive pid a QEMU -pidfile at path names, else 0; only a
// hint, checked like any other pid.
func ReadPIDFile(path string) int {
	if path == "" {
		return 0
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil || n <= 0 {
		return 0
	}
	return n
}

// RemovePIDFile removes path if it still names pid (QEMU leaves it when
// killed; another pid's is another QEMU's). Best effort: a stale hint.
func RemovePIDFile(path string, pid int) {
	if pid > 0 && ReadPIDFile(path) == pid {
		_ = os.Remove(path)
	}
}
