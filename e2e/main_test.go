package e2e

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmflow/internal/devserver"
)

// TestMain makes the test process a child subreaper before any test starts
// a host agent: a QEMU whose agent was killed with SIGKILL is re-parented to
// the nearest subreaper instead of to PID 1, and PID 1 of this sandbox never
// reaps orphans (FACTS.md), so without this every such QEMU would stay a
// zombie. In production systemd (PID 1) plays this part. The reaper below
// waits only for QEMU zombies: the test's own children (dev server, agent,
// worker, Chromium) are reaped by their exec.Cmd, and waiting for them here
// would steal their exit status.
func TestMain(m *testing.M) {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: prctl(PR_SET_CHILD_SUBREAPER): %v\n", err)
		os.Exit(1)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		reapOrphanQEMUs(ctx)
	}()
	code := m.Run()
	cancel()
	wg.Wait()
	if err := devserver.StopShared(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: stop shared dev server: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	if binaries.dir != "" {
		if err := os.RemoveAll(binaries.dir); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: remove built binaries: %v\n", err)
		}
	}
	printTimings()
	os.Exit(code)
}

// reapOrphanQEMUs waits for every zombie child of this process whose
// command is QEMU, until ctx ends. Polling /proc is the only way to wait for
// some children but not others: wait4(-1) would take any child.
func reapOrphanQEMUs(ctx context.Context) {
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

// timings records how long each test took, printed after the run (the
// issue asks for each test's time).
var timings struct {
	mu   sync.Mutex
	rows []string
}

// timeTest records t's wall time when it ends.
func timeTest(t *testing.T) {
	begin := time.Now()
	t.Cleanup(func() {
		status := "ok"
		switch {
		case t.Skipped():
			status = "skipped"
		case t.Failed():
			status = "FAILED"
		}
		timings.mu.Lock()
		defer timings.mu.Unlock()
		timings.rows = append(timings.rows, fmt.Sprintf("%-40s %8.1fs  %s", t.Name(), time.Since(begin).Seconds(), status))
	})
}

func printTimings() {
	timings.mu.Lock()
	defer timings.mu.Unlock()
	if len(timings.rows) == 0 {
		return
	}
	slices.Sort(timings.rows)
	fmt.Println("e2e timings:")
	for _, r := range timings.rows {
		fmt.Println("  " + r)
	}
}
