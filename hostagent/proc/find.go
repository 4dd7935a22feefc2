package proc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"vmflow/internal/errdefs"
)

// FindQuery says which processes Find reports. Every check that can be made
// without reading a process's memory is made first, so a memory read (which
// can block, see Find) is only ever attempted on a process running Exe.
type FindQuery struct {
	// Exe: only processes running this binary (required). See exeMatches.
	Exe Executable
	// Comm, when not empty, is the process name (/proc/<pid>/stat field 2)
	// a match must have: for a process that did not rename itself, the
	// first 15 bytes of the base name of the path it was exec'd by (see
	// CommOf). Read without any access check, it lets Find pass over the
	// processes whose exe it may not read (another user namespace, an LSM:
	// PID 1 of some sandboxes) instead of answering "can't tell" for them.
	Comm string
	// SessionLeader: only processes that lead their own session (sid ==
	// pid), as every process Start forks is (Setsid).
	SessionLeader bool
	// UID, when not 0, is the uid a match runs as: real, effective, saved
	// and filesystem uid all equal to it (/proc/<pid>/status, read without
	// the mmap lock, before any memory read).
	UID uint32
	// Env, when not empty, is a "KEY=VALUE" entry the process's environment
	// (/proc/<pid>/environ, as it was at exec) must hold exactly.
	Env string
	// Argv, when not nil, must accept the process's argv.
	Argv func(argv []string) bool
	// Hint is a pid to look at first (QEMU's -pidfile), 0 for none. With Env
	// set, a match at Hint ends the search: Env is a secret given to one
	// process only, so the rest of the table is not read (and a blocked read
	// of another process cannot stand in the way).
	Hint int
	// ReadMem reads a memory-backed file of a process (/proc/<pid>/environ,
	// /proc/<pid>/cmdline); os.ReadFile when nil. Tests stand in a reader
	// that blocks, as the kernel's does while the target's mmap lock is held.
	ReadMem func(path string) ([]byte, error)
}

// ErrCannotTell: a process that passed every other check could not be read
// in time (or at all), so whether it matches is unknown. Callers must treat
// it as "may be the one", never as "none".
var ErrCannotTell = errdefs.StillAlive.New("cannot tell whether a process matches")

// Executable names a binary file by its resolved path and its device and
// inode, as the kernel shows it in /proc/<pid>/exe.
type Executable struct {
	Path string
	Dev  uint64
	Ino  uint64
}

// StatExecutable resolves path (symbolic links too: /proc/<pid>/exe shows
// the file executed, never the link) and returns its identity.
func StatExecutable(path string) (Executable, error) {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return Executable{}, fmt.Errorf("executable %s: %w", path, err)
	}
	if real, err = filepath.Abs(real); err != nil {
		return Executable{}, fmt.Errorf("executable %s: %w", path, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(real, &st); err != nil {
		return Executable{}, fmt.Errorf("executable %s: %w", real, err)
	}
	return Executable{Path: real, Dev: uint64(st.Dev), Ino: st.Ino}, nil
}

// taskCommLen is the kernel's TASK_COMM_LEN less its NUL.
const taskCommLen = 15

// CommOf is the comm the kernel gives at exec of path: the base name as
// exec'd (a symlink's own name), cut to 15 bytes.
func CommOf(path string) string {
	c := filepath.Base(path)
	if len(c) > taskCommLen {
		c = c[:taskCommLen]
	}
	return c
}

// deletedSuffix is what the kernel appends to /proc/<pid>/exe when the
// file was unlinked (or replaced by a package upgrade) after the exec.
const deletedSuffix = " (deleted)"

// exeMatches reports whether the process at /proc dir runs exe, taking no mmap
// lock (readlink of exe uses task_lock and RCU since Linux 4.1), statting only
// exe's own path, never a stranger's hung mount. exe's path + " (deleted)"
// matches: a QEMU exec'd before an upgrade replaced the root-owned binary.
func exeMatches(dir string, exe Executable) (bool, error) {
	link, err := os.Readlink(dir + "/exe")
	if err != nil {
		if gone(err) {
			return false, nil // a kernel thread (no mm) or gone
		}
		return false, fmt.Errorf("%w: readlink %s/exe: %w", ErrCannotTell, dir, err)
	}
	switch link {
	case exe.Path:
	case exe.Path + deletedSuffix:
		return true, nil
	default:
		return false, nil
	}
	var st syscall.Stat_t
	if err := syscall.Stat(dir+"/exe", &st); err != nil {
		if gone(err) {
			return false, nil
		}
		return false, fmt.Errorf("%w: stat %s/exe: %w", ErrCannotTell, dir, err)
	}
	return uint64(st.Dev) == exe.Dev && st.Ino == exe.Ino, nil
}

// statSession reads /proc/<pid>/stat once and returns it with field 6
// (session id). Reading stat takes no mmap lock.
func statSession(pid int) (Stat, int, error) {
	b, err := os.ReadFile(statPath(pid))
	if err != nil {
		if gone(err) {
			return Stat{}, 0, fmt.Errorf("pid %d: %w", pid, ErrNotFound)
		}
		return Stat{}, 0, fmt.Errorf("read stat of pid %d: %w", pid, err)
	}
	st, err := ParseStat(b)
	if err != nil {
		return Stat{}, 0, fmt.Errorf("pid %d: %w", pid, err)
	}
	// ParseStat checked there are >= 20 fields after the last ')'.
	rest := bytes.Fields(b[bytes.LastIndexByte(b, ')')+1:])
	const idxSession = 3 // field 6
	sid, err := strconv.Atoi(string(rest[idxSession]))
	if err != nil {
		return Stat{}, 0, fmt.Errorf("pid %d: %w: bad session %q", pid, ErrMalformedStat, rest[idxSession])
	}
	return st, sid, nil
}

// memDir is the /proc dir to read pid's memory-backed files and exe from: a
// zombie leader's mm is gone, so a live task of its group; "" when none is left.
func memDir(pid int, st Stat) string {
	dir := procRoot + "/" + strconv.Itoa(pid)
	if st.State != 'Z' {
		return dir
	}
	tids, err := os.ReadDir(taskDir(pid))
	if err != nil {
		return ""
	}
	for _, t := range tids {
		if t.Name() != strconv.Itoa(pid) {
			return taskDir(pid) + "/" + t.Name()
		}
	}
	return ""
}

// Find returns the identities of the processes q describes, this one excluded.
// Reading cmdline or environ takes the target's mmap lock, held for minutes
// by a QEMU in VFIO teardown or a hung mount, so only cheap-check matches are
// read, bounded by ctx: a read not done in time is ErrCannotTell, never "none".
func Find(ctx context.Context, q FindQuery) ([]Identity, error) {
	if q.Exe.Path == "" {
		return nil, errdefs.Internal.Errorf("find processes: FindQuery.Exe is required")
	}
	boot, err := BootID()
	if err != nil {
		return nil, err
	}
	f := finder{q: q, boot: boot, self: os.Getpid()}
	if f.q.ReadMem == nil {
		f.q.ReadMem = os.ReadFile
	}
	if q.Hint > 0 && q.Env != "" {
		id, ok, err := f.check(ctx, q.Hint)
		if err == nil && ok {
			return []Identity{id}, nil
		}
		// Not it (or cannot tell yet): the full scan decides, and sees the
		// hint again.
	}
	var out []Identity
	err = eachPID(ctx, func(pid int) error {
		id, ok, err := f.check(ctx, pid)
		if ok {
			out = append(out, id)
		}
		return err
	})
	if err != nil && ctx.Err() != nil {
		return nil, fmt.Errorf("scan processes: %w: %w", ErrCannotTell, err)
	}
	if err != nil {
		return nil, fmt.Errorf("scan processes: %w", err)
	}
	return out, nil
}

type finder struct {
	q    FindQuery
	boot string
	self int
}

// check reports whether pid matches the query, with its identity.
func (f *finder) check(ctx context.Context, pid int) (Identity, bool, error) {
	if pid == f.self {
		return Identity{}, false, nil
	}
	before, sid, err := statSession(pid)
	if errors.Is(err, ErrNotFound) {
		return Identity{}, false, nil
	}
	if err != nil {
		return Identity{}, false, fmt.Errorf("%w: %w", ErrCannotTell, err)
	}
	if f.q.SessionLeader && sid != pid {
		return Identity{}, false, nil
	}
	if f.q.Comm != "" && before.Comm != f.q.Comm {
		return Identity{}, false, nil
	}
	dir := memDir(pid, before)
	if dir == "" {
		return Identity{}, false, nil // a zombie with no task left: gone
	}
	if f.q.UID != 0 {
		ids, err := ReadUIDs(pid)
		if errors.Is(err, ErrNotFound) {
			return Identity{}, false, nil
		}
		if err != nil {
			return Identity{}, false, fmt.Errorf("%w: %w", ErrCannotTell, err)
		}
		if ids != [4]uint32{f.q.UID, f.q.UID, f.q.UID, f.q.UID} {
			return Identity{}, false, nil
		}
	}
	if ok, err := exeMatches(dir, f.q.Exe); err != nil || !ok {
		return Identity{}, false, err
	}
	// Memory reads last: only after the checks that take no mmap lock. A read
	// that times out stays in flight (one per process and file) until the lock frees.
	key := inflightKey{pid: pid, start: before.StartTime}
	if f.q.Env != "" {
		b, err := f.read(ctx, key, dir+"/environ")
		if err != nil || !slices.Contains(splitNUL(b), f.q.Env) {
			return Identity{}, false, err
		}
	}
	if f.q.Argv != nil {
		b, err := f.readArgv(ctx, key, dir+"/cmdline")
		if err != nil || !f.q.Argv(splitNUL(b)) {
			return Identity{}, false, err
		}
	}
	// The start time read before and after: a pid reused during the scan is
	// never reported under the new process's identity.
	after, err := ReadStat(pid)
	if errors.Is(err, ErrNotFound) || (err == nil && after.StartTime != before.StartTime) {
		return Identity{}, false, nil // gone (or replaced) while we read it
	}
	if err != nil {
		return Identity{}, false, fmt.Errorf("%w: %w", ErrCannotTell, err)
	}
	return Identity{PID: pid, StartTime: before.StartTime, BootID: f.boot}, true, nil
}

// read reads path bounded by ctx. A process gone meanwhile reads as empty
// (it matches nothing; the caller's second stat drops it anyway).
func (f *finder) read(ctx context.Context, key inflightKey, path string) ([]byte, error) {
	key.path = path
	r := startRead(key, f.q.ReadMem)
	select {
	case <-r.done:
	case <-ctx.Done():
		return nil, fmt.Errorf("%w: reading %s: %w", ErrCannotTell, path, ctx.Err())
	}
	if r.err != nil {
		if gone(r.err) {
			return nil, nil
		}
		return nil, fmt.Errorf("%w: %w", ErrCannotTell, r.err)
	}
	return r.b, nil
}

// readArgv reads a cmdline, waiting out an exec in progress: exe and comm
// name the new binary while the kernel still loads it (milliseconds on a
// loaded machine) and cmdline reads empty until its arguments are set up.
// Empty is "not yet", not "no match": the read is repeated until it has
// bytes, the process is gone, replaced or exiting, or ctx ends (ErrCannotTell).
func (f *finder) readArgv(ctx context.Context, key inflightKey, path string) ([]byte, error) {
	for {
		b, err := f.read(ctx, key, path)
		if err != nil || len(b) > 0 {
			return b, err
		}
		st, err := ReadStat(key.pid)
		switch {
		case errors.Is(err, ErrNotFound):
			return nil, nil
		case err != nil:
			return nil, fmt.Errorf("%w: %w", ErrCannotTell, err)
		case st.StartTime != key.start || st.State == 'Z' || st.State == 'X':
			return nil, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %s stays empty (an exec that does not finish): %w", ErrCannotTell, path, ctx.Err())
		case <-time.After(execPoll):
		}
	}
}

// execPoll is how often readArgv looks again at an empty cmdline.
const execPoll = time.Millisecond

// inflightKey names one read of one process's file: pid and start time, so
// a read begun on a process that has since died is never shared with a new
// process under its pid.
type inflightKey struct {
	pid   int
	start uint64
	path  string
}

type inflightRead struct {
	done chan struct{}
	b    []byte
	err  error
}

// inflight holds the memory reads still running. A read blocked on a mmap
// lock cannot be cancelled; sharing it keeps a caller that retries every
// few seconds from piling up goroutines (each an OS thread in a syscall).
var inflight = struct {
	sync.Mutex
	m map[inflightKey]*inflightRead
}{m: map[inflightKey]*inflightRead{}}

func startRead(key inflightKey, read func(string) ([]byte, error)) *inflightRead {
	inflight.Lock()
	defer inflight.Unlock()
	if r, ok := inflight.m[key]; ok {
		return r
	}
	r := &inflightRead{done: make(chan struct{})}
	inflight.m[key] = r
	go func() {
		r.b, r.err = read(key.path)
		inflight.Lock()
		delete(inflight.m, key)
		inflight.Unlock()
		close(r.done)
	}()
	return r
}

// splitNUL splits a NUL-separated /proc file (cmdline, environ).
func splitNUL(b []byte) []string {
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
