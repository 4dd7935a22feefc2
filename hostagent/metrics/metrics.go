// Package metrics defines the host agent's Prometheus metrics: what an
// operator graphs and alerts on (instances by state, how long stops take,
// how fast exits are seen, vGPU claims and release failures, re-attaches).
//
// Gauges that describe the host (instances, claims, unreadable records) come
// from a snapshot of the store taken at start and refreshed in the background
// (RunStoreRefresh), never at scrape time: a scrape reads no record, so its
// cost does not grow with the records and anyone who can reach /metrics
// cannot make the agent read the whole state directory at will.
package metrics

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"vmflow/hostagent/store"
	"vmflow/internal/service"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Agent holds the agent's own metrics. Every histogram resolves 1 ms to
// 10 min (service.LatencyBuckets), the same bounds as the SDK's latencies.
type Agent struct {
	// StopDuration is the stop ladder, start to thread group gone, by the
	// last step it took (StopSteps).
	StopDuration    *prometheus.HistogramVec
	ExitDetect      prometheus.Histogram
	LaunchDuration  prometheus.Histogram
	ReleaseFailures *prometheus.CounterVec
	// ReleaseDuration is each lease's release by its driver in the
	// delete's release stage, by kind (ObserveRelease).
	ReleaseDuration *prometheus.HistogramVec
	Reattach        prometheus.Counter
	// OrphansFound counts what the agent's local scans found that no
	// record's held lease names, by kind: a vGPU or a vfio-pci group
	// past its grace, each once when first seen (the reconcile round
	// they trigger releases it), and a TAP, when the scan round removes it.
	OrphansFound *prometheus.CounterVec
	// LeasesUnserved counts held leases of a kind this agent has no driver
	// for (a vGPU with --vgpu-driver=none, an address without
	// --net-subnet): their deletes park needing attention until the agent
	// runs with one.
	LeasesUnserved prometheus.Gauge
	// RestartsRefused counts restarts the host's admission policy refused
	// (the recorded spec is outside the policy the agent runs with): each
	// leaves its instance needing attention.
	RestartsRefused prometheus.Counter
	// RestartsDeviceMissing counts restarts that could not get their vGPU
	// back (missing and not re-created): each leaves its instance needing
	// attention.
	RestartsDeviceMissing prometheus.Counter
	// CapacityLimit and CapacityHeld are what the host may promise and
	// what its records hold (the capacity ledger), by resource: vcpus
	// (shared), dedicated_cpus, memory_bytes, hugepage_bytes.
	CapacityLimit, CapacityHeld *prometheus.GaugeVec
	// GuestLogDropped counts guest output bytes that never reached
	// qemu.log (its disk full, failing or behind): output is dropped rather
	// than QEMU blocked.
	GuestLogDropped prometheus.Counter
	// NetworkPortsReattached counts leased TAPs the TAP reconcile put back
	// on the bridge (a deleted bridge detaches its ports) or whose port
	// settings or static FDB entry it made again.
	NetworkPortsReattached prometheus.Counter
	// GPUDevices counts the host's GPU devices by state (free, claimed,
	// quarantined, not-vmflows), as `vmflow-hostagent devices` lists them;
	// the agent sets it (SetGPUDevices).
	GPUDevices *prometheus.GaugeVec
	// filterDropped backs vmflow_network_filter_dropped_frames_total: the
	// kernel's count, read each TAP reconcile round (SetNetworkFilterDropped).
	filterDropped atomic.Uint64
	// rateDropped backs vmflow_network_port_rate_dropped_frames_total
	// likewise (SetNetworkRateDropped).
	rateDropped atomic.Uint64

	store *storeCollector // nil without a store
}

// SetNetworkFilterDropped sets vmflow_network_filter_dropped_frames_total to
// the anti-spoofing filter's drop count, as the kernel last reported it.
func (a *Agent) SetNetworkFilterDropped(frames uint64) { a.filterDropped.Store(frames) }

// SetNetworkRateDropped sets vmflow_network_port_rate_dropped_frames_total
// to the guest ports' rate limit's drop count, as the kernel last reported
// it.
func (a *Agent) SetNetworkRateDropped(frames uint64) { a.rateDropped.Store(frames) }

// SetGPUDevices sets vmflow_gpu_devices to counts (state -> devices); a
// state counts gives no number keeps its last value.
func (a *Agent) SetGPUDevices(counts map[string]int) {
	for state, n := range counts {
		a.GPUDevices.WithLabelValues(state).Set(float64(n))
	}
}

// StopSteps are the values of vmflow_stop_duration_seconds's step label:
// the last step of the ladder a stop took (activities' stepNeeded), none
// when it sent nothing (the group went meanwhile).
var StopSteps = []string{"powerdown", "quit", "kill", "none"}

// ObserveRelease records one lease's release by its driver
// (lease.EngineConfig.ReleaseTook).
func (a *Agent) ObserveRelease(kind string, took time.Duration) {
	a.ReleaseDuration.WithLabelValues(kind).Observe(took.Seconds())
}

// DefaultStoreRefresh is how often RunStoreRefresh re-reads the store: the
// most the store gauges lag the records.
const DefaultStoreRefresh = 15 * time.Second

// New registers the agent's metrics with reg; st, if set, backs the instance,
// claim and unreadable-record gauges, which RunStoreRefresh keeps current.
func New(reg prometheus.Registerer, st *store.Store) (*Agent, error) {
	a := &Agent{
		StopDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vmflow_stop_duration_seconds",
			Help:    "Time from the start of the stop ladder until the VM's whole thread group was gone, by the last step the ladder took (powerdown: the guest obeyed the power button; quit; kill).",
			Buckets: service.LatencyBuckets(),
		}, []string{"step"}),
		ExitDetect: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vmflow_exit_detect_seconds",
			Help: "Time from a VM's exit (QEMU reaped, or the pidfd readable) until the agent recorded it.",
			// Below 1 ms too: a pidfd wake-up is seen in tens of µs.
			Buckets: append([]float64{.0001, .0005}, service.LatencyBuckets()...),
		}),
		LaunchDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "vmflow_launch_duration_seconds",
			Help:    "Time from fork until QMP reported the VM running.",
			Buckets: service.LatencyBuckets(),
		}),
		ReleaseFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vmflow_lease_release_failures_total",
			Help: "Release stages (every lease of one instance) that failed, by errno (or reason when no errno applies).",
		}, []string{"errno"}),
		ReleaseDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vmflow_lease_release_duration_seconds",
			Help:    "Time one lease's release by its driver took in a delete's release stage (its resource given back, or the failure), by kind (vgpu, passthrough, network).",
			Buckets: service.LatencyBuckets(),
		}, []string{"kind"}),
		OrphansFound: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vmflow_reconcile_orphans_found_total",
			Help: "Resources the agent's local scans found that no record's held lease names, past their grace, by kind: vgpu and passthrough (a vfio-pci group) once each when the reconcile scan first sees them, network when the TAP reconcile removes a TAP.",
		}, []string{"kind"}),
		Reattach: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vmflow_reattach_total",
			Help: "VMs re-attached after an agent restart.",
		}),
		LeasesUnserved: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "vmflow_leases_unserved",
			Help: "Held leases this agent cannot release because it runs without a driver for their kind (a vGPU without --vgpu-driver, an address without --net-subnet).",
		}),
		RestartsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vmflow_restarts_refused_total",
			Help: "Restarts refused because the host's admission policy no longer admits the instance's recorded spec.",
		}),
		RestartsDeviceMissing: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vmflow_restarts_device_missing_total",
			Help: "Restarts that failed because the instance's vGPU is missing and could not be re-created.",
		}),
		CapacityLimit: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vmflow_capacity_limit",
			Help: "What the host may promise its VMs, by resource: vcpus (shared CPUs × --cpu-overcommit), dedicated_cpus (--dedicated-cpus), memory_bytes (less --memory-reserve and the hugepage pools, × --memory-overcommit), hugepage_bytes (the pools).",
		}, []string{"resource"}),
		CapacityHeld: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vmflow_capacity_held",
			Help: "What the host's records hold of vmflow_capacity_limit (their capacity leases, reservations not yet expired included), by resource.",
		}, []string{"resource"}),
		GPUDevices: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vmflow_gpu_devices",
			Help: "GPU devices on this host by state: free, claimed, quarantined (a release or reset failed --gpu-quarantine-after times), not-vmflows.",
		}, []string{"state"}),
		NetworkPortsReattached: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vmflow_network_ports_reattached_total",
			Help: "Leased guest TAPs the TAP reconcile found off the bridge (the bridge deleted or the port moved), or on it with their port settings or static FDB entry changed, and set up again.",
		}),
		GuestLogDropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vmflow_guest_log_dropped_bytes_total",
			Help: "Guest output bytes dropped instead of written to qemu.log (disk full, failing or behind), counted when a VM's log pump ends.",
		}),
	}
	// The errnos a sysfs release is known to fail with (mdev remove
	// EAGAIN/ENODEV, old kernels EBUSY; EIO from a wedged driver) exist at 0
	// from the start: the series is there before the first failure, so
	// increase()/rate() alerts fire on the first one instead of never
	// seeing a counter start.
	for _, errno := range []string{"EAGAIN", "EBUSY", "EIO", "ENODEV"} {
		a.ReleaseFailures.WithLabelValues(errno)
	}
	// Likewise every step and kind: a histogram's series exist before
	// its first observation, as the unlabelled ones' do.
	for _, step := range StopSteps {
		a.StopDuration.WithLabelValues(step)
	}
	for _, kind := range store.LeaseKinds {
		a.ReleaseDuration.WithLabelValues(kind)
		if kind != store.KindCapacity { // a share of the host is no thing to find astray
			a.OrphansFound.WithLabelValues(kind)
		}
	}
	// A counter kept by the kernel: a replaced table or a reboot resets it,
	// which rate() and increase() take as a counter reset.
	filterDropped := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "vmflow_network_filter_dropped_frames_total",
		Help: "Frames from guest TAPs the anti-spoofing filter dropped (a spoofed source, IPv6, another ethertype), as of the last TAP reconcile round.",
	}, func() float64 { return float64(a.filterDropped.Load()) })
	rateDropped := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "vmflow_network_port_rate_dropped_frames_total",
		Help: "Frames from guest TAPs dropped for being over a port's frames-a-second limit (--net-port-pps), as of the last TAP reconcile round.",
	}, func() float64 { return float64(a.rateDropped.Load()) })
	cs := []prometheus.Collector{filterDropped, rateDropped, a.StopDuration, a.ExitDetect, a.LaunchDuration, a.ReleaseFailures, a.ReleaseDuration, a.OrphansFound, a.Reattach, a.LeasesUnserved, a.RestartsRefused, a.RestartsDeviceMissing, a.GuestLogDropped, a.GPUDevices, a.NetworkPortsReattached, a.CapacityLimit, a.CapacityHeld}
	if st != nil {
		a.store = &storeCollector{st: st}
		a.store.refresh()
		cs = append(cs, a.store)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return a, nil
}

var (
	instancesDesc = prometheus.NewDesc("vmflow_instances", "Instance records on this host, by state.", []string{"state"}, nil)
	leasesDesc    = prometheus.NewDesc("vmflow_leases", "Leases held by instance records on this host, by kind (vgpu, passthrough, network, capacity) and phase (intent, active, releasing).", []string{"kind", "phase"}, nil)
	unreadable    = prometheus.NewDesc("vmflow_records_unreadable", "Instance records that could not be read.", nil, nil)
	freeDesc      = prometheus.NewDesc("vmflow_state_fs_free_bytes",
		"Bytes the agent can still write on the state file system, its reserve not included.", nil, nil)
	reserveDesc = prometheus.NewDesc("vmflow_state_fs_reserve_held",
		"1 while the state file system's reserve is in place; 0 once a delete on a full disk gave it up.", nil, nil)
	reserveSizeDesc = prometheus.NewDesc("vmflow_state_fs_reserve_bytes",
		"The state file system's reserve: free bytes below it refuse spawns (deletes go on).", nil, nil)
)

// OnStateSpace makes every store refresh call fn with the state file
// system's room. Call it before RunStoreRefresh starts.
func (a *Agent) OnStateSpace(fn func(store.Space)) {
	if a.store != nil {
		a.store.onSpace = fn
	}
}

// RefreshStore re-reads the store into the gauges' snapshot now (every
// record: O(records) reads). A no-op without a store.
func (a *Agent) RefreshStore() {
	if a.store != nil {
		a.store.refresh()
	}
}

// RunStoreRefresh calls RefreshStore every `every` until ctx ends; a hung
// refresh delays the next, never a scrape (scrapes serve the last snapshot).
func (a *Agent) RunStoreRefresh(ctx context.Context, every time.Duration) {
	if every <= 0 {
		every = DefaultStoreRefresh
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			a.RefreshStore()
		}
	}
}

// leaseKey is one series of vmflow_leases.
type leaseKey struct{ kind, phase string }

// storeSnapshot is what the store gauges report.
type storeSnapshot struct {
	byState    map[string]float64
	leases     map[leaseKey]float64
	unreadable float64
	space      store.Space
}

// storeCollector serves the last snapshot of the store; refresh takes a new
// one. A scrape (Collect) never touches the store.
type storeCollector struct {
	st *store.Store
	// onSpace, when set, is called by each refresh with the state file
	// system's room (the agent warns below the reserve).
	onSpace func(store.Space)

	refreshMu sync.Mutex // one refresh at a time
	mu        sync.Mutex
	snap      storeSnapshot
}

func (c *storeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- instancesDesc
	ch <- leasesDesc
	ch <- unreadable
	ch <- freeDesc
	ch <- reserveDesc
	ch <- reserveSizeDesc
}

func (c *storeCollector) refresh() {
	c.refreshMu.Lock()
	defer c.refreshMu.Unlock()
	recs, err := c.st.List()
	snap := storeSnapshot{byState: map[string]float64{}, leases: map[leaseKey]float64{}}
	// Every series from the start, at 0: an alert on a kind's held leases
	// sees the series before the first one.
	for _, kind := range store.LeaseKinds {
		for p := range vmflowv1.ClaimPhase_name {
			if ph := vmflowv1.ClaimPhase(p); ph != vmflowv1.ClaimPhase_CLAIM_PHASE_UNSPECIFIED {
				snap.leases[leaseKey{kind, store.PhaseName(ph)}] = 0
			}
		}
	}
	for _, s := range vmflowv1.InstanceState_value {
		if st := vmflowv1.InstanceState(s); st != vmflowv1.InstanceState_INSTANCE_STATE_UNSPECIFIED {
			snap.byState[store.StateName(st)] = 0
		}
	}
	for _, r := range recs {
		snap.byState[store.StateName(r.GetState())]++
		for _, l := range store.HeldLeases(r) {
			snap.leases[leaseKey{store.LeaseKind(l), store.PhaseName(l.GetPhase())}]++
		}
	}
	bad, _ := store.Unreadable(err)
	snap.unreadable = float64(len(bad))
	snap.space = c.st.Space()
	if c.onSpace != nil {
		c.onSpace(snap.space)
	}
	c.mu.Lock()
	c.snap = snap
	c.mu.Unlock()
}

func (c *storeCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	snap := c.snap
	c.mu.Unlock()
	for state, n := range snap.byState {
		ch <- prometheus.MustNewConstMetric(instancesDesc, prometheus.GaugeValue, n, state)
	}
	for k, n := range snap.leases {
		ch <- prometheus.MustNewConstMetric(leasesDesc, prometheus.GaugeValue, n, k.kind, k.phase)
	}
	ch <- prometheus.MustNewConstMetric(unreadable, prometheus.GaugeValue, snap.unreadable)
	ch <- prometheus.MustNewConstMetric(reserveSizeDesc, prometheus.GaugeValue, float64(snap.space.Reserve))
	// A figure the store could not read is left out rather than served as
	// 0, which would read as a full disk; a file system that reports no
	// sizes has no free bytes to serve.
	if !snap.space.Measured {
		return
	}
	if !snap.space.Unsized {
		ch <- prometheus.MustNewConstMetric(freeDesc, prometheus.GaugeValue, float64(snap.space.Free))
	}
	held := 0.0
	if snap.space.Held {
		held = 1
	}
	ch <- prometheus.MustNewConstMetric(reserveDesc, prometheus.GaugeValue, held)
}
