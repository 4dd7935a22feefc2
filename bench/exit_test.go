package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/testsupport/stacktest"
)

// detector waits, its own way, until it believes the process is gone.
type detector struct {
	name string
	what string
	fn   func(ctx context.Context, id proc.Identity) error
}

var (
	detPidfd = detector{"vmflow: pidfd", "`proc.Open(id).Wait` (pidfd poll: readable once the thread group is empty)",
		func(ctx context.Context, id proc.Identity) error {
			h, err := proc.Open(id)
			if err != nil {
				return fmt.Errorf("open: %w", err)
			}
			defer h.Close()
			if !h.UsesPidfd() {
				return errors.New("no pidfd on this kernel: the table would not measure vmflow's path")
			}
			return h.Wait(ctx)
		}}
	detProcPoll = detector{"/proc poll 10 ms", "`proc.Open(id, WithPolling(), WithPollInterval(10ms)).Wait`: alive while not Z, or Z with more than one task",
		func(ctx context.Context, id proc.Identity) error {
			h, err := proc.Open(id, proc.WithPolling(), proc.WithPollInterval(10*time.Millisecond))
			if err != nil {
				return fmt.Errorf("open: %w", err)
			}
			defer h.Close()
			return h.Wait(ctx)
		}}
	// kill(pid, 0) succeeds on a zombie: it only sees the process go once
	// its parent reaps it (here promptly: this process is the parent).
	detKill0 = detector{"kill(0) poll 500 ms", "`kill(pid, 0)` every 500 ms until ESRCH",
		func(ctx context.Context, id proc.Identity) error {
			return stacktest.PollUntil(ctx, 500*time.Millisecond, func() bool {
				return errors.Is(unix.Kill(id.PID, 0), unix.ESRCH)
			})
		}}
	// The floor: a blocking poll(2) on a pidfd from a thread of its own,
	// no Go netpoller in between. Nothing in user space sees the exit
	// sooner; what is left is the kernel's exit_group teardown and a
	// wake-up, which a busy 2-core machine stretches.
	detFloor = detector{"floor: blocking poll(2) on a pidfd", "`pidfd_open` + blocking `poll(2)` on a locked OS thread (no Go netpoller): the kernel's own latency, for reference",
		func(ctx context.Context, id proc.Identity) error {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			fd, err := unix.PidfdOpen(id.PID, 0)
			if err != nil {
				return fmt.Errorf("pidfd_open: %w", err)
			}
			defer unix.Close(fd)
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			for ctx.Err() == nil {
				// 1 s timeout only so a cancelled ctx is noticed.
				n, err := unix.Poll(fds, 1000)
				if err != nil && !errors.Is(err, unix.EINTR) {
					return fmt.Errorf("poll: %w", err)
				}
				if n > 0 {
					return nil
				}
			}
			return ctx.Err()
		}}
	// The naive check vmflow's rule replaces, shown for contrast: "the
	// leader is Z or gone" is wrong while another thread lives.
	detLeader = detector{"naive: leader Z, 10 ms", "leader state in `/proc/<pid>/stat` is Z or the pid is gone (contrast only)",
		func(ctx context.Context, id proc.Identity) error {
			return stacktest.PollUntil(ctx, 10*time.Millisecond, func() bool {
				st, err := proc.ReadStat(id.PID)
				return err != nil || st.State == 'Z'
			})
		}}
)

type detStats struct {
	lat   []time.Duration // exit → detection, for detections after the exit
	early int             // "gone" while the last thread still ran
	n     int
}

// race runs dets concurrently on the same zombie-leader helper, reps
// times. Before the last thread exits each detector gets 20 ms plus a
// random part of jitter: a wrong method gets its chance to be wrong, and
// the exit lands at a random phase of a poller's period, as a real one does.
func race(t *testing.T, dets []detector, n int, jitter time.Duration) []detStats {
	out := make([]detStats, len(dets))
	for range n {
		z := proctest.StartZombie(t)
		id, err := proc.ReadIdentity(z.PID)
		if err != nil {
			t.Fatalf("identity of helper: %v", err)
		}
		if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", z.PID)); err == nil {
			helperThreads = len(ents)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		at := make([]time.Duration, len(dets))
		var wg sync.WaitGroup
		for i, d := range dets {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := d.fn(ctx, id); err != nil {
					t.Errorf("%s: %v", d.name, err)
				}
				at[i] = proctest.MonotonicNow()
			}()
		}
		// A deliberate measurement window, not a synchronisation: how long
		// the helper stays a zombie leader with a live thread.
		time.Sleep(20*time.Millisecond + rand.N(jitter))
		exitAt := z.Release(t)
		wg.Wait()
		cancel()
		for i := range dets {
			out[i].n++
			if at[i] < exitAt {
				out[i].early++
				continue
			}
			out[i].lat = append(out[i].lat, at[i]-exitAt)
		}
	}
	return out
}

func absDur(d time.Duration) time.Duration { return max(d, -d) }

// tailGap says what vmflow's pidfd path adds over the floor.
func tailGap(vmflow, floor Summary) string {
	gap := vmflow.P99 - floor.P99
	if gap < 100*time.Microsecond {
		return "vmflow's path adds nothing measurable to it."
	}
	return fmt.Sprintf("vmflow's path adds nothing at the median; its p99 is %s ms above the floor's, the Go runtime waking the goroutine parked on the pidfd through its netpoller (the floor's thread is already blocked in poll(2)) on a busy machine — the tail of 300 samples, which moves from run to run.", MS(gap))
}

// helperThreads is how many tasks the last zombie helper had just before
// its release (leader included): all of them must exit before the pidfd
// fires.
var helperThreads int

func exitDetection(t *testing.T) string {
	// Round 1: the 10 ms pollers against the pidfd, many times (each
	// round is short). Round 2: the 500 ms kill(0) poll against the pidfd
	// again, fewer times (each round waits up to half a second).
	nA, nB := reps(300, 30), reps(60, 8)
	a := race(t, []detector{detPidfd, detFloor, detProcPoll, detLeader}, nA, 10*time.Millisecond)
	b := race(t, []detector{detPidfd, detKill0}, nB, 500*time.Millisecond)

	tab := Table{Header: []string{"method", "round", "N", "median ms", "p99 ms", "median ÷ pidfd median (same round)", "reported gone while a thread lived"}}
	row := func(d detector, round string, s, base detStats) Summary {
		sum := Summarize(s.lat)
		ratio := Ratio(sum.Median, Summarize(base.lat).Median)
		med, p99 := MS(sum.Median), MS(sum.P99)
		if len(s.lat) == 0 {
			med, p99, ratio = "—", "—", "—"
		}
		tab.Add(d.name, round, fmt.Sprint(s.n), med, p99, ratio, fmt.Sprintf("%d of %d", s.early, s.n))
		return sum
	}
	pidA := row(detPidfd, "1", a[0], a[0])
	floor := row(detFloor, "1", a[1], a[0])
	row(detProcPoll, "1", a[2], a[0])
	row(detLeader, "1", a[3], a[0])
	pidB := row(detPidfd, "2", b[0], b[0])
	row(detKill0, "2", b[1], b[0])

	var s strings.Builder
	s.WriteString("## 1. Exit detection on a zombie leader\n\n")
	s.WriteString("The `proctest` helper: its leader thread has called `exit(2)` (state Z) while one other thread runs, as a QEMU whose vhost/KVM worker outlives the leader. The detectors of a round watch the same helper concurrently; the time is from the last thread's `exit_group` (CLOCK_MONOTONIC, written by the thread itself) to the detector returning. Round 1 releases the thread 20–30 ms after the detectors start, round 2 20–520 ms after (a random phase of the 500 ms period).\n\n")
	s.WriteString(tab.Markdown() + "\n")
	for _, d := range []detector{detPidfd, detFloor, detProcPoll, detKill0, detLeader} {
		fmt.Fprintf(&s, "- %s: %s\n", d.name, d.what)
	}
	s.WriteString("\n" + target(fmt.Sprintf("Target: vmflow's exit detection p99 under 1 ms (round 1, N=%d; round 2: %s ms)", a[0].n, MS(pidB.P99)), pidA.P99, time.Millisecond))
	fmt.Fprintf(&s, " Why: the floor — a blocking poll(2) on a pidfd, nothing in between — has a median of %s ms and a p99 of %s ms in the same round, and vmflow's pidfd path is within %s ms of it at the p99 (%s ms at the median). What remains is the kernel's own work after the thread's clock read: the helper's `exit_group` must stop its other %d runtime threads and tear down its address space before the group counts as empty, and on a loaded 2-core machine those threads wait for a CPU. No user-space detector can beat that. %s",
		MS(floor.Median), MS(floor.P99), MS(absDur(pidA.P99-floor.P99)), MS(absDur(pidA.Median-floor.Median)), helperThreads-1, tailGap(pidA, floor))
	early := a[0].early + b[0].early
	if early == 0 {
		fmt.Fprintf(&s, " **Never early: met** — 0 of %d.\n", a[0].n+b[0].n)
	} else {
		fmt.Fprintf(&s, " **Never early: MISSED** — %d of %d.\n", early, a[0].n+b[0].n)
		t.Errorf("pidfd reported gone early %d times", early)
	}
	return s.String()
}
