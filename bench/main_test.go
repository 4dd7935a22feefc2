package bench

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
	"vmflow/testsupport/stacktest"
)

// envBench gates the driver: `make test` runs this package's unit tests
// only, never the minutes-long measurements.
const envBench = "VMFLOW_BENCH"

// adopted holds pids of QEMUs this process may reap: the VMs a killed host
// agent left behind, re-parented here because this process is a child
// subreaper. Only those: the raw-baseline QEMUs and helpers this process
// starts itself are reaped by their own exec.Cmd, and reaping them here
// would steal their exit status.
var adopted struct {
	mu   sync.Mutex
	pids map[int]bool
}

func adopt(pids ...int) {
	adopted.mu.Lock()
	defer adopted.mu.Unlock()
	if adopted.pids == nil {
		adopted.pids = map[int]bool{}
	}
	for _, p := range pids {
		adopted.pids[p] = true
	}
}

// TestMain turns the binary into a proctest helper when asked (the
// zombie-leader process of the exit-detection table), and, for a benchmark
// run, into a child subreaper: a QEMU whose agent was killed with SIGKILL
// comes to this process instead of PID 1, which here never reaps orphans
// (measured: in this sandbox an orphan stays a zombie after it exits). In
// production systemd plays this part.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == vmm.JailSetupCommand {
		// The jail's setup stage of the hostcost section's VMs.
		os.Exit(vmm.JailMain(os.Args[2:]))
	}
	proctest.RunHelperIfRequested()
	if os.Getenv(envBench) != "1" {
		os.Exit(m.Run())
	}
	if err := proctest.BecomeSubreaper(); err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(1)
	}
	stopReaper := stacktest.StartReaper(reapAdopted)
	code := m.Run()
	stopReaper()
	os.Exit(code)
}

// reapAdopted reaps adopted QEMUs once they are zombies. Polling is the
// only way to wait for some children and not others (wait4(-1) takes any).
// Not stacktest.ReapOrphanQEMUs: that one takes every zombie QEMU child,
// including the raw-baseline QEMUs this process starts itself.
func reapAdopted(ctx context.Context) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		adopted.mu.Lock()
		pids := make([]int, 0, len(adopted.pids))
		for p := range adopted.pids {
			pids = append(pids, p)
		}
		adopted.mu.Unlock()
		for _, pid := range pids {
			var ws unix.WaitStatus
			// WNOHANG: returns at once while it still runs; ECHILD means it
			// is not (or no longer) our child.
			got, err := unix.Wait4(pid, &ws, unix.WNOHANG, nil)
			if got == pid || err != nil {
				adopted.mu.Lock()
				if got == pid || isNotChild(pid) {
					delete(adopted.pids, pid)
				}
				adopted.mu.Unlock()
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// isNotChild: pid's parent is not this process (or pid is gone).
func isNotChild(pid int) bool {
	st, err := proc.ReadStat(pid)
	return err != nil || st.PPID != os.Getpid()
}
