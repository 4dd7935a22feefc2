package e2e

import (
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"vmflow/hostagent/proc/proctest"
	"vmflow/testsupport/devserver"
	"vmflow/testsupport/stacktest"
)

// TestMain makes the test process a child subreaper before any test starts
// a host agent (proctest.BecomeSubreaper says why), and reaps the QEMUs it
// inherits. The reaper waits only for QEMU zombies: the test's own children
// (dev server, agent, worker, Chromium) are reaped by their exec.Cmd, and
// waiting for them here would steal their exit status.
func TestMain(m *testing.M) {
	if err := proctest.BecomeSubreaper(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
		os.Exit(1)
	}
	stopReaper := stacktest.StartReaper(stacktest.ReapOrphanQEMUs)
	code := m.Run()
	stopReaper()
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
