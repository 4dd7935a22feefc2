package supervise

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// BenchmarkReattach measures Supervisor.Start over N records of live
// -machine none VMs (N=20, VMFLOW_BENCH_REATTACH_N overrides): list and
// decode the records, take each instance's locks, open and verify a pidfd
// per VM, start its exit watcher. Reports ms/reattach (per VM).
//
//	go test -run '^$' -bench BenchmarkReattach ./hostagent/supervise/
func BenchmarkReattach(b *testing.B) {
	n := 20
	if v := os.Getenv("VMFLOW_BENCH_REATTACH_N"); v != "" {
		var err error
		n, err = strconv.Atoi(v)
		require.NoError(b, err)
	}
	e := newEnv(b)
	launcher := e.newSupervisor(nil)
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("vm%d", i)
		e.create(ids[i], "on-failure", 0)
	}
	launchAll(b, launcher, ids, 8)
	// The VMs keep running without their supervisor, as after an agent exit.
	require.NoError(b, launcher.Close())

	var total time.Duration
	var runs int
	for b.Loop() {
		sup, err := New(Config{Store: e.st})
		require.NoError(b, err)
		rep, err := sup.Start(ctxT(b, 60*time.Second))
		require.NoError(b, err)
		if rep.Attached != n {
			b.Fatalf("attached %d of %d", rep.Attached, n)
		}
		total += rep.Duration
		runs++
		b.StopTimer()
		require.NoError(b, sup.Close())
		b.StartTimer()
	}
	b.ReportMetric(float64(total.Microseconds())/1000/float64(runs*n), "ms/reattach")
	b.ReportMetric(float64(n), "vms")
}

// launchAll launches ids in parallel (QEMU takes ~100 ms to answer QMP),
// width at a time, and fails tb on any error.
func launchAll(tb testing.TB, sup *Supervisor, ids []string, width int) {
	tb.Helper()
	sem := make(chan struct{}, width)
	var wg sync.WaitGroup
	errs := make([]error, len(ids))
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			_, errs[i] = sup.Launch(ctxT(tb, 60*time.Second), ids[i])
		}()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(tb, err)
	}
}
