// Package agent is vmflow-hostagent run as a library. Run opens the host's
// store, vGPU driver, image roots and supervisor, supervises the host's VMs
// (re-attach, restart policies) before it ever waits for Temporal, then
// serves the host activities on the host's task queue, keeps the reconcile
// Schedule the one this build wants and triggers it from a local scan. It
// is the host side's one importer of Temporal: hostagent/... never is.
package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime/pprof"
	"time"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/worker"
	"go.uber.org/zap"

	"vmflow/activities"
	"vmflow/daemon"
	"vmflow/hostagent/admission"
	"vmflow/hostagent/gpu"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/metrics"
	"vmflow/hostagent/network"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/topology"
	"vmflow/hostagent/vmm"
	"vmflow/internal/crashpoint"
	"vmflow/internal/service"
	"vmflow/internal/tclient"
	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// Readiness conditions of the agent's /readyz.
const (
	readyReattach = "reattach"
	readyTemporal = "temporal"
	readyStopping = "stopping"
)

// Run runs the host agent: supervision first (never waiting for Temporal),
// then the worker and reconcile Schedule, connected in the background, until
// ctx ends; then running activities get cfg.StopTimeout and VMs keep running.
func Run(ctx context.Context, cfg Config) error {
	// VMFLOW_CPUPROFILE=FILE writes a CPU profile of the run, until
	// SIGTERM or SIGINT, for `go tool pprof` (make bench's profiling aid;
	// off unless set). A kill -9 loses it.
	if p := os.Getenv("VMFLOW_CPUPROFILE"); p != "" {
		f, err := os.Create(p)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			return daemon.UsageError(fmt.Errorf("VMFLOW_CPUPROFILE: %w", err))
		}
		defer func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		}()
	}
	log := cfg.Log()
	// VMFLOW_HEAPPROFILE=FILE: a heap profile at each SIGUSR1.
	defer startHeapProfile(log)()
	setGCPercent(os.Getenv)
	// The metrics server and the watchdog outlive ctx: they serve until
	// the graceful stop is over and Run returns.
	life, endLife := context.WithCancel(context.Background())
	defer endLife()
	h, err := openHost(ctx, life, cfg, log)
	if err != nil {
		return err
	}
	defer h.close()
	if err := h.supervise(ctx, life, log); err != nil {
		return nil // stopped before the records could be listed
	}
	return h.serve(ctx, cfg, log)
}

// agentHost is what the agent runs on this machine, from openHost until Run
// returns.
type agentHost struct {
	store   *store.Store
	tm      *tclient.Metrics // /metrics, /readyz
	metrics *metrics.Agent
	vgpus   *lease.Claims // nil without vGPUs
	whole   *lease.Whole  // nil without --gpu-passthrough
	sup     *supervise.Supervisor
	fdStore vmm.FDStore // nil without systemd's fd store
	acts    *activities.Activities
	net     *network.Net // nil without --net-subnet
	// scanEvery is --reconcile-scan-every: how often unleased TAPs are
	// looked for.
	scanEvery time.Duration
	// offers and static make the host's fleet view.
	offers  *lease.Offers
	static  func(*vmflowv1.HostView)
	closers []func()
}

// reconcileScan is the free local scan for reconcile work over the host's
// GPU claims, vGPUs and whole GPUs; nil without either.
func (h *agentHost) reconcileScan() func(context.Context) (lease.Work, error) {
	var scans []func(context.Context) (lease.Work, error)
	if h.vgpus != nil {
		scans = append(scans, h.vgpus.Scan)
	}
	if h.whole != nil {
		scans = append(scans, h.whole.Scan)
	}
	if len(scans) == 0 {
		return nil
	}
	return lease.ScanAll(scans...)
}

func (h *agentHost) close() {
	for i := len(h.closers) - 1; i >= 0; i-- {
		h.closers[i]()
	}
}

// indexLockWait bounds the wait for the state dir's agent lock at start: a
// previous agent killed a moment ago has let it go; one still running
// keeps it.
const indexLockWait = 10 * time.Second

// openHost opens the store, the metrics, the vGPU driver, the image roots
// and the supervisor: nothing runs yet, and nothing needs Temporal.
func openHost(ctx, life context.Context, cfg Config, log *zap.Logger) (h *agentHost, err error) {
	h = &agentHost{}
	// Every failure returns (nil, err): close what was opened, not h.
	opened := h
	defer func() {
		if err != nil {
			opened.close()
		}
	}()
	st, err := store.New(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	// The store's index of what the records hold, seeded by one read of
	// them and one /proc scan: no launch or release reads every record or
	// scans every process again. It holds the state dir's agent lock: a
	// second agent on this state dir stops here.
	// A seed that cannot read the records (the instances folder itself
	// unreadable) leaves the store reading the disk, as before the index:
	// supervision waits for the folder and says why.
	ictx, cancel := context.WithTimeout(ctx, indexLockWait)
	err = st.OpenIndex(ictx, supervise.UIDsInUse(cfg.DevRoot))
	cancel()
	switch {
	case errors.Is(err, store.ErrStateDirOwned):
		return nil, err
	case err != nil:
		log.Warn("store index not seeded: every launch reads the records and scans the processes", zap.Error(err))
	default:
		h.closers = append(h.closers, func() { _ = st.Close() })
	}
	tm, err := daemon.NewMetrics(log)
	if err != nil {
		return nil, err
	}
	tm.Readiness.NotReady(readyReattach, "re-attaching the host's VMs")
	tm.Readiness.NotReady(readyTemporal, "the Temporal worker is not polling yet")
	am, err := metrics.New(tm.Registry, st)
	if err != nil {
		return nil, err
	}
	// Scrapes serve a snapshot of the store; this keeps it current, and
	// says when the state file system goes below its reserve and back.
	low := false // refreshes run one at a time
	am.OnStateSpace(func(sp store.Space) {
		if sp.Low() == low {
			return
		}
		low = sp.Low()
		fields := []zap.Field{zap.Uint64("free_bytes", sp.Free), zap.Uint64("reserve_bytes", sp.Reserve), zap.Bool("reserve_held", sp.Held)}
		if low {
			log.Warn("state file system below its reserve: deletes go on, spawns are refused until there is room", fields...)
		} else {
			log.Info("state file system has room again", fields...)
		}
	})
	go am.RunStoreRefresh(life, metrics.DefaultStoreRefresh)
	// /healthz answers while re-attach runs; /readyz says what it waits for.
	cfg.ServeMetrics(life, tm)

	var gpus activities.GPUs
	var devs admission.Devices // nil interface, not a typed nil, without vGPUs
	var profiles func(context.Context) ([]string, error)
	var vgpus *lease.Claims // nil without vGPUs
	if cfg.VGPUDriver != "none" {
		c, err := newClaims(cfg, st, log)
		if err != nil {
			return nil, err
		}
		if c != nil {
			vgpus = c
			gpus, devs, profiles = c, c, c.Profiles
			if !cfg.VGPUAttach {
				log.Warn("--vgpu-attach=false: vGPUs are claimed and released but not given to QEMU; this is for the vmflow-vgpusim simulator only, never for production")
			}
		}
	}
	// The image roots are opened here and held for the agent's life: every
	// image is opened beneath them.
	host, err := admission.SystemHost(cfg.ImageRoots, cfg.KVMDevice, profiles)
	if err != nil {
		return nil, err
	}
	whole, err := newWhole(cfg, st, log)
	if err != nil {
		return nil, err
	}
	if whole != nil {
		host.Whole = whole
	}
	h.closers = append(h.closers, func() { _ = host.Images.Close() })
	var nw *network.Net
	if cfg.NetSubnet.IsValid() {
		if nw, err = openNetwork(ctx, cfg, st, log); err != nil {
			return nil, err
		}
		h.closers = append(h.closers, nw.Close)
		host.Network = true
	}
	// Which QEMU this agent launches, in its start log: the confinement
	// relies on QEMU 7.2's -sandbox options and its fd passing, and an
	// operator reading a launch failure wants the version beside it. A QEMU
	// that does not answer is only warned about: the agent still supervises
	// what runs, and each launch then fails naming the binary.
	if v, err := vmm.DetectVersion(ctx, cfg.QEMU); err != nil {
		log.Warn("qemu --version failed; launches will fail until it answers", zap.String("qemu", cfg.QEMU), zap.Error(err))
	} else {
		log.Info("qemu", zap.String("qemu", cfg.QEMU), zap.String("qemu_version", v.String()))
	}
	reserve := uint64(cfg.MemoryReserveMiB)
	if cfg.MemoryReserveMiB < 0 {
		reserve = lease.DefaultMemoryReserveMiB(uint64(host.MaxMemoryMiB))
	}
	// The host's NUMA nodes, where its devices are (the simulator's in
	// tests). Without them nothing is placed on a node: VMs run where the
	// kernel puts them, as before the ledger.
	topo, err := topology.Read(cfg.SysfsRoot)
	if err != nil {
		log.Warn("host topology unreadable: no VM is placed on a NUMA node", zap.String("sysfs_root", cfg.SysfsRoot), zap.Error(err))
		topo = topology.Topology{}
		if len(cfg.DedicatedCPUs) > 0 {
			return nil, fmt.Errorf("--dedicated-cpus: %w", err)
		}
	}
	host.DedicatedCPUs = uint32(len(cfg.DedicatedCPUs))
	capacity, err := lease.NewCapacity(lease.CapacityConfig{Store: st, CPUs: int(host.MaxVCPUs), MemoryMiB: uint64(host.MaxMemoryMiB),
		CPUOvercommit: cfg.CPUOvercommit, MemoryOvercommit: cfg.MemoryOvercommit, MemoryReserveMiB: reserve, TTL: cfg.ReservationTTL,
		Topology: topo, DedicatedCPUs: cfg.DedicatedCPUs, SysfsRoot: cfg.SysfsRoot, FreeGPUs: freeGPUsByNode(vgpus, whole), Logger: log,
		Draining: st.RefuseWhileDraining})
	if err != nil {
		return nil, err
	}
	go runCapacityGauges(life, am, capacity, metrics.DefaultStoreRefresh, log)
	for _, n := range topo.Nodes {
		log.Info("numa node", zap.Int("numa_node", n.ID), zap.String("cpus", topology.FormatCPUList(n.CPUs)), zap.Uint64("memory_bytes", n.MemoryBytes))
	}
	lim := capacity.Limits()
	log.Info("capacity", zap.Uint64("vcpus", lim.VCPUs), zap.Uint64("memory_mib", lim.MemoryMiB), zap.Uint64("pinned_memory_mib", lim.PhysicalMiB),
		zap.Uint64("memory_reserve_mib", reserve))
	if _, on, _ := st.Draining(); on {
		log.Warn("draining: this host grants no new VM until vmflow-hostagent undrain; its VMs stay supervised")
	}
	// What the host offers the fleet, and the grant's GPU check.
	offers := &lease.Offers{Store: st, Capacity: capacity, VGPU: vgpus, Whole: whole}
	acts := &activities.Activities{
		Store: st, Host: host, GPUs: gpus, Network: nw, AttachVGPU: cfg.VGPUAttach, Capacity: capacity, Offers: offers,
		DefaultGraceful: cfg.GracefulTimeout, Logger: log, Metrics: am,
	}
	if whole != nil {
		acts.Whole = whole
	}
	// One engine releases every kind, with the host's quarantine.
	acts.LeaseConfig = lease.EngineConfig{Store: st, Quarantine: quarantineOf(cfg), IgnoreUninspectable: cfg.IgnoreUninspectable, Logger: log}
	go runGPUInventory(life, am, st, cfg, whole, vgpus, metrics.DefaultStoreRefresh, log)
	// A cgroup per VM: a transient scope under systemd, cgroupfs otherwise.
	cgroups, err := vmm.CgroupsFor(ctx, "/sys/fs/cgroup", func(ctx context.Context) (vmm.ScopeConn, error) {
		return sddbus.NewSystemConnectionContext(ctx)
	})
	if err != nil {
		log.Warn("no cgroup per VM: QEMUs stay in the agent's cgroup", zap.Error(err))
		if !cfg.VMIO.IsZero() {
			log.Warn("--vm-io-* set without a cgroup per VM: launches of VMs with a disk are refused")
		}
		cgroups = nil
	}
	// Guest output across restarts: systemd's fd store when systemd runs
	// the agent; without one, what QEMU writes while the agent is down is
	// lost.
	var fdStore vmm.FDStore
	if st, err := vmm.NewSystemdFDStore(); err != nil {
		log.Warn("fd store: what systemd handed back cannot be read; guest output written while the agent was down is lost", zap.Error(err))
	} else if st != nil {
		fdStore = st
	}
	var jailSetup string
	if cfg.Jail {
		// The setup stage is this binary, re-executed.
		if jailSetup, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("--jail: %w", err)
		}
	} else {
		log.Warn("--jail=false: QEMUs run in the host's namespaces and root")
	}
	sup, err := supervise.New(supervise.Config{
		Store: st, QEMU: cfg.QEMU, Logger: log,
		GracefulTimeout: cfg.GracefulTimeout, GroupExitCap: cfg.GroupExitCap,
		// Before every launch and restart: the record admitted against this
		// host's policy (the launch's first stage), then the held devices
		// made sure of (re-created after a reboot), the images opened
		// beneath their roots (the disk's overlay made at the first), and
		// QEMU's spec from the record.
		Admit:             host.AdmitRecord,
		PlaceCapacity:     capacity.Place,
		LaunchConcurrency: cfg.LaunchConcurrency,
		PrepareLaunch:     admission.Assemble(host, devs, cfg.VGPUAttach),
		QEMUUIDs:          cfg.QEMUUIDs, KVMDevice: cfg.KVMDevice, DevRoot: cfg.DevRoot, Cgroups: cgroups, VMIO: cfg.VMIO, JailSetup: jailSetup, FDStore: fdStore,
		Network:                nw,
		OnExitRecorded:         func(d time.Duration) { am.ExitDetect.Observe(d.Seconds()) },
		OnRestartRefused:       am.RestartsRefused.Inc,
		OnRestartDeviceMissing: am.RestartsDeviceMissing.Inc,
		OnGuestLogDropped:      func(n uint64) { am.GuestLogDropped.Add(float64(n)) },
	})
	if err != nil {
		return nil, err
	}
	h.closers = append(h.closers, func() { _ = sup.Close() })
	acts.Supervisor = sup
	h.store, h.tm, h.metrics, h.vgpus, h.whole, h.sup, h.fdStore, h.acts, h.net = st, tm, am, vgpus, whole, sup, fdStore, acts, nw
	h.offers, h.static = offers, hostStatic(cfg, host)
	h.scanEvery = cfg.ReconcileScanEvery
	return h, nil
}

// freeGPUsByNode counts the GPUs free on each NUMA node: offered whole
// GPUs no claim bound, and vGPU parents with room for one more vGPU. The
// capacity ledger places a VM without GPUs where fewer are free.
func freeGPUsByNode(vgpus *lease.Claims, whole *lease.Whole) func(context.Context) (map[int]int, error) {
	return func(ctx context.Context) (map[int]int, error) {
		free := map[int]int{}
		if whole != nil {
			gpus, err := whole.Driver().GPUs(ctx)
			if err != nil {
				return nil, err
			}
			for _, g := range gpus {
				if g.Offered && !g.Marked {
					free[g.NUMANode]++
				}
			}
		}
		if vgpus != nil {
			profiles, err := vgpus.Driver().Profiles(ctx)
			if err != nil {
				return nil, err
			}
			seen := map[string]bool{}
			for _, p := range profiles {
				if p.Available > 0 && !seen[p.Parent] {
					seen[p.Parent] = true
					free[p.NUMANode]++
				}
			}
		}
		return free, nil
	}
}

// runCapacityGauges sets the capacity gauges from the ledger now and every
// `every` (as the store's gauges: a scrape never lists the records).
func runCapacityGauges(ctx context.Context, am *metrics.Agent, c *lease.Capacity, every time.Duration, log *zap.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		limit, held, err := c.Gauges()
		if err != nil {
			log.Warn("capacity gauges not refreshed", zap.Error(err))
		}
		for r, v := range limit {
			am.CapacityLimit.WithLabelValues(r).Set(v)
		}
		for r, v := range held {
			am.CapacityHeld.WithLabelValues(r).Set(v)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// hostStatic fills a fleet view with what the host is: its id, build,
// network, KVM, admission bounds and how it counts a VM's memory.
func hostStatic(cfg Config, host admission.Host) func(*vmflowv1.HostView) {
	base := vmm.MemoryLimitMiB(0, vmm.AccelKVM, 0)
	tcg := vmm.MemoryLimitMiB(0, vmm.AccelTCG, 0) - base
	return func(v *vmflowv1.HostView) {
		v.HostId, v.AgentVersion = cfg.HostID, agentVersion()
		v.Network, v.Kvm = host.Network, host.KVM.Err == nil
		v.MaxVcpus, v.MaxMemoryMib = host.MaxVCPUs, host.MaxMemoryMiB
		v.VmOverheadMib, v.TcgOverheadMib = uint32(base), uint32(tcg)
	}
}

// openNetwork opens the host's network and makes its host-path filter
// (with egress NAT when asked), its anti-spoofing filter and its bridge (and
// its gateway address, after a reboot) as configured. A bridge that cannot
// be made now is only reported: VMs without a network go on, and every
// launch with one tries again.
func openNetwork(ctx context.Context, cfg Config, st *store.Store, log *zap.Logger) (*network.Net, error) {
	nw, err := network.New(network.Config{Bridge: cfg.NetBridge, Subnet: cfg.NetSubnet, Egress: cfg.NetEgress, Deny: cfg.NetDeny,
		NetNS: cfg.NetNetNS, PortPPS: uint32(cfg.NetPortPPS), Store: st, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	// Fatal: without it guests reach the host's services (and with
	// route_localnet on, its 127.0.0.1 ones); nothing launches unguarded.
	if err := nw.EnsureHostPath(); err != nil {
		nw.Close()
		return nil, fmt.Errorf("network: %w", err)
	}
	// The anti-spoofing filter from the records (lost at a reboot): not
	// fatal either, as every launch with a network makes it again.
	if err := nw.RebuildGuard(ctx); err != nil {
		log.Error("network filter not set up; launches with a network try again", zap.String("bridge", cfg.NetBridge), zap.Error(err))
	}
	if err := nw.EnsureBridge(ctx); err != nil {
		log.Error("network bridge not ready; launches with a network try again", zap.String("bridge", cfg.NetBridge), zap.Error(err))
	} else {
		log.Info("network", zap.String("bridge", cfg.NetBridge), zap.String("subnet", cfg.NetSubnet.String()), zap.String("netns", cfg.NetNetNS))
	}
	return nw, nil
}

// supervise re-attaches the host's VMs with the network down, then tells
// systemd it is ready and starts the watchdog; broken instances are reported
// and left alone (invariant 12). Its error is ctx's, before records were listed.
func (h *agentHost) supervise(ctx, life context.Context, log *zap.Logger) error {
	rep, err := startSupervision(ctx, h.sup, log)
	if err != nil {
		return err
	}
	crashpoint.Hit(crashpoint.AgentReattached)
	h.metrics.Reattach.Add(float64(rep.Attached))
	h.metrics.RefreshStore() // re-attach rewrote records: the gauges show it now
	log.Info("supervising", zap.Int("records", rep.Records), zap.Int("attached", rep.Attached),
		zap.Int("gone", rep.Gone), zap.Int("failed", rep.Failed), zap.Duration("took", rep.Duration))
	reportUnservedLeases(h.store, activities.LeaseEngine(h.acts), h.metrics, log)
	if sd, ok := h.fdStore.(*vmm.SystemdFDStore); ok {
		pruneFDStore(h.store, sd, log)
	}
	if h.net != nil && h.scanEvery > 0 {
		go reconcileTAPs(ctx, h.net, h.metrics, h.scanEvery, log)
	}
	// Ready for systemd means supervising: re-attach is done, whatever
	// Temporal's state or the state of single records (invariant 12).
	h.tm.Readiness.Ready(readyReattach)
	service.NotifyReady(log)
	// systemd arms the watchdog once READY=1 is sent; each ping asks the
	// supervisor and the store first (invariant 12's other half: a wedged
	// agent is restarted rather than reported healthy).
	go func() {
		if err := service.Watchdog(life, log, h.sup.Alive); err != nil {
			log.Error("systemd watchdog", zap.Error(err))
		}
	}()
	return nil
}

// serve connects to Temporal (retrying as long as it takes) and serves the
// host activities, the reconcile Schedule and the local scan until ctx ends.
func (h *agentHost) serve(ctx context.Context, cfg Config, log *zap.Logger) error {
	tm := h.tm
	topts := cfg.Temporal(tm, "vmflow-hostagent@"+cfg.HostID)
	// The transport check alone, before dialing: no logger, so an allowed
	// --insecure is warned about once, by the dial, not here as well.
	check := topts
	check.Logger = nil
	if _, err := platform.ClientOptions(check); errors.Is(err, tclient.ErrInsecureTransport) {
		// Permanent until an operator changes the configuration: said once,
		// and on /readyz, while the host's VMs stay supervised (invariant 12).
		log.Error("not connecting to Temporal: insecure transport refused; VMs stay supervised, host activities are not served until the configuration is fixed (or --insecure given)",
			zap.Error(err))
		tm.Readiness.NotReady(readyTemporal, err.Error())
		<-ctx.Done()
		service.NotifyStopping(log)
		return nil
	}
	c, err := dialForever(ctx, topts, log)
	if err != nil {
		service.NotifyStopping(log)
		log.Info("stopping before Temporal answered; VMs keep running")
		return nil // supervision ran meanwhile
	}
	defer c.Close()
	queue := workflows.HostTaskQueue(cfg.HostID)
	// WorkerStopTimeout: on SIGTERM the SDK stops polling and lets running
	// activities (a stop ladder, a release) finish for this long before it
	// cancels them; 0, the SDK's default, cancels them at once and every
	// agent upgrade would cut them off. One still running then is
	// cancelled; its retry resumes the ladder from the step the record
	// holds.
	w := worker.New(c, queue, worker.Options{WorkerStopTimeout: cfg.StopTimeout})
	workflows.RegisterHostActivities(w, h.acts)
	pub := newViewPublisher(h.offers, h.static, publishTo(c, cfg.TaskQueue), cfg.FleetPublishDebounce, cfg.FleetCheckEvery, log)
	h.acts.Changed = pub.Changed // before any activity runs
	if err := w.Start(); err != nil {
		return fmt.Errorf("start worker on %s: %w", queue, err)
	}
	tm.Readiness.Ready(readyTemporal)
	log.Info("serving host activities", zap.String("task_queue", queue))
	// Published once the host serves: a placement may send it grants.
	go pub.run(ctx)
	if err := ensureReconcileSchedule(ctx, c, cfg, log); err != nil {
		// The host works without it; reconcile is a safety net.
		log.Error("reconcile schedule", zap.Error(err))
	}
	if scan := h.reconcileScan(); scan != nil && cfg.ReconcileScanEvery > 0 {
		sched := workflows.ReconcileScheduleID(cfg.HostID)
		go scanForReconcile(ctx, scan, cfg.ReconcileScanEvery, cfg.ReconcileEvery,
			func(ctx context.Context) error { return triggerReconcile(ctx, c, sched) }, h.metrics, log)
	}
	<-ctx.Done()
	tm.Readiness.NotReady(readyStopping, "stopping: running activities finish, no new ones are taken")
	service.NotifyStopping(log)
	log.Info("stopping: no new activities, running ones may finish; VMs keep running",
		zap.Duration("stop_timeout", cfg.StopTimeout))
	began := time.Now()
	w.Stop()
	log.Info("worker stopped", zap.Duration("took", time.Since(began)))
	return nil
}

// dialBackoffMax caps the wait between dial rounds after a refusal.
const dialBackoffMax = 5 * time.Minute

// dialForever connects to Temporal, retrying with backoff whatever the error
// (a refused API key too) until ctx ends: a Temporal problem must never stop
// supervision (invariant 12), and fixed credentials are picked up next round.
func dialForever(ctx context.Context, o platform.Options, log *zap.Logger) (client.Client, error) {
	wait := 5 * time.Second
	for round := 1; ; round++ {
		c, err := platform.Dial(ctx, o)
		if err == nil {
			return c, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		log.Error("temporal refused the agent; VMs stay supervised, retrying", zap.Error(err),
			zap.Int("round", round), zap.Duration("retry_in", wait))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
		wait = min(wait*2, dialBackoffMax)
	}
}

// startSupervision retries the supervisor's Start until it can list the
// instance records: serving activities before that would leave every VM
// unwatched. Per-instance failures never fail Start.
func startSupervision(ctx context.Context, sup *supervise.Supervisor, log *zap.Logger) (supervise.ReattachReport, error) {
	wait := time.Second
	for {
		rep, err := sup.Start(ctx)
		if err == nil {
			return rep, nil
		}
		log.Error("cannot read the instance records; nothing is supervised yet, retrying", zap.Error(err),
			zap.Duration("retry_in", wait))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return rep, ctx.Err()
		case <-t.C:
		}
		wait = min(wait*2, 30*time.Second)
	}
}

// reportUnservedLeases names, at start, the instances holding leases of a
// kind this agent cannot release (no driver for it: a vGPU without
// --vgpu-driver, an address without --net-subnet), so the host shows on a
// dashboard before a delete parks on them.
func reportUnservedLeases(st *store.Store, eng *lease.Engine, am *metrics.Agent, log *zap.Logger) {
	recs, err := st.List()
	if _, listed := store.Unreadable(err); !listed {
		log.Error("cannot list the records to find leases this agent cannot serve", zap.Error(err))
		return
	}
	// Leases inside unreadable records cannot be counted; re-attach names
	// those records and vmflow_records_unreadable counts them.
	var ids []string
	n := 0
	for _, r := range recs {
		unserved := 0
		for _, l := range store.HeldLeases(r) {
			if !eng.Serves(store.LeaseKind(l)) {
				unserved++
			}
		}
		if unserved > 0 {
			ids = append(ids, r.GetId())
			n += unserved
		}
	}
	am.LeasesUnserved.Set(float64(n))
	if len(ids) > 0 {
		log.Warn("instances hold leases of a kind this agent has no driver for: their deletes will wait, needing attention, until the agent runs with the host's driver or network",
			zap.Strings("instance_ids", ids), zap.Int("leases", n))
	}
}

// newClaims sets up the vGPU driver and claims, or returns nil when
// --vgpu-driver=auto finds no vGPU sysfs on the host.
func newClaims(cfg Config, st *store.Store, log *zap.Logger) (*lease.Claims, error) {
	kind := gpu.Kind("")
	switch cfg.VGPUDriver {
	case "mdev":
		kind = gpu.KindMdev
	case "vendor":
		kind = gpu.KindVendor
	}
	return lease.New(lease.Config{
		Driver:      gpu.Config{SysfsRoot: cfg.SysfsRoot, StateDir: cfg.StateDir, Kind: kind},
		Store:       st,
		DevRoot:     cfg.DevRoot,
		OrphanGrace: cfg.OrphanGrace,
		Logger:      log,
		Optional:    cfg.VGPUDriver == "auto",

		IgnoreUninspectable: cfg.IgnoreUninspectable,
		Quarantine:          quarantineOf(cfg),
	})
}

// pruneFDStore drops the kept log pipes of VMs whose records are gone; an
// unreadable record keeps all its id's pipes (its uid is unknown).
func pruneFDStore(st *store.Store, sd *vmm.SystemdFDStore, log *zap.Logger) {
	recs, err := st.List()
	bad, listed := store.Unreadable(err)
	if !listed {
		log.Error("fd store: cannot list the records; every stored log pipe is kept", zap.Error(err))
		return
	}
	keep := map[string]bool{}
	for _, r := range recs {
		keep[vmm.LogFDName(r.GetId(), r.GetQemuUid())] = true
	}
	unreadable := map[string]bool{}
	for _, b := range bad {
		unreadable[b.ID] = true
	}
	dropped, err := sd.Prune(func(name string) bool {
		id, ours := vmm.LogFDInstance(name)
		return keep[name] || !ours || unreadable[id]
	})
	if len(dropped) > 0 {
		log.Info("fd store: dropped the log pipes of instances that have no record", zap.Strings("fd_names", dropped))
	}
	if err != nil {
		log.Warn("fd store: some log pipes could not be dropped; kept until the next start", zap.Error(err))
	}
}
