package vmm

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"

	"vmflow/hostagent/proc"
	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
)

// LaunchNonceEnv is the environment variable agents before the per-VM uid
// gave QEMU with the launch marker's nonce. QEMU gets no such variable now
// (its environment is PATH and LC_ALL=C); FindUnrecorded still looks for
// it to adopt a QEMU such an agent started and did not record.
const LaunchNonceEnv = "VMFLOW_LAUNCH_NONCE"

// FindConfig says which unrecorded QEMU FindUnrecorded looks for.
type FindConfig struct {
	// Binary is the QEMU executable the agent launches (LaunchConfig.Binary;
	// DefaultBinary looked up in PATH when empty).
	Binary string
	// Paths are the instance's: QMPSocket is matched against -qmp and
	// PIDFile gives the pid to look at first (both legacy searches only).
	Paths Paths
	// UID is the instance's recorded qemu_uid, Name its guest name (the
	// instance id). Set: the QEMU must run as UID and carry
	// "-name guest=<Name>".
	UID  uint32
	Name string
	// Nonce is the launch nonce of a marker an agent older than the per-VM
	// uid wrote (UID is then 0): the QEMU must carry it in its environment.
	// Both empty: ErrNoLaunchIdentity.
	Nonce string
	// JailSetup is the jail's setup stage binary (Jail.Setup) when QEMUs
	// are jailed: a launch caught before the setup stage exec'd QEMU is
	// that binary, running as root, with the uid in its configuration.
	JailSetup string
	// ReadMem: see proc.FindQuery.ReadMem (tests only; nil in production).
	ReadMem func(path string) ([]byte, error)
}

// FindUnrecorded returns the processes of a launch its record does not name
// (invariant 11): QEMU, its rlimit wrapper or jail stage, proved by executable,
// session, cfg.UID and -name guest=<Name> (legacy cfg.Nonce; neither:
// ErrNoLaunchIdentity). Call under the instance lock; proc.ErrCannotTell: may run.
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
	// Exe matches by device and inode (or the path deleted by an upgrade);
	// vmm forks QEMU with Setsid, so it leads its own session.
	q := proc.FindQuery{Exe: exe, Comm: proc.CommOf(bin), SessionLeader: true, ReadMem: cfg.ReadMem}
	switch {
	case cfg.UID != 0:
		// The proof: only root starts a process as a uid, this one is in this
		// record's launch-marker write alone, and QEMU's sandbox spawns
		// nothing. The name makes a mix-up of records visible.
		if cfg.Name == "" {
			return nil, errdefs.Internal.Errorf("find qemu of uid %d: no name given", cfg.UID)
		}
		q.UID = cfg.UID
		q.Argv = hasArgPair("-name", "guest="+cfg.Name)
	case cfg.Nonce != "":
		q.Env = LaunchNonceEnv + "=" + cfg.Nonce
		q.Hint = fsx.ReadPIDFile(cfg.Paths.PIDFile)
	default:
		// A command line alone proves nothing: anyone can start the QEMU
		// binary in a session of its own with the instance's -qmp argument.
		return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, ErrNoLaunchIdentity)
	}
	// A child forked but not yet exec'd runs the agent's binary and is not
	// found. Callers look under the instance's store lock: an flock on a file
	// opened close-on-exec that the child shares until it execs (or dies).
	if q.UID == 0 {
		ids, err := proc.Find(ctx, q)
		if err != nil {
			return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, err)
		}
		return ids, nil
	}
	// A launch moves on by exec, keeping its pid and start time: the jail's
	// setup stage or the rlimit wrapper, then QEMU. The stages are looked
	// for in that order, so a launch that execs between two scans is seen
	// by the later one; the other way round it could pass each scan as the
	// stage that scan did not look for. One process seen twice is one.
	var ids []proc.Identity
	if cfg.JailSetup != "" {
		setup, err := findJailSetup(ctx, cfg, q)
		if err != nil {
			return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, err)
		}
		ids = append(ids, setup...)
	}
	// The same uid and name on the rlimit wrapper: a launch caught in the
	// wrapper's moment before it execs QEMU (the instance lock's open file
	// is closed at the wrapper's exec, so the lock no longer rules this
	// window out). Only the agent execs the wrapper as the uid.
	wrapper, err := exec.LookPath(LimitWrapper)
	if err != nil {
		return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, err)
	}
	wq := q
	if wq.Exe, err = proc.StatExecutable(wrapper); err != nil {
		return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, err)
	}
	wq.Comm = proc.CommOf(wrapper)
	for _, stage := range []proc.FindQuery{wq, q} {
		found, err := proc.Find(ctx, stage)
		if err != nil {
			return nil, fmt.Errorf("find qemu of %s: %w", cfg.Paths.QMPSocket, err)
		}
		for _, id := range found {
			if !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
	}
	return ids, nil
}

// findJailSetup finds a launch's jail setup stage: the setup binary, leading
// its session, all uids root (only the agent starts it with an instance's uid),
// "qemu-jail" with cfg.UID in its configuration and -name guest=<Name> after.
func findJailSetup(ctx context.Context, cfg FindConfig, q proc.FindQuery) ([]proc.Identity, error) {
	exe, err := proc.StatExecutable(cfg.JailSetup)
	if err != nil {
		return nil, err
	}
	name := q.Argv
	q.Exe, q.Comm, q.UID = exe, proc.CommOf(cfg.JailSetup), 0
	q.Argv = func(argv []string) bool {
		if len(argv) < 4 || argv[1] != JailSetupCommand || argv[3] != "--" || !name(argv[4:]) {
			return false
		}
		var jc jailConfig
		return json.Unmarshal([]byte(argv[2]), &jc) == nil && jc.UID == cfg.UID
	}
	found, err := proc.Find(ctx, q)
	if err != nil {
		return nil, err
	}
	var root []proc.Identity
	for _, id := range found {
		if rootOwned(id.PID) {
			root = append(root, id)
		}
	}
	return root, nil
}

// rootOwned: /proc/<pid>/status says uid 0 four times (real, effective,
// saved, filesystem). Unreadable (gone): not a match.
func rootOwned(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			return slices.Equal(strings.Fields(rest), []string{"0", "0", "0", "0"})
		}
	}
	return false
}

// hasArgPair accepts an argv holding opt immediately followed by value.
func hasArgPair(opt, value string) func([]string) bool {
	return func(argv []string) bool {
		for i := 0; i+1 < len(argv); i++ {
			if argv[i] == opt && argv[i+1] == value {
				return true
			}
		}
		return false
	}
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
