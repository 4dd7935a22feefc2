package lease

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/store"
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

// Capacity defaults.
const (
	DefaultCPUOvercommit    = 4.0
	DefaultMemoryOvercommit = 1.0
	// DefaultReservationTTL is how long a reservation counts before its
	// launch: a spawn's claim of whole GPUs (binds, resets) fits well
	// inside it, and a spawn that died frees its room within it.
	DefaultReservationTTL = 10 * time.Minute
	// MaxOvercommit bounds both ratios: a ratio beyond it is a typo.
	MaxOvercommit = 64.0
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
	TTL    time.Duration
	Now    func() time.Time
	Logger *zap.Logger
}

// Capacity keeps the ledger.
type Capacity struct{ cfg CapacityConfig }

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
	return &Capacity{cfg: cfg}, nil
}

// Limits are what the host may promise in all.
type Limits struct {
	VCPUs uint64
	// MemoryMiB is the VMs' memory with the overcommit; PhysicalMiB
	// without it (what a GPU VM must fit in).
	MemoryMiB, PhysicalMiB uint64
}

// Limits are the host's.
func (c *Capacity) Limits() Limits {
	phys := c.cfg.MemoryMiB - c.cfg.MemoryReserveMiB
	return Limits{
		VCPUs:       uint64(float64(c.cfg.CPUs) * c.cfg.CPUOvercommit),
		MemoryMiB:   uint64(float64(phys) * c.cfg.MemoryOvercommit),
		PhysicalMiB: phys,
	}
}

// Usage is what the records hold of the host.
type Usage struct {
	VCPUs, MemoryMiB uint64
	// Unreadable counts records that could not be read: what they hold
	// is not known, so not counted (they page an operator:
	// VmflowRecordsUnreadable).
	Unreadable int
}

// Share is what a VM of spec holds of its host: its vCPUs and everything
// its cgroup allows it (vmm.MemoryLimitMiB, QEMU's own memory included).
func Share(spec *vmflowv1.VMSpec) *vmflowv1.CapacityLease {
	return &vmflowv1.CapacityLease{
		Vcpus:         spec.GetVcpus(),
		MemoryMib:     uint32(min(vmm.MemoryLimitMiB(int(spec.GetMemoryMib()), vmm.Accel(spec.GetAccel())), math.MaxUint32)),
		DedicatedCpus: spec.GetDedicatedCpus(),
	}
}

// heldShare is what rec holds of the host at now: its capacity lease while
// held (an INTENT only until it expires); a record written before the
// ledger holds its spec's share while a QEMU of it may run.
func heldShare(rec *vmflowv1.InstanceRecord, now time.Time) *vmflowv1.CapacityLease {
	l := store.Capacity(rec)
	if l == nil {
		if rec.GetProcess() != nil || rec.GetLaunchStartedAt() != nil {
			return Share(rec.GetSpec())
		}
		return nil
	}
	if !store.LeaseHeld(l) || expired(l, now) {
		return nil
	}
	return l.GetCapacity()
}

// expired reports whether l is an INTENT past its expiry.
func expired(l *vmflowv1.Lease, now time.Time) bool {
	at := l.GetCapacity().GetExpiresAt()
	return l.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT && at != nil && !now.Before(at.AsTime())
}

// Usage sums what every record but except holds now.
func (c *Capacity) Usage(except string) (Usage, error) {
	recs, err := c.cfg.Store.List()
	var le *store.ListError
	if err != nil && !errors.As(err, &le) {
		return Usage{}, fmt.Errorf("capacity ledger: %w", err)
	}
	var u Usage
	if le != nil {
		u.Unreadable = len(le.Unreadable)
	}
	now := c.cfg.Now()
	for _, rec := range recs {
		if rec.GetId() == except {
			continue
		}
		if s := heldShare(rec, now); s != nil {
			u.VCPUs += uint64(s.GetVcpus())
			u.MemoryMiB += uint64(s.GetMemoryMib())
		}
	}
	return u, nil
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
	if uint64(s.GetVcpus()) <= freeCPU && uint64(s.GetMemoryMib()) <= freeMem {
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
		u, err := c.Usage(id)
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
	err = c.cfg.Store.Admitting(ctx, func() error {
		if rec, err = l.Get(); err != nil {
			return err
		}
		have := store.Capacity(rec)
		now := c.cfg.Now()
		switch {
		case have != nil && store.LeaseHeld(have) && have.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE:
			return nil
		case have != nil && store.LeaseHeld(have) && have.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT && !expired(have, now):
			rec, err = l.Apply(store.CapacityPlaced(have.GetCapacity(), now))
		default:
			u, uerr := c.Usage(l.ID())
			if uerr != nil {
				return uerr
			}
			s := Share(rec.GetSpec())
			if ferr := c.fits(l.ID(), u, s, pinned(rec.GetSpec())); ferr != nil {
				return ferr
			}
			rec, err = l.Apply(store.CapacityPlaced(s, now))
		}
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
