package stacktest

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// BecomeSubreaper makes this process a child subreaper: a QEMU whose agent
// was killed with SIGKILL is re-parented to the nearest subreaper instead of
// to PID 1, and PID 1 of this sandbox never reaps orphans (FACTS.md), so
// without it every such QEMU would stay a zombie. In production systemd
// (PID 1) plays this part. Call it in TestMain before any test starts a host
// agent, and run a reaper (StartReaper).
func BecomeSubreaper() error {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_CHILD_SUBREAPER): %w", err)
	}
	return nil
}

// StartReaper runs reap in a goroutine until stop is called; stop waits
// until reap has returned.
func StartReaper(reap func(ctx context.Context)) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		reap(ctx)
	}()
	return func() {
		cancel()
		wg.Wait()
	}
}

// ReapOrphanQEMUs waits for every zombie child of this process whose
// command is QEMU, until ctx ends. It waits only for QEMU zombies: the
// test's own children (dev server, agent, worker, Chromium) are reaped by
// their exec.Cmd, and waiting for them here would steal their exit status.
// Polling /proc is the only way to wait for some children but not others:
// wait4(-1) would take any child.
//
// A process that starts QEMUs itself through exec.Cmd must not run it (they
// too would lose their exit status): bench reaps only the pids it adopted.
func ReapOrphanQEMUs(ctx context.Context) {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	self := os.Getpid()
	for {
		for _, pid := range zombieQEMUChildren(self) {
			var ws unix.WaitStatus
			// WNOHANG: the pid was seen as a zombie, so this returns at once;
			// an error means someone else reaped it, which is fine.
			_, _ = unix.Wait4(pid, &ws, unix.WNOHANG, nil)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// zombieQEMUChildren lists the pids of zombie QEMUs whose parent is ppid.
func zombieQEMUChildren(ppid int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// comm may hold spaces and parentheses: fields follow the last ')'.
		s := string(b)
		open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || end < open {
			continue
		}
		comm := s[open+1 : end]
		f := strings.Fields(s[end+1:])
		if len(f) < 2 || f[0] != "Z" || f[1] != strconv.Itoa(ppid) || !strings.HasPrefix(comm, "qemu-system") {
			continue
		}
		pids = append(pids, pid)
	}
	return pids
}

// PollUntil checks cond every period until it holds or ctx ends.
func PollUntil(ctx context.Context, every time.Duration, cond func() bool) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}
