package bench

import (
	"context"
	"fmt"
	"os"
	"runtime/pprof"
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
	launch, release    time.Duration // agent CPU per VM
	launchWall, relWal time.Duration // wall time per VM
	idle               time.Duration // agent CPU per second while idle at this size
}

// hostCost measures the agent's CPU per launch and per release with 10,
// 100 and 1,000 VMs on one host (issue 36): the host is filled to each
// size, then a batch of launches and the batch's releases run one at a
// time, and the process's CPU is read around each batch.
func hostCost(t *testing.T) string {
	stub := stacktest.BuildStubVMM(t)
	sizes := hostCostSizes(t)
	top := sizes[len(sizes)-1]
	batch := reps(40, 5)
	first := 2_000_000_000 + uint32(os.Getpid()%1_000)*10_000
	uids := store.UIDRange{First: first, Last: first + uint32(top+batch+100)}
	h := newHostCostHost(t, stub, uids)

	// A warm-up launch and release (page cache, first-use allocations),
	// not measured.
	for i := range 3 {
		id := fmt.Sprintf("warm-%d", i)
		if err := h.launch(ctxFor(t, time.Minute), id); err != nil {
			t.Fatal(err)
		}
		if err := h.release(ctxFor(t, time.Minute), id); err != nil {
			t.Fatal(err)
		}
	}
	var rows []hostCostRow
	n := 0
	for _, size := range sizes {
		// Fill to size, a few launches at a time (not measured).
		fill := time.Now()
		var wg sync.WaitGroup
		errs := make(chan error, size)
		sem := make(chan struct{}, 4)
		for ; n < size; n++ {
			id := fmt.Sprintf("fill-%04d", n)
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
		t.Logf("host filled to %d VMs in %s", size, time.Since(fill).Round(time.Millisecond))
		time.Sleep(2 * time.Second) // the fill's tail (exit watchers, log pumps) settles

		row := hostCostRow{vms: size}
		c0, w0 := cpuNow(), time.Now()
		time.Sleep(3 * time.Second)
		row.idle = time.Duration(float64(cpuNow()-c0) / time.Since(w0).Seconds())

		ids := make([]string, batch)
		if out := os.Getenv("VMFLOW_HOSTCOST_CPUPROFILE"); out != "" && size == top {
			// Where the agent's CPU goes at the top size (go tool pprof).
			f, err := os.Create(out)
			if err != nil {
				t.Fatal(err)
			}
			if err := pprof.StartCPUProfile(f); err != nil {
				t.Fatal(err)
			}
			defer func() { pprof.StopCPUProfile(); _ = f.Close() }()
		}
		c0, w0 = cpuNow(), time.Now()
		for i := range ids {
			ids[i] = fmt.Sprintf("m%d-%03d", size, i)
			if err := h.launch(ctxFor(t, time.Minute), ids[i]); err != nil {
				t.Fatalf("launch %s at %d VMs: %v", ids[i], size, err)
			}
		}
		row.launch, row.launchWall = (cpuNow()-c0)/time.Duration(batch), time.Since(w0)/time.Duration(batch)
		c0, w0 = cpuNow(), time.Now()
		for _, id := range ids {
			if err := h.release(ctxFor(t, time.Minute), id); err != nil {
				t.Fatalf("release %s at %d VMs: %v", id, size, err)
			}
		}
		row.release, row.relWal = (cpuNow()-c0)/time.Duration(batch), time.Since(w0)/time.Duration(batch)
		t.Logf("%d VMs: per launch %s CPU (%s wall), per release %s CPU (%s wall), idle %s CPU/s",
			size, row.launch, row.launchWall, row.release, row.relWal, row.idle)
		rows = append(rows, row)
	}
	// The fill's VMs are killed at cleanup (newHostCostHost).
	return hostCostMarkdown(rows, batch)
}

func hostCostMarkdown(rows []hostCostRow, batch int) string {
	var b strings.Builder
	b.WriteString("## Host agent CPU per launch and per release, by VMs on the host\n\n")
	fmt.Fprintf(&b, "The host side of one agent in the bench process (store, capacity ledger, supervisor; no Temporal), launching the stub VMM through the real jail: the host is filled to each size, then %d launches (CreateRecord with its reservation, LaunchVM) and their %d releases (BeginDelete, StopVM, WaitVMExit, ReleaseLeases, TearDown, DeleteRecord) run one at a time, and the process's CPU (getrusage: user + system; the VMs are other processes) is read around each batch. Idle is the same process's CPU per second with nothing asked of it at that size.\n\n", batch, batch)
	tab := Table{Header: []string{"VMs on the host", "CPU per launch", "CPU per release", "wall per launch", "wall per release", "idle CPU per second"}}
	for _, r := range rows {
		tab.Add(strconv.Itoa(r.vms), MS(r.launch)+" ms", MS(r.release)+" ms", MS(r.launchWall)+" ms", MS(r.relWal)+" ms", MS(r.idle)+" ms")
	}
	b.WriteString(tab.Markdown() + "\n")
	if len(rows) >= 2 {
		lo, hi := rows[0], rows[len(rows)-1]
		for _, m := range []struct {
			what   string
			lo, hi time.Duration
		}{{"launch", lo.launch, hi.launch}, {"release", lo.release, hi.release}} {
			ratio := float64(m.hi) / float64(m.lo)
			verdict := "met"
			if ratio > hostCostRatio {
				verdict = "missed"
			}
			fmt.Fprintf(&b, "**Agent CPU per %s, %d VMs ÷ %d: %s** — %.2f× (goal ≤ %.1f×): %s ms against %s ms.\n\n",
				m.what, hi.vms, lo.vms, verdict, ratio, hostCostRatio, MS(m.hi), MS(m.lo))
		}
	}
	return b.String()
}
