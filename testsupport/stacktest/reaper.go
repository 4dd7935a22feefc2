package stacktest

import (
	"context"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc/proctest"
)

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

// ReapOrphanQEMUs reaps this process's zombie QEMU children until ctx ends,
// polling /proc, as wait4(-1) would steal other children's exit status. Not for
// a process that starts QEMUs through exec.Cmd itself (bench reaps its adopted pids).
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

// zombieQEMUChildren lists the pids of zombie QEMUs (or stub VMMs) whose
// parent is ppid.
func zombieQEMUChildren(ppid int) []int {
	var pids []int
	for _, st := range proctest.Children(ppid) {
		if st.State == 'Z' && (strings.HasPrefix(st.Comm, "qemu-system") || st.Comm == StubVMMComm) {
			pids = append(pids, st.PID)
		}
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
