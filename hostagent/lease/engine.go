package lease

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Driver is one kind of lease (a vGPU, a whole GPU, a place on the
// network), as a Nomad device plugin is one kind of device: it knows its
// resource, and the engine runs the protocol around it, never switching
// on the kind. Adding a kind is a proto message, one Driver and one
// Register call.
//
// Every method is called under the instance's lock.
type Driver interface {
	// Kind is store.LeaseKind of the leases it serves.
	Kind() string
	// Owned refuses (an error wrapping gpu.ErrClaimedByOther or the
	// kind's own conflict) when another instance's held lease names what
	// l names: then it is not this instance's to release (invariant 10).
	Owned(ctx context.Context, id string, l *vmflowv1.Lease) error
	// Nodes are the device nodes no process may hold when l's resource
	// is released (a VFIO group's node); "" for a device already gone.
	// An error means it cannot tell, which refuses the release.
	Nodes(ctx context.Context, l *vmflowv1.Lease) ([]string, error)
	// Release gives l's resource back; a resource that no longer exists
	// is released. Its error is the device's failure unless it is Busy
	// (a write still in flight) or the context's.
	Release(ctx context.Context, id string, l *vmflowv1.Lease) error
	// Devices are what a failure of l's resource counts against toward
	// quarantine (a VF, an mdev's parent GPU, a whole GPU's display
	// functions); none for a kind never quarantined.
	Devices(l *vmflowv1.Lease) []string
	// Points are the crash points at the release's persisted steps.
	Points() ReleasePoints
}

// carded is implemented by a driver whose devices are cards a reboot may
// swap under the same id (a whole GPU at its PCI address): cards names
// the card each of Devices(l) is, so a device's strikes count only its
// own card's failures.
type carded interface {
	cards(l *vmflowv1.Lease) []string
}

// cardsOf is d's cards of l, nil when its devices are not cards.
func cardsOf(d Driver, l *vmflowv1.Lease) []string {
	if c, ok := d.(carded); ok {
		return c.cards(l)
	}
	return nil
}

// Released is implemented by a driver with work once a release is
// recorded (the network's filter element); its failure is only logged:
// the resource is released.
type Released interface {
	Released(ctx context.Context, id string, l *vmflowv1.Lease)
}

// ReleasePoints name a kind's crash points: after its lease says
// releasing, after its resource was given back, after the release is
// recorded.
type ReleasePoints struct{ Releasing, Done, Recorded string }

// ErrKindNotServed: the instance holds a lease of a kind this agent has
// no driver for (started without the host's GPU driver or network). Its
// release cannot end until the agent serves the kind: NoDriver, so the
// delete parks needing attention rather than retrying blind.
var ErrKindNotServed = errdefs.NoDriver.New("lease cannot be served by this agent")

// EngineConfig configures an Engine.
type EngineConfig struct {
	Store *store.Store
	// Quarantine counts the devices' failures (nil: none counted).
	Quarantine *Quarantine
	// IgnoreUninspectable: see Config.IgnoreUninspectable.
	IgnoreUninspectable []int
	Logger              *zap.Logger
	Now                 func() time.Time
	// ReleaseTook, when set, is told how long each lease's release by its
	// driver took (the resource given back, or the driver's failure), by
	// kind; a refusal never reaches the driver and is not timed.
	ReleaseTook func(kind string, took time.Duration)
}

// Engine runs the lease protocol once for every kind: a release only
// once the VM's whole thread group is gone and no process holds its
// device's node (MayRelease), the failure recorded on the lease with the
// record kept, the device's own failures counted toward its quarantine,
// and the lease released only when its resource is.
type Engine struct {
	st      *store.Store
	quar    *Quarantine
	ignore  []int
	log     *zap.Logger
	now     func() time.Time
	holders holdersFunc
	drivers []registered
	took    func(kind string, took time.Duration)
}

type registered struct {
	Driver
	afterOthers bool
}

// NewEngine returns an engine with no driver yet.
func NewEngine(cfg EngineConfig) *Engine {
	c := Config{Store: cfg.Store, Logger: cfg.Logger, Now: cfg.Now}.WithDefaults()
	return &Engine{st: cfg.Store, quar: cfg.Quarantine, ignore: cfg.IgnoreUninspectable, log: c.Logger, now: c.Now, holders: proc.Holders,
		took: cfg.ReleaseTook}
}

// RegisterOption shapes how a driver's leases are released.
type RegisterOption func(*registered)

// AfterOthers releases the kind's leases only once every lease of the
// kinds registered before it is released: the network's address goes
// back last, never while a device the VM held is unreleased.
func AfterOthers() RegisterOption { return func(r *registered) { r.afterOthers = true } }

// Register adds a driver; kinds are released in the order registered.
// Registering a kind twice replaces it.
func (e *Engine) Register(d Driver, opts ...RegisterOption) {
	r := registered{Driver: d}
	for _, o := range opts {
		o(&r)
	}
	if i := slices.IndexFunc(e.drivers, func(x registered) bool { return x.Kind() == d.Kind() }); i >= 0 {
		e.drivers[i] = r
		return
	}
	e.drivers = append(e.drivers, r)
}

// NewHostEngine is a host's lease engine over the drivers it serves: the
// devices' in order, the capacity ledger's (every host's), then the
// network's (nil when the host has none),
// whose address is released only after every device (AfterOthers). The
// one registration the activities and the host model share.
func NewHostEngine(cfg EngineConfig, devices []Driver, network Driver) *Engine {
	e := NewEngine(cfg)
	for _, d := range devices {
		e.Register(d)
	}
	e.Register(CapacityDriver())
	if network != nil {
		e.Register(network, AfterOthers())
	}
	return e
}

// Serves reports whether a driver of kind is registered.
func (e *Engine) Serves(kind string) bool { return e.driver(kind) != nil }

func (e *Engine) driver(kind string) Driver {
	for _, r := range e.drivers {
		if r.Kind() == kind {
			return r.Driver
		}
	}
	return nil
}

// Outcome is what one Release did.
type Outcome struct {
	// All: every lease the instance held (of the kinds asked) is
	// released now; false when it held none.
	All bool
	// Released are the leases released now, in release order.
	Released []*vmflowv1.Lease
}

// Of are the leases of kind released now.
func (o Outcome) Of(kind string) []*vmflowv1.Lease {
	var out []*vmflowv1.Lease
	for _, l := range o.Released {
		if store.LeaseKind(l) == kind {
			out = append(out, l)
		}
	}
	return out
}

// Release releases every lease instance id holds (only those of kinds,
// when given), kind by kind in the order registered, each lease only when
// MayRelease allows it. A failure keeps that lease, records why and moves
// the record to ReleaseFailed (invariant 1); the other leases are
// released all the same, except the kinds registered AfterOthers. A lease
// of a kind no driver serves is ErrKindNotServed. A record that is gone
// has nothing to release.
func (e *Engine) Release(ctx context.Context, id string, kinds ...string) (Outcome, error) {
	var out Outcome
	l, rec, err := lockToRelease(ctx, e.st, id, "leases")
	if l == nil || err != nil {
		return out, err
	}
	defer l.Unlock()
	var held []*vmflowv1.Lease
	for _, lease := range store.HeldLeases(rec) {
		if len(kinds) == 0 || slices.Contains(kinds, store.LeaseKind(lease)) {
			held = append(held, lease)
		}
	}
	var errs []error
	for _, lease := range held {
		if !e.Serves(store.LeaseKind(lease)) {
			errs = append(errs, fmt.Errorf("%w: instance %s holds a %s, and this agent runs without a driver for it: restart it with the host's %s driver, then retry",
				ErrKindNotServed, id, store.DescribeLease(lease), store.LeaseKind(lease)))
		}
	}
	for _, r := range e.drivers {
		if r.afterOthers && len(errs) > 0 {
			break
		}
		for _, lease := range held {
			if store.LeaseKind(lease) != r.Kind() {
				continue
			}
			if err := e.releaseOne(ctx, l, rec, r.Driver, lease); err != nil {
				errs = append(errs, err)
				continue
			}
			out.Released = append(out.Released, lease)
		}
	}
	out.All = len(held) > 0 && len(errs) == 0
	return out, errors.Join(errs...)
}

// releaseOne releases one held lease of the locked instance rec.
func (e *Engine) releaseOne(ctx context.Context, l *store.Locked, rec *vmflowv1.InstanceRecord, d Driver, lease *vmflowv1.Lease) error {
	name := store.LeaseName(lease)
	fail := func(err error) error {
		err = fmt.Errorf("%s: %w", store.DescribeLease(lease), err)
		if _, rerr := l.Apply(store.LeaseReleaseFailed(name, err.Error())); rerr != nil {
			e.log.Error("record release failure", zap.String("instance_id", l.ID()), zap.Error(rerr), zap.NamedError("cause", err))
		}
		return err
	}
	// Invariant 10 first: a resource another lease names is not ours to
	// release, whatever the kernel says about it.
	err := d.Owned(ctx, l.ID(), lease)
	if err == nil {
		err = e.mayRelease(ctx, rec, d, lease, e.holders)
	}
	if err != nil {
		return fail(err) // a refusal: not the device's failure
	}
	if _, err := l.Apply(store.LeaseReleasing(name)); err != nil {
		return err
	}
	pts := d.Points()
	crashpoint.Hit(pts.Releasing)
	began := time.Now()
	err = d.Release(ctx, l.ID(), lease)
	if e.took != nil {
		e.took(d.Kind(), time.Since(began))
	}
	if err != nil {
		err = fail(err)
		strikeIfFault(ctx, e.quar, e.log, l.ID(), err, d.Devices(lease), cardsOf(d, lease))
		return err
	}
	crashpoint.Hit(pts.Done)
	succeeded(ctx, e.quar, e.log, d.Devices(lease)...)
	if _, err := l.Apply(store.LeaseReleased(name, e.now())); err != nil {
		// Given back, but the record still holds it: the next release
		// finds it already gone and records it then.
		return fmt.Errorf("record release of %s: %w", store.DescribeLease(lease), err)
	}
	crashpoint.Hit(pts.Recorded)
	if after, ok := d.(Released); ok {
		after.Released(ctx, l.ID(), lease)
	}
	e.log.Info("lease released", zap.String("instance_id", l.ID()), zap.String("kind", d.Kind()), zap.String("lease", name))
	return nil
}

// Rollback undoes every held lease of kind of the locked instance, a
// claim that failed, while the record never launched (no QEMU can have had
// its devices; a record that launched keeps its leases for the delete):
// each is marked rolling back, its resource released by its driver, and
// the lease dropped. A lease another instance's held lease names, or whose
// node a process holds, is kept (invariant 10, and an operator's case) and
// the others are undone all the same; a device's own failure is struck.
func (e *Engine) Rollback(ctx context.Context, l *store.Locked, kind string) error {
	rec, err := l.Get()
	if err != nil {
		return err
	}
	if !store.NeverLaunched(rec) {
		return nil
	}
	d := e.driver(kind)
	if d == nil {
		return fmt.Errorf("%w: roll back %s leases of %s", ErrKindNotServed, kind, l.ID())
	}
	var errs []error
	for _, lease := range store.HeldLeases(rec) {
		if store.LeaseKind(lease) != kind {
			continue
		}
		if err := e.rollbackOne(ctx, l, d, lease); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", store.DescribeLease(lease), err))
		}
	}
	return errors.Join(errs...)
}

func (e *Engine) rollbackOne(ctx context.Context, l *store.Locked, d Driver, lease *vmflowv1.Lease) error {
	name := store.LeaseName(lease)
	if err := d.Owned(ctx, l.ID(), lease); err != nil {
		return err
	}
	nodes, err := d.Nodes(ctx, lease)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		if err := nodeFree(ctx, n, e.holders, e.ignore); err != nil {
			return err
		}
	}
	if _, err := l.Apply(store.LeaseRollingBack(name)); err != nil {
		return err
	}
	crashpoint.Hit(crashpoint.ClaimRollingBack)
	if err := d.Release(ctx, l.ID(), lease); err != nil {
		strikeIfFault(ctx, e.quar, e.log, l.ID(), err, d.Devices(lease), cardsOf(d, lease))
		return err
	}
	if _, err := l.Apply(store.LeaseRolledBack(name)); err != nil {
		return err
	}
	crashpoint.Hit(crashpoint.ClaimRolledBack)
	e.log.Info("claim rolled back", zap.String("instance_id", l.ID()), zap.String("kind", d.Kind()), zap.String("lease", name))
	return nil
}

// MayRelease is invariant 2, decided here and nowhere else: rec's whole
// thread group confirmed gone (an unproven absence counts as alive:
// ErrVMAlive) and no process holding any node of the lease's device
// (ErrDeviceHeld; one that cannot be inspected counts as a holder). A
// refusal is retryable and never counts against the device.
func (e *Engine) MayRelease(ctx context.Context, rec *vmflowv1.InstanceRecord, d Driver, lease *vmflowv1.Lease) error {
	return e.mayRelease(ctx, rec, d, lease, e.holders)
}

// mayRelease is MayRelease asking holders who holds a node (one /proc
// walk shared by a scan's items, or a fresh one before a release).
func (e *Engine) mayRelease(ctx context.Context, rec *vmflowv1.InstanceRecord, d Driver, lease *vmflowv1.Lease, holders holdersFunc) error {
	if err := vmGone(e.st, rec); err != nil {
		return err
	}
	nodes, err := d.Nodes(ctx, lease)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		if err := nodeFree(ctx, n, holders, e.ignore); err != nil {
			return err
		}
	}
	return nil
}

// ClaimSteps are one kind's steps of an all-or-nothing claim (ClaimAll).
type ClaimSteps struct {
	// What names the claim's unit in errors ("vGPU", "whole GPU"), Detail
	// what follows the count (` ("GRID A100-4C")`).
	What, Detail string
	// Held are the instance's held leases of the kind, in claim order.
	Held []*vmflowv1.Lease
	// Finish makes a held lease active (an intent finished where it was
	// placed, an active one ensured); (nil, nil): the lease was undone (its
	// device failed) and the claim places anew.
	Finish func(context.Context, *vmflowv1.Lease) (*vmflowv1.Lease, error)
	// Place places one new lease toward need more units, its intent
	// written ahead, and makes it; (nil, nil): its device failed and was
	// undone and left out, and the claim places again (Place must leave
	// out what failed, so the loop ends).
	Place func(ctx context.Context, need int) (*vmflowv1.Lease, error)
	// Rollback undoes every held lease of the kind while the record never
	// launched (a no-op once it did: the delete releases them).
	Rollback func(context.Context) error
	// Units is how much of the count one lease fills (a vGPU: 1; a whole
	// GPU's group: its GPUs). Nil: 1.
	Units func(*vmflowv1.Lease) int
}

// ClaimAll gives instance id count units of one kind, all or none: the
// held leases are finished first, then new ones placed until count is
// met. A failure that ends the claim (final: its class says no retry can
// change the answer, or the host has no room for the rest, as holding
// some while waiting for others would starve every other claim) rolls
// back this kind's leases; any other failure, or a crash, leaves them for
// the retried claim to finish or the delete to release.
func ClaimAll(ctx context.Context, id string, count int, s ClaimSteps) ([]*vmflowv1.Lease, error) {
	units := s.Units
	if units == nil {
		units = func(*vmflowv1.Lease) int { return 1 }
	}
	held := s.Held
	if n := sumUnits(held, units); n > count {
		return nil, fmt.Errorf("claim %d %s%s for %s: %w (it holds %d)", count, s.What, s.Detail, id, ErrClaimConflict, n)
	}
	if slices.ContainsFunc(held, rollingBack) {
		// A rollback a crash interrupted: that claim failed, and is
		// finished undoing before this one starts afresh.
		if err := s.Rollback(ctx); err != nil {
			return nil, fmt.Errorf("claim %s%s for %s: finish an interrupted rollback: %w", s.What, s.Detail, id, err)
		}
		held = nil
	}
	var out []*vmflowv1.Lease
	var err error
	have := 0
	for i := 0; have < count; i++ {
		var lease *vmflowv1.Lease
		if i < len(held) {
			lease, err = s.Finish(ctx, held[i])
		} else {
			lease, err = s.Place(ctx, count-have)
		}
		if err != nil {
			err = fmt.Errorf("claim %s %d of %d%s for %s: %w", s.What, have+1, count, s.Detail, id, err)
			break
		}
		if lease == nil {
			continue // undone: placed anew
		}
		out = append(out, lease)
		have += max(units(lease), 1)
	}
	if err == nil {
		return out, nil
	}
	if !final(err) {
		return nil, err
	}
	if rerr := s.Rollback(ctx); rerr != nil {
		return nil, errors.Join(err, fmt.Errorf("roll back the claim of %s: %w", id, rerr))
	}
	return nil, err
}

func sumUnits(ls []*vmflowv1.Lease, units func(*vmflowv1.Lease) int) int {
	n := 0
	for _, l := range ls {
		n += max(units(l), 1)
	}
	return n
}
