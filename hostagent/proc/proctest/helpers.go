package proctest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
)

// The helpers below are shared by every package whose tests run real
// processes, vmm's own in-package tests among them: those cannot import
// vmmtest (it imports vmm), so what they share with it lives here, below
// both.

// RequiresBinary returns program's path, or skips tb saying how to get it
// (CI installs them all, so nothing is skipped there).
func RequiresBinary(tb testing.TB, program, hint string) string {
	tb.Helper()
	p, err := exec.LookPath(program)
	if err != nil {
		tb.Skipf("needs %s (%s): %v", program, hint, err)
	}
	return p
}

// RequiresRoot skips tb unless the test runs as root, saying why it needs
// root (why: "QEMU is exec'd as a uid of its own"). CI runs as root.
func RequiresRoot(tb testing.TB, why string) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skipf("needs root: %s", why)
	}
}

// RequiresFUSE skips tb when this machine has no /dev/fuse, or it cannot be
// opened. CI has it, so nothing is skipped there.
func RequiresFUSE(tb testing.TB) {
	tb.Helper()
	f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENODEV) {
		tb.Skipf("skipping: /dev/fuse is missing (%v); the test mounts a FUSE file system", err)
	}
	if err != nil {
		tb.Skipf("skipping: /dev/fuse cannot be opened (%v); the test mounts a FUSE file system, as root", err)
	}
	f.Close()
}

// RequiresKVM skips tb unless the tests run under KVM (Accel, given
// vmm.CheckKVM's answer): for the checks of KVM itself.
func RequiresKVM(tb testing.TB, kvmUsable error) {
	tb.Helper()
	if Accel(kvmUsable) != "kvm" {
		tb.Skipf("tests KVM itself; this run uses TCG (%s)", AccelReason())
	}
}

// KVMOpens reports whether this process can open /dev/kvm read-write.
func KVMOpens() bool {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return false
	}
	f.Close()
	return true
}

// ShortDir is a fresh /tmp directory, removed after the test: a unix socket
// path holds at most 107 bytes, which t.TempDir can exceed.
func ShortDir(tb testing.TB, prefix string) string {
	tb.Helper()
	d, err := os.MkdirTemp("/tmp", prefix)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// Context is a context for one step of a test: it ends after d, or with
// the test.
func Context(tb testing.TB, d time.Duration) context.Context {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	tb.Cleanup(cancel)
	return ctx
}

// BecomeSubreaper makes this process a child subreaper, as systemd is in
// production: this sandbox's PID 1 never reaps orphans (FACTS.md), so a
// killed agent's QEMU would stay a zombie. Call in TestMain; reap what it adopts.
func BecomeSubreaper() error {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_CHILD_SUBREAPER): %w", err)
	}
	return nil
}

// Children lists the processes whose parent is ppid, as proc reads them
// (a process gone meanwhile is left out).
func Children(ppid int) []proc.Stat {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []proc.Stat
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, err := proc.ReadStat(pid); err == nil && st.PPID == ppid {
			out = append(out, st)
		}
	}
	return out
}

// ZombieChildren lists this process's <defunct> children as "pid(comm)".
func ZombieChildren() []string {
	var out []string
	for _, st := range Children(os.Getpid()) {
		if st.State == 'Z' {
			out = append(out, fmt.Sprintf("%d(%s)", st.PID, st.Comm))
		}
	}
	return out
}

// AssertNoZombieChildren checks that no <defunct> child of this test is
// left, allowing a reaper that runs meanwhile a few seconds.
func AssertNoZombieChildren(t testing.TB) {
	t.Helper()
	assert.Eventually(t, func() bool { return len(ZombieChildren()) == 0 }, 5*time.Second, 5*time.Millisecond,
		"<defunct> children left: %v", ZombieChildren())
}

// UninspectableInit is the IgnoreUninspectable pids: PID 1 where even root
// cannot read its fds (this sandbox), else none, or no release would go ahead.
func UninspectableInit() []int {
	if _, err := os.Readlink("/proc/1/fd/0"); errors.Is(err, os.ErrPermission) {
		return []int{1}
	}
	return nil
}
