package proc_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// detector waits, in its own way, until it believes pid's process is gone.
type detector func(ctx context.Context, id proc.Identity) error

func pollUntil(ctx context.Context, every time.Duration, gone func() bool) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for !gone() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

var detectors = []struct {
	name   string
	period time.Duration // polling period; the exit lands at a random phase of it
	fn     detector
}{
	{"pidfd", 0, func(ctx context.Context, id proc.Identity) error {
		h, err := proc.Open(id)
		if err != nil {
			return err
		}
		defer h.Close()
		return h.Wait(ctx)
	}},
	{"proc-poll-10ms", 10 * time.Millisecond, func(ctx context.Context, id proc.Identity) error {
		h, err := proc.Open(id, proc.WithPolling(), proc.WithPollInterval(10*time.Millisecond))
		if err != nil {
			return err
		}
		defer h.Close()
		return h.Wait(ctx)
	}},
	// kill(pid, 0) succeeds on a zombie, so it only sees the process go once
	// its parent reaps it (here, promptly: the benchmark is the parent).
	{"kill0-poll-500ms", 500 * time.Millisecond, func(ctx context.Context, id proc.Identity) error {
		return pollUntil(ctx, 500*time.Millisecond, func() bool {
			return errors.Is(unix.Kill(id.PID, 0), unix.ESRCH)
		})
	}},
	// The naive check this package exists to replace: "leader is Z or gone".
	{"leader-state-poll-10ms", 10 * time.Millisecond, func(ctx context.Context, id proc.Identity) error {
		return pollUntil(ctx, 10*time.Millisecond, func() bool {
			st, err := proc.ReadStat(id.PID)
			return err != nil || st.State == 'Z'
		})
	}},
}

// BenchmarkExitDetection measures, on a zombie leader whose last thread
// exits, the time from that exit to each method noticing, and counts how
// often a method reports "gone" while the thread was still alive.
//
//	go test -run '^$' -bench ExitDetection -benchtime 40x ./hostagent/proc
func BenchmarkExitDetection(b *testing.B) {
	for _, d := range detectors {
		b.Run(d.name, func(b *testing.B) {
			var lat []time.Duration
			early := 0
			for i := 0; i < b.N; i++ {
				z := proctest.StartZombie(b)
				id, err := proc.ReadIdentity(z.PID)
				require.NoError(b, err)
				detected := make(chan time.Duration, 1)
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				go func() {
					err := d.fn(ctx, id)
					if err != nil {
						b.Error(err)
					}
					detected <- proctest.MonotonicNow()
				}()
				// Give a wrong method the chance to be wrong before the
				// thread exits, and let the exit land at a random phase
				// of a poller's period, as a real one does.
				pause := 20 * time.Millisecond
				if d.period > 0 {
					pause += rand.N(d.period)
				}
				time.Sleep(pause)
				exitAt := z.Release(b)
				at := <-detected
				cancel()
				if at < exitAt {
					early++
					continue
				}
				lat = append(lat, at-exitAt)
			}
			b.ReportMetric(float64(early)/float64(b.N), "early/op")
			if len(lat) > 0 {
				slices.Sort(lat)
				b.ReportMetric(ms(lat[len(lat)/2]), "p50-ms")
				b.ReportMetric(ms(lat[(len(lat)*99)/100]), "p99-ms")
			}
		})
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func BenchmarkParseStat(b *testing.B) {
	line := []byte("4242 (qemu-system-x86) S 1 4242 4242 0 -1 4194560 12345 0 0 0 10 20 0 0 20 0 5 0 987654 1234567890 1000 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := proc.ParseStat(line); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkHolders scans the host for the holders of one file with a crowd
// of busy processes running (by default 100 of 20 threads and 150
// descriptors each, as a dense VM host has), reading every task's table
// (every-task, the naive scan to compare against) and each distinct table once
// (ScanFDs). Both run in one invocation, on the same crowd:
//
//	go test -run '^$' -bench Holders -benchtime 5x ./hostagent/proc
//
// VMFLOW_BENCH_CROWD=procs,threads,fds shapes the crowd.
func BenchmarkHolders(b *testing.B) {
	procs, threads, fds := 100, 20, 150
	if v := os.Getenv("VMFLOW_BENCH_CROWD"); v != "" {
		_, err := fmt.Sscanf(v, "%d,%d,%d", &procs, &threads, &fds)
		require.NoError(b, err, "VMFLOW_BENCH_CROWD=%q: want procs,threads,fds", v)
	}
	target := filepath.Join(b.TempDir(), "vfio-9")
	require.NoError(b, os.WriteFile(target, nil, 0o600))
	for range procs {
		proctest.StartCrowd(b, threads, fds)
	}
	for _, m := range []struct {
		name string
		scan func(context.Context) (*proc.FDScan, error)
	}{{"every-task", proc.ScanFDsEveryTask}, {"one-per-table", proc.ScanFDs}} {
		b.Run(m.name, func(b *testing.B) {
			for b.Loop() {
				s, err := m.scan(context.Background())
				require.NoError(b, err)
				hs, err := s.Holders(target)
				require.NoError(b, err)
				require.Empty(b, proctest.Certain(hs))
			}
		})
	}
}
