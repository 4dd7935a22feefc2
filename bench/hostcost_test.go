package bench

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/stacktest"
)

// hostCostRatio is issue 36's goal: the agent's CPU per launch and per
// release at 1,000 VMs on a host is at most this times its CPU at 10.
const hostCostRatio = 1.2

// hostCostHost is the agent's host side in this process, as daemon/agent
// wires it for a VM without GPUs or network: the store (with its index,
// as the agent opens it), the capacity ledger and the supervisor launching the
// stub VMM through the real jail (this test binary is the setup stage).
type hostCostHost struct {
	st  *store.Store
	cap *lease.Capacity
	sup *supervise.Supervisor
	eng *lease.Engine
}

func newHostCostHost(t *testing.T, stub string, uids store.UIDRange) *hostCostHost {
	t.Helper()
	dir := proctest.ShortDir(t, "hc")
	st, err := store.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.OpenIndex(ctxFor(t, time.Minute), supervise.UIDsInUse("")); err != nil {
		t.Fatal(err)
	}
	// A ledger big enough for every VM of the run: the sums are what is
	// measured, not a refusal.
	capy, err := lease.NewCapacity(lease.CapacityConfig{Store: st, CPUs: 1024, MemoryMiB: 8 << 20, MemoryReserveMiB: 1024})
	if err != nil {
		t.Fatal(err)
	}
	sup, err := supervise.New(supervise.Config{Store: st, QEMU: stub, QEMUUIDs: uids, JailSetup: os.Args[0],
		PlaceCapacity: capy.Place, GracefulTimeout: 5 * time.Second, ReadyTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sup.Start(ctxFor(t, time.Minute)); err != nil {
		t.Fatal(err)
	}
	h := &hostCostHost{st: st, cap: capy, sup: sup, eng: lease.NewHostEngine(lease.EngineConfig{Store: st}, nil, nil)}
	t.Cleanup(func() {
		// The fill's VMs are killed (identity checked) and reaped by their
		// supervisor's watchers before it closes.
		recs, _ := st.List()
		for _, r := range recs {
			if p := r.GetProcess(); p != nil {
				_ = proc.Signal(store.IdentityOf(p), unix.SIGKILL)
			}
		}
		for _, r := range recs {
			if p := r.GetProcess(); p != nil {
				_ = h.sup.WaitExit(ctxFor(t, 10*time.Second), r.GetId(), nil)
			}
		}
		_ = sup.Close()
	})
	return h
}

// launch is CreateRecord (with its reservation) and LaunchVM of one VM.
func (h *hostCostHost) launch(ctx context.Context, id string) error {
	spec := &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: string(vmm.AccelTCG),
		Uuid: "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab"}
	if _, err := h.st.Create(ctx, &vmflowv1.InstanceRecord{Id: id, Spec: spec},
		store.Reserving(h.cap.Reserve(id, spec))); err != nil {
		return err
	}
	_, err := h.sup.Launch(ctx, id)
	return err
}

// release is the delete's host activities: BeginDelete, StopVM, WaitVMExit,
// ReleaseLeases, TearDown, DeleteRecord.
func (h *hostCostHost) release(ctx context.Context, id string) error {
	if err := h.st.MarkManualStop(ctx, id); err != nil {
		return err
	}
	l, err := h.st.Lock(ctx, id)
	if err != nil {
		return err
	}
	_, err = l.BeginDelete(store.Spawn{})
	_ = l.Unlock()
	if err != nil {
		return err
	}
	if _, err := h.sup.Stop(ctx, id, 5*time.Second); err != nil {
		return err
	}
	if err := h.sup.WaitExit(ctx, id, nil); err != nil {
		return err
	}
	if _, err := h.eng.Release(ctx, id); err != nil {
		return err
	}
	if err := h.sup.TearDown(ctx, id); err != nil {
		return err
	}
	return h.st.Delete(ctx, id)
}

// cpuNow is this process's user+system CPU: the agent's, as the VMs (the
// jail's setup stage, the stubs) are other processes.
func cpuNow() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// hostCostSizes are the host's VM counts measured (VMFLOW_HOSTCOST_SIZES,
// e.g. "10,100", for development).
func hostCostSizes(t *testing.T) []int {
	v := os.Getenv("VMFLOW_HOSTCOST_SIZES")
	if v == "" {
		if quick() {
			return []int{10, 50}
		}
		return []int{10, 100, 1000}
	}
	var out []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("VMFLOW_HOSTCOST_SIZES: %v", err)
		}
		out = append(out, n)
	}
	return out
}

// hostCostRow is one host size's measurement.
type hostCostRow struct {
	vms                int
	launch, release    time.Duration // agent CPU per VM, the median round
	launchWall, relWal time.Duration // wall time per VM, the median round
	// launchRatio and releaseRatio are this size's CPU over the first
	// size's in the same round, the median round.
	launchRatio, releaseRatio float64
}

// hostCost measures the agent's CPU per launch and per release with 10,
// 100 and 1,000 VMs on one host (issue 36). One host side per size, each
// with its own state dir and uid range, is filled to its size; then rounds
// of a batch of launches and the batch's releases run one at a time on
// each host in turn, and the process's CPU is read around each batch, so
// every size is measured under the same load of a shared machine.
func hostCost(t *testing.T) string {
	stub := stacktest.BuildStubVMM(t)
	sizes := hostCostSizes(t)
	batch, rounds := reps(10, 5), reps(9, 1)
	hosts := make([]*hostCostHost, len(sizes))
	for i, size := range sizes {
		first := 2_000_000_000 + uint32(os.Getpid()%1_000)*100_000 + uint32(i)*20_000
		hosts[i] = newHostCostHost(t, stub, store.UIDRange{First: first, Last: first + uint32(size+batch+100)})
		// A warm-up launch and release (page cache, first-use
		// allocations), not measured.
		for j := range 3 {
			id := fmt.Sprintf("warm-%d", j)
			if err := hosts[i].launch(ctxFor(t, time.Minute), id); err != nil {
				t.Fatal(err)
			}
			if err := hosts[i].release(ctxFor(t, time.Minute), id); err != nil {
				t.Fatal(err)
			}
		}
		hosts[i].fill(t, size)
	}
	time.Sleep(2 * time.Second) // the fill's tail (exit watchers, log pumps) settles
	c0, w0 := cpuNow(), time.Now()
	time.Sleep(3 * time.Second)
	idle := time.Duration(float64(cpuNow()-c0) / time.Since(w0).Seconds())

	if out := os.Getenv("VMFLOW_HOSTCOST_CPUPROFILE"); out != "" {
		// Where the agent's CPU goes (go tool pprof).
		f, err := os.Create(out)
		if err != nil {
			t.Fatal(err)
		}
		runtime.SetCPUProfileRate(1000) // the batches are short: 10× the default's samples
		if err := pprof.StartCPUProfile(f); err != nil {
			t.Fatal(err)
		}
		defer func() { pprof.StopCPUProfile(); _ = f.Close() }()
	}
	launch := make([][]time.Duration, len(sizes))
	release := make([][]time.Duration, len(sizes))
	launchWall := make([][]time.Duration, len(sizes))
	relWall := make([][]time.Duration, len(sizes))
	ids := make([]string, batch)
	for r := range rounds {
		for k := range sizes {
			i := (k + r) % len(sizes) // each size first in turn
			h, size := hosts[i], sizes[i]
			// Labelled, so a profile splits by size (pprof -tagfocus vms=1000).
			pprof.Do(context.Background(), pprof.Labels("vms", strconv.Itoa(size)), func(context.Context) {
				c0, w0 := cpuNow(), time.Now()
				for j := range ids {
					ids[j] = fmt.Sprintf("m%d-%d-%03d", size, r, j)
					if err := h.launch(ctxFor(t, time.Minute), ids[j]); err != nil {
						t.Fatalf("launch %s at %d VMs: %v", ids[j], size, err)
					}
				}
				launch[i] = append(launch[i], (cpuNow()-c0)/time.Duration(batch))
				launchWall[i] = append(launchWall[i], time.Since(w0)/time.Duration(batch))
				c0, w0 = cpuNow(), time.Now()
				for _, id := range ids {
					if err := h.release(ctxFor(t, time.Minute), id); err != nil {
						t.Fatalf("release %s at %d VMs: %v", id, size, err)
					}
				}
				release[i] = append(release[i], (cpuNow()-c0)/time.Duration(batch))
				relWall[i] = append(relWall[i], time.Since(w0)/time.Duration(batch))
			})
		}
	}
	rows := make([]hostCostRow, len(sizes))
	for i, size := range sizes {
		rows[i] = hostCostRow{vms: size, launch: medianDur(launch[i]), release: medianDur(release[i]),
			launchWall: medianDur(launchWall[i]), relWal: medianDur(relWall[i]),
			launchRatio: medianRatio(launch[i], launch[0]), releaseRatio: medianRatio(release[i], release[0])}
		t.Logf("%d VMs: per launch %s CPU (%s wall), per release %s CPU (%s wall); rounds: launch %v, release %v",
			size, rows[i].launch, rows[i].launchWall, rows[i].release, rows[i].relWal, launch[i], release[i])
	}
	// The fills' VMs are killed at cleanup (newHostCostHost).
	return hostCostMarkdown(rows, batch, rounds, idle)
}

// fill launches VMs on h until it runs n, a few at a time (not measured).
func (h *hostCostHost) fill(t *testing.T, n int) {
	began := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 4)
	for i := range n {
		id := fmt.Sprintf("fill-%04d", i)
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if err := h.launch(ctxFor(t, 2*time.Minute), id); err != nil {
				errs <- fmt.Errorf("%s: %w", id, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("host filled to %d VMs in %s", n, time.Since(began).Round(time.Millisecond))
}

// medianRatio is the median over rounds of a[r] / b[r]: the ratio of two
// figures measured under one load, then the middle one.
func medianRatio(a, b []time.Duration) float64 {
	r := make([]float64, 0, len(a))
	for i := range a {
		if b[i] > 0 {
			r = append(r, float64(a[i])/float64(b[i]))
		}
	}
	if len(r) == 0 {
		return 0
	}
	slices.Sort(r)
	return r[len(r)/2]
}

func hostCostMarkdown(rows []hostCostRow, batch, rounds int, idle time.Duration) string {
	var b strings.Builder
	b.WriteString("## Host agent CPU per launch and per release, by VMs on the host\n\n")
	fmt.Fprintf(&b, "The host side of an agent in the bench process (store with its index, capacity ledger, supervisor; no Temporal), launching the stub VMM through the real jail, as daemon/agent wires them for a VM without GPUs or network. One host side per size (its own state dir and uid range) is filled to its size; then %d rounds, each host in turn (each first in turn), of %d launches (CreateRecord with its reservation, LaunchVM) and their %d releases (BeginDelete, StopVM, WaitVMExit, ReleaseLeases, TearDown, DeleteRecord), one at a time. The process's CPU (getrusage: user + system; the VMs are other processes) is read around each batch. Figures are the median round's; a ratio is taken within each round (both sizes under the same load), then the median. The process's idle CPU with every host filled, %s ms a second, is in every figure (not subtracted). `VMFLOW_HOSTCOST_CPUPROFILE=<file>` profiles the rounds, labelled by size (`go tool pprof -tagfocus vms=1000`).\n\n", rounds, batch, batch, MS(idle))
	tab := Table{Header: []string{"VMs on the host", "CPU per launch", "÷ first size, same round", "CPU per release", "÷ first size, same round", "wall per launch", "wall per release"}}
	for _, r := range rows {
		tab.Add(strconv.Itoa(r.vms), MS(r.launch)+" ms", fmt.Sprintf("%.2f×", r.launchRatio), MS(r.release)+" ms",
			fmt.Sprintf("%.2f×", r.releaseRatio), MS(r.launchWall)+" ms", MS(r.relWal)+" ms")
	}
	b.WriteString(tab.Markdown() + "\n")
	if len(rows) >= 2 {
		lo, hi := rows[0], rows[len(rows)-1]
		for _, m := range []struct {
			what   string
			ratio  float64
			lo, hi time.Duration
		}{{"launch", hi.launchRatio, lo.launch, hi.launch}, {"release", hi.releaseRatio, lo.release, hi.release}} {
			verdict := "met"
			if m.ratio > hostCostRatio {
				verdict = "missed"
			}
			fmt.Fprintf(&b, "**Agent CPU per %s, %d VMs ÷ %d: %s** — %.2f× (goal ≤ %.1f×; the median round's ratio; medians %s ms against %s ms).\n\n",
				m.what, hi.vms, lo.vms, verdict, m.ratio, hostCostRatio, MS(m.hi), MS(m.lo))
		}
	}
	return b.String()
}
