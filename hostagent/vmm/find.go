package vmm

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"vmflow/hostagent/proc"
)

// LaunchNonceEnv is the environment variable that carries a launch's nonce
// (LaunchConfig.Nonce) into QEMU, where FindUnrecorded looks for it.
const LaunchNonceEnv = "VMFLOW_LAUNCH_NONCE"

// NewLaunchNonce returns a fresh random nonce (128 bits, 32 hex digits) for
// a launch marker.
func NewLaunchNonce() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("launch nonce: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// FindConfig says which unrecorded QEMU FindUnrecorded looks for.
type FindConfig struct {
	// Binary is the QEMU executable the agent launches (LaunchConfig.Binary;
	// DefaultBinary looked up in PATH when empty).
	Binary string
	// Paths are the instance's: QMPSocket is matched against -qmp (legacy
	// search), PIDFile gives the pid to look at first.
	Paths Paths
	// Nonce is the launch marker's nonce. Set: the QEMU must carry it in
	// its environment. Empty (a record from an agent older than the nonce):
	// the QEMU must carry the instance's -qmp argument instead.
	Nonce string
	// ReadMem: see proc.FindQuery.ReadMem (tests only; nil in production).
	ReadMem func(path string) ([]byte, error)
}

// FindUnrecorded returns the QEMUs of an instance that its record does not
// name: the processes an agent forked for it and died before recording
// (ARCHITECTURE invariant 11). A candidate must run the configured QEMU
// binary (same device and inode, or that path deleted by an upgrade since)
// and lead its own session (vmm forks QEMU with Setsid); then, with
// cfg.Nonce, its environment must hold LaunchNonceEnv=<nonce>; without it
// (legacy), its command line must hold this socket's -qmp argument. A
// command line alone proves nothing: anyone can start a process with that
// argv (`gdb --args qemu ...`, `timeout 60 qemu ...`, a compromised QEMU of
// another instance running as the shared user); the nonce is only in the
// record and in the environment of the QEMU it was given to, and a QEMU
// that dropped privileges (-runas) is not dumpable, so its environ is
// readable by root only.
//
// An error wrapping proc.ErrCannotTell means a candidate could not be read
// in time (its mmap lock held: VFIO teardown, a hung mount): some QEMU of
// the instance may run. See proc.Find for what is read and how it is
// bounded.
//
// The pre-exec window: a child forked but not yet exec'd still runs the
// agent's binary and is not found. Callers close that window by looking
// under the instance's store lock: the lock is an flock on a file the agent
// opened close-on-exec, and a forked child shares that open file, so the
// lock stays held until the child has exec'd QEMU (or died). Whoever holds
// the lock therefore sees QEMU or no child at all.
func FindUnrecorded(ctx context.Context, cfg FindConfig) ([]proc.Identity, error) {
	bin, err := resolveBinary(cfg.Binary)
	if err != nil {
		return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, err)
	}
	exe, err := proc.StatExecutable(bin)
	if err != nil {
		return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, err)
	}
	// Argv never renames QEMU (no -name process=), so its comm is the
	// name it was exec'd by.
	q := proc.FindQuery{Exe: exe, Comm: proc.CommOf(bin), SessionLeader: true, Hint: pidFromFile(cfg.Paths.PIDFile), ReadMem: cfg.ReadMem}
	if cfg.Nonce != "" {
		q.Env = LaunchNonceEnv + "=" + cfg.Nonce
	} else {
		want := qmpArg(cfg.Paths.QMPSocket)
		q.Argv = func(argv []string) bool {
			for i := 0; i+1 < len(argv); i++ {
				if argv[i] == "-qmp" && argv[i+1] == want {
					return true
				}
			}
			return false
		}
	}
	ids, err := proc.Find(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, err)
	}
	return ids, nil
}

// resolveBinary is the QEMU executable Launch runs for bin.
func resolveBinary(bin string) (string, error) {
	if bin == "" {
		bin = DefaultBinary
	}
	if strings.Contains(bin, "/") {
		return bin, nil
	}
	p, err := exec.LookPath(bin)
	if err != nil {
		return "", err
	}
	return p, nil
}

// pidFromFile is the pid a QEMU -pidfile names, 0 when there is none. Only
// a hint: proc.Find checks the process like any other.
func pidFromFile(path string) int {
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
