package lease

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/store"
	"vmflow/hostagent/topology"
	"vmflow/hostagent/vmm"
	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The capacity ledger: what the host has promised its VMs of its CPUs and
// memory, kept as a capacity lease in each record (as hypeman admits
// against its host with per-resource oversubscription ratios). The ledger
// is never a file of its own: it is the sum of the records' held capacity
// leases, read under the store's admission lock, so it cannot disagree
// with the records after a crash, and two creates (or a create and a
// launch) never take the same GiB.
//
// A lease is written ahead as an INTENT with the record (Reserve), and a
// launch makes it ACTIVE (Place). An INTENT that no launch made ACTIVE
// within the TTL stops counting: a spawn that died between its record and
// its launch frees its room without anyone cleaning up; its launch, if it
// ever comes, reserves again or is refused.

// ErrNoHostCapacity: the host's ledger has no room for the VM now. A
// refusal, retryable: room frees as VMs are deleted.
var ErrNoHostCapacity = errdefs.NoHostCapacity.New("no host capacity")

// ErrLedgerUnreadable: a record the ledger must count cannot be read, so
// what it holds is not known: nothing is promised until it is repaired
// (it pages an operator: VmflowRecordsUnreadable), as no GPU or address
// is placed then either. Retryable. The VMs that run go on.
var ErrLedgerUnreadable = errdefs.Unavailable.New("capacity ledger: records unreadable")

// Capacity defaults.
const (
	DefaultCPUOvercommit    = 4.0
	DefaultMemoryOvercommit = 1.0
	// DefaultReservationTTL is how long a reservation counts before its
	// launch: a spawn's claim of whole GPUs (binds, resets) fits well
	// inside it, and a spawn that died frees its room within it.
	DefaultReservationTTL = 10 * time.Minute
	// MaxOvercommit bounds both ratios: a ratio beyond it is a typo
	// (benchmarks of -machine none VMs, which run no guest, use 256).
	MaxOvercommit = 256.0
)

// DefaultMemoryReserveMiB is the memory a host of totalMiB keeps for
// itself (the kernel, the agent, page cache) by default: 1 GiB + 2%.
func DefaultMemoryReserveMiB(totalMiB uint64) uint64 { return 1024 + totalMiB/50 }

// CapacityConfig is the host's size and how far it may promise beyond it.
type CapacityConfig struct {
	Store *store.Store
	// CPUs and MemoryMiB are the host's (runtime.NumCPU, MemTotal).
	CPUs      int
	MemoryMiB uint64
	// CPUOvercommit: vCPUs promised per host CPU (--cpu-overcommit).
	CPUOvercommit float64
	// MemoryReserveMiB is kept for the host (--memory-reserve); the rest,
	// times MemoryOvercommit (--memory-overcommit), is the VMs'. A VM with
	// a GPU is admitted only within the memory itself (QEMU pins a VFIO
	// VM's RAM), whatever the ratio.
	MemoryReserveMiB uint64
	MemoryOvercommit float64
	// TTL: see DefaultReservationTTL.
	TTL time.Duration
	// Topology is the host's NUMA nodes (topology.Read); the zero value
	// places nothing: no VM gets a node, a cpuset or hugepages.
	Topology topology.Topology
	// DedicatedCPUs are the CPUs only VMs with dedicated_cpus run on, one
	// per vCPU (--dedicated-cpus, as Nova's cpu_dedicated_set): no other
	// VM's cpuset holds them, so a dedicated VM never shares a CPU. Empty:
	// the host offers none.
	DedicatedCPUs []int
	// SysfsRoot is where a GPU lease's device is located (gpu.Locate):
	// its NUMA node is where the VM's CPUs and memory go.
	SysfsRoot string
	// FreeGPUs, when set, counts the GPUs free on each node: a VM without
	// GPUs goes first where fewer are free, leaving room beside them for
	// GPU VMs.
	FreeGPUs func(ctx context.Context) (map[int]int, error)
	Now      func() time.Time
	Logger   *zap.Logger
	// Draining, if set, refuses every reservation while it returns an
	// error (store.Store.RefuseWhileDraining: the drain marker), before
	// the ledger is read. Launches of what was granted go on.
	Draining func() error
}

// Capacity keeps the ledger.
type Capacity struct {
	cfg CapacityConfig
	// tally is the ledger kept from the store index's changes.
	tally tally
}

// shareMemo is what one record holds of the host, read once.
type shareMemo struct {
	share *vmflowv1.CapacityLease // nil: nothing
	// expires is an INTENT's expiry (zero: it does not expire).
	expires time.Time
	// vcpus (shared), memMiB, dedicated and hugeMiB (of hugeKiB pages)
	// are the share's, inline; placed: it names nodes or dedicated CPUs.
	vcpus, memMiB, dedicated, hugeMiB uint64
	hugeKiB                           uint32
	placed                            bool
}

// shareOf reads what rec holds of the host: its capacity lease while
// held (an INTENT only until it expires, which the sum checks against its
// now); a record written before the ledger holds its spec's share while a
// QEMU of it may run.
func shareOf(rec *vmflowv1.InstanceRecord) shareMemo {
	var m shareMemo
	l := store.Capacity(rec)
	switch {
	case l == nil:
		if rec.GetProcess() != nil || rec.GetLaunchStartedAt() != nil {
			m.share = Share(rec.GetSpec())
		}
	case store.LeaseHeld(l):
		m.share = l.GetCapacity()
		if at := l.GetCapacity().GetExpiresAt(); l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT && at != nil {
			m.expires = at.AsTime()
		}
	}
	if s := m.share; s != nil {
		if !s.GetDedicatedCpus() {
			m.vcpus = uint64(s.GetVcpus())
		}
		m.memMiB, m.dedicated = uint64(s.GetMemoryMib()), dedicatedOf(s)
		m.hugeMiB, m.hugeKiB = hugeMiB(s), s.GetHugepageKib()
		m.placed = s.GetDedicatedCpus() || len(s.GetNumaNodes()) > 0
	}
	return m
}

// NewCapacity checks cfg and returns its ledger.
func NewCapacity(cfg CapacityConfig) (*Capacity, error) {
	if cfg.Store == nil {
		return nil, fmt.Errorf("capacity: no store")
	}
	if cfg.CPUOvercommit == 0 {
		cfg.CPUOvercommit = DefaultCPUOvercommit
	}
	if cfg.MemoryOvercommit == 0 {
		cfg.MemoryOvercommit = DefaultMemoryOvercommit
	}
	for _, r := range []struct {
		name string
		v    float64
	}{{"cpu overcommit", cfg.CPUOvercommit}, {"memory overcommit", cfg.MemoryOvercommit}} {
		if math.IsNaN(r.v) || r.v <= 0 || r.v > MaxOvercommit {
			return nil, fmt.Errorf("capacity: %s %v: must be above 0 and at most %v", r.name, r.v, MaxOvercommit)
		}
	}
	if cfg.CPUs <= 0 || cfg.MemoryMiB == 0 {
		return nil, fmt.Errorf("capacity: the host's size is unknown (%d CPUs, %d MiB)", cfg.CPUs, cfg.MemoryMiB)
	}
	if cfg.MemoryReserveMiB >= cfg.MemoryMiB {
		return nil, fmt.Errorf("capacity: a memory reserve of %d MiB leaves nothing of the host's %d MiB", cfg.MemoryReserveMiB, cfg.MemoryMiB)
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultReservationTTL
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	for _, cpu := range cfg.DedicatedCPUs {
		if _, ok := cfg.Topology.NodeOfCPU(cpu); !ok {
			return nil, fmt.Errorf("capacity: dedicated CPU %d is on no NUMA node of the host's", cpu)
		}
	}
	if len(cfg.DedicatedCPUs) >= cfg.CPUs {
		return nil, fmt.Errorf("capacity: %d dedicated CPUs leave the host's %d none for other VMs", len(cfg.DedicatedCPUs), cfg.CPUs)
	}
	return &Capacity{cfg: cfg}, nil
}

// Limits are what the host may promise in all.
type Limits struct {
	VCPUs uint64
	// MemoryMiB is the VMs' memory with the overcommit; PhysicalMiB
	// without it (what a GPU VM must fit in).
	MemoryMiB, PhysicalMiB uint64
	// DedicatedCPUs is the --dedicated-cpus pool; HugepageMiB the
	// hugepage pools of every size.
	DedicatedCPUs, HugepageMiB uint64
}

// Limits are the host's: its shared CPUs (the dedicated ones are counted
// apart, one vCPU each) and its memory less the reserve and the hugepage
// pools (which back hugepage VMs' RAM, counted apart).
func (c *Capacity) Limits() Limits {
	phys := sub(c.cfg.MemoryMiB, c.cfg.MemoryReserveMiB+hugepagePoolsMiB(c.cfg.Topology.Nodes))
	return Limits{
		VCPUs:         uint64(float64(c.cfg.CPUs-len(c.cfg.DedicatedCPUs)) * c.cfg.CPUOvercommit),
		MemoryMiB:     uint64(float64(phys) * c.cfg.MemoryOvercommit),
		PhysicalMiB:   phys,
		DedicatedCPUs: uint64(len(c.cfg.DedicatedCPUs)),
		HugepageMiB:   hugepagePoolsMiB(c.cfg.Topology.Nodes),
	}
}

// Gauges are the ledger by resource, what the host may promise (limit)
// and what its records hold: vcpus, dedicated_cpus, memory_bytes,
// hugepage_bytes (vmflow_capacity_limit, vmflow_capacity_held).
func (c *Capacity) Gauges() (limit, held map[string]float64, err error) {
	u, err := c.Usage("")
	if err != nil {
		return nil, nil, err
	}
	lim := c.Limits()
	return map[string]float64{
			"vcpus": float64(lim.VCPUs), "dedicated_cpus": float64(lim.DedicatedCPUs),
			"memory_bytes": float64(lim.MemoryMiB << 20), "hugepage_bytes": float64(lim.HugepageMiB << 20),
		}, map[string]float64{
			"vcpus": float64(u.VCPUs), "dedicated_cpus": float64(u.DedicatedCPUs),
			"memory_bytes": float64(u.MemoryMiB << 20), "hugepage_bytes": float64(sumValues(u.HugepageMiB) << 20),
		}, nil
}

func sumValues(m map[uint32]uint64) uint64 {
	var n uint64
	for _, v := range m {
		n += v
	}
	return n
}

// Usage is what the records hold of the host.
type Usage struct {
	// VCPUs are shared vCPUs; DedicatedCPUs the dedicated ones (a CPU
	// each); HugepageMiB the MiB of guest RAM in hugepages, by page size
	// in KiB.
	VCPUs, MemoryMiB, DedicatedCPUs uint64
	HugepageMiB                     map[uint32]uint64
	// Unreadable counts records that could not be read: what they hold
	// is not known, so while there are any nothing more is promised
	// (countable).
	Unreadable int
}

// Share is what a VM of spec holds of its host: its vCPUs and everything
// its cgroup allows it (vmm.MemoryLimitMiB, QEMU's own memory included);
// with hugepages, its guest RAM in pages of the pool and only QEMU's own
// memory beside.
func Share(spec *vmflowv1.VMSpec) *vmflowv1.CapacityLease {
	kib := vmm.HugepageKiB(spec.GetHugepages())
	mem := vmm.MemoryLimitMiB(int(spec.GetMemoryMib()), vmm.Accel(spec.GetAccel()), kib)
	s := &vmflowv1.CapacityLease{Vcpus: spec.GetVcpus(), DedicatedCpus: spec.GetDedicatedCpus(), MemoryMib: uint32(min(mem, math.MaxUint32))}
	if kib > 0 {
		s.HugepageKib = uint32(kib)
		s.Hugepages = uint32(min(uint64(spec.GetMemoryMib())*1024/uint64(kib), math.MaxUint32))
	}
	return s
}

// hugeMiB is the MiB of guest RAM s holds in hugepages.
func hugeMiB(s *vmflowv1.CapacityLease) uint64 {
	return uint64(s.GetHugepages()) * uint64(s.GetHugepageKib()) / 1024
}

// expired reports whether l is an INTENT past its expiry.
func expired(l *vmflowv1.Lease, now time.Time) bool {
	at := l.GetCapacity().GetExpiresAt()
	return l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT && at != nil && !now.Before(at.AsTime())
}

// Usage sums what every record but except holds now; Unreadable counts
// those it could not read.
func (c *Capacity) Usage(except string) (Usage, error) {
	u, _, err := c.ledger(except)
	return u, err
}

// countable is the ledger for a promise: refused (ErrLedgerUnreadable)
// while a record cannot be read, as it may hold any share: counting it as
// nothing let a repaired record put the host over its capacity (the host
// model's finding).
func (c *Capacity) countable(except string) (Usage, nodesUsed, error) {
	u, nodes, err := c.ledger(except)
	if err == nil && u.Unreadable > 0 {
		err = fmt.Errorf("%w: %d record(s); repair or remove them (RUNBOOK section 3)", ErrLedgerUnreadable, u.Unreadable)
	}
	return u, nodes, err
}

// ledger sums what every record but except holds now, of the host and of
// each node: kept from the store index's changes (tally: no record is
// read but one written since, or a stale one), or over the records
// without an index.
func (c *Capacity) ledger(except string) (Usage, nodesUsed, error) {
	if u, nodes, ok := c.tally.usage(c.cfg.Store, except, c.cfg.Now()); ok {
		return u, nodes, nil
	}
	recs, err := c.cfg.Store.Records()
	var le *store.ListError
	if err != nil && !errors.As(err, &le) {
		return Usage{}, nodesUsed{}, fmt.Errorf("capacity ledger: %w", err)
	}
	unreadable := 0
	if le != nil {
		unreadable = len(le.Unreadable)
	}
	u, nodes := c.sum(recs, unreadable, except)
	return u, nodes, nil
}

// UsageOf is Usage over records a caller already listed (unreadable: how
// many it could not read), so one read of the records serves both.
func (c *Capacity) UsageOf(recs []*vmflowv1.InstanceRecord, unreadable int) Usage {
	u, _ := c.sum(recs, unreadable, "")
	return u
}

// sum is what recs but except hold now, of the host and of each node.
func (c *Capacity) sum(recs []*vmflowv1.InstanceRecord, unreadable int, except string) (Usage, nodesUsed) {
	u := Usage{Unreadable: unreadable}
	nodes := nodesUsed{}
	now := c.cfg.Now()
	for _, rec := range recs {
		if rec.GetId() == except {
			continue
		}
		if m := shareOf(rec); m.heldAt(now) {
			u.add(m)
			nodes.add(m.share)
		}
	}
	return u, nodes
}

// heldAt reports whether m holds its share at now.
func (m shareMemo) heldAt(now time.Time) bool {
	return m.share != nil && (m.expires.IsZero() || now.Before(m.expires))
}

// add counts m's share.
func (u *Usage) add(m shareMemo) {
	u.VCPUs += m.vcpus
	u.MemoryMiB += m.memMiB
	u.DedicatedCPUs += m.dedicated
	if m.hugeMiB > 0 {
		if u.HugepageMiB == nil {
			u.HugepageMiB = map[uint32]uint64{}
		}
		u.HugepageMiB[m.hugeKiB] += m.hugeMiB
	}
}

// sub takes m's share, counted by add, back out.
func (u *Usage) sub(m shareMemo) {
	u.VCPUs = sub(u.VCPUs, m.vcpus)
	u.MemoryMiB = sub(u.MemoryMiB, m.memMiB)
	u.DedicatedCPUs = sub(u.DedicatedCPUs, m.dedicated)
	if m.hugeMiB > 0 && u.HugepageMiB != nil {
		if u.HugepageMiB[m.hugeKiB] = sub(u.HugepageMiB[m.hugeKiB], m.hugeMiB); u.HugepageMiB[m.hugeKiB] == 0 {
			delete(u.HugepageMiB, m.hugeKiB)
		}
	}
}

// clone is a copy of u to count more on.
func (u Usage) clone() Usage {
	out := u
	out.HugepageMiB = nil
	for k, v := range u.HugepageMiB {
		if out.HugepageMiB == nil {
			out.HugepageMiB = map[uint32]uint64{}
		}
		out.HugepageMiB[k] = v
	}
	return out
}

// tally is the ledger kept up to date from the store index's changes
// (Store.RecordsChanged): what each record holds, read once per write of
// it, and the sum of the shares that do not expire, so a reservation or
// a placement reads only the records written since the last one, not
// every record's leases (issue 36: that walk cost a launch at 1,000 VMs
// 1.2 ms). Reservations that expire are summed at each use (few: the
// spawns granted and not launched yet); a record stale in the index is
// read from disk at each use, as Records reads it.
type tally struct {
	mu         sync.Mutex
	epoch, seq uint64
	held       map[string]shareMemo // every readable record's, by id; nil: not read yet
	expiring   map[string]bool      // the ids of held whose share expires
	stale      map[string]bool
	u          Usage // the shares of held that do not expire
	nodes      nodesUsed
}

// usage is the ledger of every record but except at now, from st's
// index; ok is false without one.
func (t *tally) usage(st *store.Store, except string, now time.Time) (Usage, nodesUsed, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.sync(st) {
		return Usage{}, nodesUsed{}, false
	}
	u, nodes := t.u.clone(), t.nodes.clone()
	if m, ok := t.held[except]; ok && m.share != nil && !t.expiring[except] {
		u.sub(m)
		nodes.sub(m.share)
	}
	for id := range t.expiring {
		if m := t.held[id]; id != except && m.heldAt(now) {
			u.add(m)
			nodes.add(m.share)
		}
	}
	for id := range t.stale {
		rec, err := st.Get(id)
		switch {
		case errors.Is(err, store.ErrNotFound):
		case err != nil:
			u.Unreadable++ // except's too, as Records names it
		case id != except:
			if m := shareOf(rec); m.heldAt(now) {
				u.add(m)
				nodes.add(m.share)
			}
		}
	}
	return u, nodes, true
}

// sync brings t up to st's index: the records changed since t's last
// look, or all of them when the index is another or remembers too few.
func (t *tally) sync(st *store.Store) bool {
	if ids, next, ok := st.RecordsChanged(t.epoch, t.seq); ok && t.held != nil {
		for _, id := range ids {
			t.drop(id)
			rec, stale := st.IndexRecord(id)
			switch {
			case stale:
				t.stale[id] = true
			case rec != nil:
				t.put(id, shareOf(rec))
			}
		}
		t.seq = next
		return true
	}
	recs, stale, epoch, seq, ok := st.IndexRecords()
	if !ok {
		t.held = nil
		return false
	}
	t.epoch, t.seq, t.u, t.nodes = epoch, seq, Usage{}, nodesUsed{}
	t.held, t.expiring, t.stale = map[string]shareMemo{}, map[string]bool{}, map[string]bool{}
	for id, rec := range recs {
		t.put(id, shareOf(rec))
	}
	for _, id := range stale {
		t.stale[id] = true
	}
	return true
}

// put counts what id holds.
func (t *tally) put(id string, m shareMemo) {
	delete(t.stale, id)
	t.held[id] = m
	switch {
	case m.share == nil:
	case !m.expires.IsZero():
		t.expiring[id] = true
	default:
		t.u.add(m)
		t.nodes.add(m.share)
	}
}

// drop takes what id held back out.
func (t *tally) drop(id string) {
	delete(t.stale, id)
	m, ok := t.held[id]
	if !ok {
		return
	}
	delete(t.held, id)
	switch {
	case m.share == nil:
	case t.expiring[id]:
		delete(t.expiring, id)
	default:
		t.u.sub(m)
		t.nodes.sub(m.share)
	}
}

// fits refuses s when u and s together exceed the limits; pinned: the VM's
// memory is pinned (a GPU's), so it must fit without the overcommit.
func (c *Capacity) fits(id string, u Usage, s *vmflowv1.CapacityLease, pinned bool) error {
	lim := c.Limits()
	mem := lim.MemoryMiB
	if pinned {
		mem = min(mem, lim.PhysicalMiB)
	}
	freeCPU, freeMem := sub(lim.VCPUs, u.VCPUs), sub(mem, u.MemoryMiB)
	if s.GetDedicatedCpus() {
		if free := sub(uint64(len(c.cfg.DedicatedCPUs)), u.DedicatedCPUs); uint64(s.GetVcpus()) > free {
			return fmt.Errorf("%w: instance %s asks %d dedicated CPUs; %d of the host's %d are free (--dedicated-cpus)",
				ErrNoHostCapacity, id, s.GetVcpus(), free, len(c.cfg.DedicatedCPUs))
		}
	}
	if huge := hugeMiB(s); huge > 0 {
		pool := hugepagePoolMiB(c.cfg.Topology.Nodes, s.GetHugepageKib())
		if free := sub(pool, u.HugepageMiB[s.GetHugepageKib()]); huge > free {
			return fmt.Errorf("%w: instance %s asks %d MiB in %d KiB hugepages; %d MiB of the host's pools of that size are free",
				ErrNoHostCapacity, id, huge, s.GetHugepageKib(), free)
		}
	}
	// A dedicated VM's vCPUs are its own CPUs (checked above), not shared ones.
	if (s.GetDedicatedCpus() || uint64(s.GetVcpus()) <= freeCPU) && uint64(s.GetMemoryMib()) <= freeMem {
		return nil
	}
	why := ""
	if pinned {
		why = ", a GPU VM's memory is pinned: no overcommit"
	}
	return fmt.Errorf("%w: instance %s asks %d vCPUs and %d MiB (guest RAM and QEMU's own); free: %d of %d vCPUs (%d CPUs × %g), %d of %d MiB (%d MiB less a %d MiB reserve, × %g%s)",
		ErrNoHostCapacity, id, s.GetVcpus(), s.GetMemoryMib(), freeCPU, lim.VCPUs, c.cfg.CPUs, c.cfg.CPUOvercommit,
		freeMem, mem, c.cfg.MemoryMiB, c.cfg.MemoryReserveMiB, c.cfg.MemoryOvercommit, why)
}

func sub(a, b uint64) uint64 {
	if b > a {
		return 0
	}
	return a - b
}

// pinned: a VM with a GPU, whose RAM QEMU pins for VFIO.
func pinned(spec *vmflowv1.VMSpec) bool {
	return spec.GetVgpuProfile() != "" || spec.GetGpuPassthroughCount() > 0
}

// Reserve is store.Create's reservation for instance id of spec: its share
// as an INTENT that expires after the TTL, or ErrNoHostCapacity.
func (c *Capacity) Reserve(id string, spec *vmflowv1.VMSpec) store.Reserve {
	return func(context.Context) (*vmflowv1.Lease, error) {
		if c.cfg.Draining != nil {
			if err := c.cfg.Draining(); err != nil {
				return nil, err
			}
		}
		u, _, err := c.countable(id)
		if err != nil {
			return nil, err
		}
		s := Share(spec)
		if err := c.fits(id, u, s, pinned(spec)); err != nil {
			c.cfg.Logger.Info("capacity refused", zap.String("instance_id", id), zap.Error(err))
			return nil, err
		}
		s.ExpiresAt = timestamppb.New(c.cfg.Now().Add(c.cfg.TTL))
		return store.CapacityLeaseOf(s), nil
	}
}

// Place makes the locked instance's share ACTIVE before its QEMU starts,
// under the admission lock: an unexpired INTENT as it is, an expired one
// (or none, from before the ledger) reserved again against the others, or
// ErrNoHostCapacity; an ACTIVE one (a restart) is kept. It returns the
// record as written.
func (c *Capacity) Place(ctx context.Context, l *store.Locked) (rec *vmflowv1.InstanceRecord, err error) {
	// Where the GPUs sit and which nodes have GPUs free are read from
	// sysfs before the admission lock, which every create on the host
	// waits for: the record cannot change meanwhile (its lock is held),
	// and the free GPUs are only a preference.
	if rec, err = l.Get(); err != nil {
		return nil, fmt.Errorf("place capacity: %w", err)
	}
	hints := c.hints(ctx, rec)
	err = c.cfg.Store.Admitting(ctx, func() error {
		if rec, err = l.Get(); err != nil {
			return err
		}
		have := store.Capacity(rec)
		now := c.cfg.Now()
		if have != nil && store.LeaseHeld(have) && have.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			if c.stillPlaced(have.GetCapacity()) {
				return nil // a restart: where it was placed, it stays
			}
			// The host changed under it (a reboot with fewer CPUs or
			// nodes, another --dedicated-cpus): its share stays counted,
			// its place is chosen again, or the launch is refused.
			c.cfg.Logger.Warn("capacity placement no longer fits this host; placing again", zap.String("instance_id", l.ID()),
				zap.String("cpus", have.GetCapacity().GetCpus()))
		}
		u, nodes, uerr := c.countable(l.ID())
		if uerr != nil {
			return uerr
		}
		s := Share(rec.GetSpec())
		if have == nil || !store.LeaseHeld(have) || expired(have, now) {
			// Not reserved (an older agent's record) or no longer: the
			// others may have taken the room since.
			if ferr := c.fits(l.ID(), u, s, pinned(rec.GetSpec())); ferr != nil {
				return ferr
			}
		}
		where, perr := c.place(rec, s, nodes, hints)
		if perr != nil {
			return perr
		}
		s.NumaNodes, s.Cpus = where.nodes, where.cpus
		rec, err = l.Apply(store.CapacityPlaced(s, now))
		if err == nil {
			crashpoint.Hit(crashpoint.CapacityPlaced)
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("place capacity: %w", err)
	}
	return rec, nil
}

// stillPlaced reports whether a placed share's CPUs and nodes are still
// the host's to give it as they were: every CPU on a node of the host's,
// in the dedicated pool exactly when the share is dedicated, every node
// there; and a share placed nowhere on a host that places nothing.
func (c *Capacity) stillPlaced(s *vmflowv1.CapacityLease) bool {
	t := c.cfg.Topology
	if len(t.Nodes) == 0 {
		return s.GetCpus() == "" && len(s.GetNumaNodes()) == 0
	}
	cpus, err := topology.ParseCPUList(s.GetCpus())
	if err != nil {
		return false
	}
	for _, cpu := range cpus {
		node, ok := t.NodeOfCPU(cpu)
		if !ok || slices.Contains(c.cfg.DedicatedCPUs, cpu) != s.GetDedicatedCpus() {
			return false
		}
		// Renumbered nodes (another NUMA layout after a reboot): its
		// CPUs must be on the nodes its memory is bound to.
		if t.NUMA && len(s.GetNumaNodes()) > 0 && !slices.Contains(s.GetNumaNodes(), uint32(node)) {
			return false
		}
	}
	for _, n := range s.GetNumaNodes() {
		if _, ok := t.Node(int(n)); !ok {
			return false
		}
	}
	if s.GetCpus() == "" && len(c.cfg.DedicatedCPUs) > 0 {
		return false // placed before the host kept a pool: it would share it
	}
	return true
}

// capacityDriver is the capacity lease's lease.Driver: a share of the host
// has nothing to give back (the VM's memory went with its thread group,
// which the engine waited for), so its release is the record's alone.
type capacityDriver struct{}

// CapacityDriver is the driver of capacity leases, registered on every
// host (NewHostEngine).
func CapacityDriver() Driver { return capacityDriver{} }

func (capacityDriver) Kind() string { return store.KindCapacity }
func (capacityDriver) Owned(context.Context, string, *vmflowv1.Lease) error {
	return nil
}
func (capacityDriver) Nodes(context.Context, *vmflowv1.Lease) ([]string, error) { return nil, nil }
func (capacityDriver) Release(context.Context, string, *vmflowv1.Lease) error   { return nil }
func (capacityDriver) Devices(*vmflowv1.Lease) []string                         { return nil }
func (capacityDriver) Points() ReleasePoints {
	return ReleasePoints{Releasing: crashpoint.CapacityReleasing, Recorded: crashpoint.CapacityReleased}
}
