package lease

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// ErrNoWholeGPU: no offered, viable, unclaimed IOMMU group holds a GPU of
// the model asked for. Retryable: a delete may free one.
var ErrNoWholeGPU = errdefs.NoCapacity.New("passthrough: no free whole GPU")

// WholeConfig configures Whole.
type WholeConfig struct {
	// Driver binds and returns IOMMU groups (gpu.NewPassthrough).
	Driver *gpu.Passthrough
	Store  *store.Store
	// OrphanGrace: how long a group vmflow marked and no claim names stays
	// bound before reconcile returns it (DefaultOrphanGrace).
	OrphanGrace         time.Duration
	Logger              *zap.Logger
	IgnoreUninspectable []int
	Now                 func() time.Time
	// Quarantine, if set, takes a GPU whose return failed K times out of
	// placement.
	Quarantine *Quarantine
}

// Whole keeps whole-GPU (passthrough) claims in the instance records, as
// Claims keeps vGPUs': each IOMMU group's lease is written ahead of the
// first sysfs write (with every function and the driver it had), active
// once the group is on vfio-pci, and released only after the VM's thread
// group is gone and nothing holds the group's VFIO node, by returning every
// function to its recorded driver.
type Whole struct {
	drv    *gpu.Passthrough
	st     *store.Store
	grace  time.Duration
	ledger string
	ignore []int
	log    *zap.Logger
	now    func() time.Time
	quar   *Quarantine
	// seen and scanFDs serve Scan, as Claims' do.
	seen    scanSeen
	scanFDs func(context.Context) (*proc.FDScan, error)
	// eng runs the protocol for the whole-GPU leases (LeaseDriver).
	eng *Engine
}

// NewWhole returns the whole-GPU claims over cfg.Driver and cfg.Store.
func NewWhole(cfg WholeConfig) (*Whole, error) {
	if cfg.Driver == nil || cfg.Store == nil {
		return nil, fmt.Errorf("passthrough claims: %w: no driver or store", gpu.ErrInvalid)
	}
	c := Config{Store: cfg.Store, OrphanGrace: cfg.OrphanGrace, Logger: cfg.Logger, Now: cfg.Now}.WithDefaults()
	w := &Whole{drv: cfg.Driver, st: cfg.Store, grace: c.OrphanGrace, ignore: cfg.IgnoreUninspectable, log: c.Logger, now: c.Now, quar: cfg.Quarantine,
		ledger: filepath.Join(cfg.Store.StateDir(), "passthrough-unclaimed.json"), scanFDs: proc.ScanFDs}
	w.eng = NewEngine(EngineConfig{Store: cfg.Store, Quarantine: cfg.Quarantine, IgnoreUninspectable: cfg.IgnoreUninspectable, Logger: c.Logger, Now: c.Now})
	w.eng.Register(w.LeaseDriver())
	return w, nil
}

// Driver is the passthrough driver the claims use.
func (w *Whole) Driver() *gpu.Passthrough { return w.drv }

// bindingOf is the binding a lease recorded.
func bindingOf(lease *vmflowv1.Lease) gpu.Binding {
	p := lease.GetGpuPassthrough()
	b := gpu.Binding{Group: p.GetIommuGroup()}
	for _, f := range p.GetFunctions() {
		b.Functions = append(b.Functions, gpu.BoundFunction{Addr: f.GetAddr(), Previous: f.GetPreviousDriver(), Display: f.GetDisplay()})
	}
	return b
}

// leaseOf is the lease recording binding b of a GPU of model.
func leaseOf(b gpu.Binding, model string) *vmflowv1.Lease {
	p := &vmflowv1.PassthroughLease{IommuGroup: b.Group, Model: model}
	for _, f := range b.Functions {
		p.Functions = append(p.Functions, &vmflowv1.PassthroughFunction{Addr: f.Addr, PreviousDriver: f.Previous, Display: f.Display})
	}
	return store.PassthroughLeaseOf(p)
}

// DevicePaths are the sysfs paths QEMU's vfio-pci devices open for a
// whole-GPU lease: one per function of the group.
func (w *Whole) DevicePaths(lease *vmflowv1.Lease) []string {
	var out []string
	for _, a := range store.PassthroughDevices(lease) {
		out = append(out, w.drv.DevicePath(a))
	}
	return out
}

// Claim gives instance id count whole GPUs of model ("" any offered), all
// or none, as Claims.Claim does vGPUs: held leases are finished first (a
// bind resumed from its recorded binding), then groups are placed; a
// failure that ends the claim (final) undoes its leases while the record
// never launched.
func (w *Whole) Claim(ctx context.Context, id, model string, count int) ([]*vmflowv1.Lease, error) {
	if count < 1 || count > store.MaxPassthrough {
		return nil, fmt.Errorf("claim %d whole GPUs for %s: %w: from 1 to %d", count, id, gpu.ErrInvalid, store.MaxPassthrough)
	}
	l, rec, err := lockToClaim(ctx, w.st, id, "whole GPU")
	if err != nil {
		return nil, err
	}
	defer l.Unlock()
	held := store.HeldPassthrough(rec)
	if len(held) > count {
		return nil, fmt.Errorf("claim %d whole GPUs for %s: %w (it holds %d)", count, id, ErrClaimConflict, len(held))
	}
	if slices.ContainsFunc(held, rollingBack) {
		if err := w.rollback(ctx, l); err != nil {
			return nil, fmt.Errorf("claim whole GPU for %s: finish an interrupted rollback: %w", id, err)
		}
		held = nil
	}
	var out []*vmflowv1.Lease
	for i := range count {
		var lease *vmflowv1.Lease
		if i < len(held) {
			lease, err = w.bind(ctx, l, held[i])
		} else {
			lease, err = w.place(ctx, l, model)
		}
		if err != nil {
			err = fmt.Errorf("claim whole GPU %d of %d for %s: %w", i+1, count, id, err)
			break
		}
		out = append(out, lease)
	}
	if err == nil {
		return out, nil
	}
	if !final(err) {
		return nil, err
	}
	if rerr := w.rollback(ctx, l); rerr != nil {
		return nil, errors.Join(err, fmt.Errorf("roll back the claim of %s: %w", id, rerr))
	}
	return nil, err
}

// place binds one new group holding a GPU of model: the first offered,
// viable, unmarked one no held lease names, in address order; a group
// another claim took meanwhile (Bind's Taken, under the host lock) is
// passed over for the next.
func (w *Whole) place(ctx context.Context, l *store.Locked, model string) (*vmflowv1.Lease, error) {
	gpus, err := w.drv.GPUs(ctx)
	if err != nil {
		return nil, err
	}
	taken, err := w.takenBy(l.ID(), "")(ctx)
	if err != nil {
		return nil, err
	}
	quarantined, err := w.quar.List()
	if err != nil {
		return nil, err
	}
	for _, g := range gpus {
		if !g.Offered || !g.Viable || g.Marked || (model != "" && g.ID() != model) {
			continue
		}
		if _, ok := quarantined[g.Addr]; ok {
			continue
		}
		if _, ok := taken[g.Group]; ok {
			continue
		}
		name := ""
		req := gpu.BindRequest{Group: g.Group, Taken: w.takenBy(l.ID(), ""), Intent: func(b gpu.Binding) error {
			lease := leaseOf(b, g.ID())
			name = store.LeaseName(lease)
			_, err := l.Apply(store.LeaseIntent(lease, w.now()))
			crashpoint.Hit(crashpoint.PassthroughIntentWritten)
			return err
		}}
		_, err := w.drv.Bind(ctx, req)
		if errors.Is(err, gpu.ErrClaimedByOther) || errors.Is(err, gpu.ErrAlreadyBound) {
			continue // another claim or user got there first: nothing written
		}
		if err != nil {
			return nil, err // the intent stays: the retry resumes the bind
		}
		return w.activate(l, name)
	}
	m := model
	if m == "" {
		m = "any model"
	}
	return nil, fmt.Errorf("%w of %s (offered by --gpu-passthrough %q)", ErrNoWholeGPU, m, w.drv.Filter().String())
}

// bind finishes a held lease: its group bound (resumed from the recorded
// binding, so each function keeps the driver it had) and the lease active.
// Before every launch too: a reboot returns every function to its driver.
func (w *Whole) bind(ctx context.Context, l *store.Locked, lease *vmflowv1.Lease) (*vmflowv1.Lease, error) {
	b := bindingOf(lease)
	name := store.LeaseName(lease)
	if _, err := w.drv.Bind(ctx, gpu.BindRequest{Group: b.Group, Resume: &b, Taken: w.takenBy(l.ID(), name)}); err != nil {
		return nil, err
	}
	if lease.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
		return lease, nil
	}
	return w.activate(l, name)
}

func (w *Whole) activate(l *store.Locked, name string) (*vmflowv1.Lease, error) {
	rec, err := l.Apply(store.PassthroughActive(name))
	if err != nil {
		return nil, fmt.Errorf("activate whole GPU of %s: %w", l.ID(), err)
	}
	crashpoint.Hit(crashpoint.PassthroughActivated)
	for _, lease := range store.HeldPassthrough(rec) {
		if store.LeaseName(lease) == name {
			w.log.Info("whole GPU claimed", zap.String("instance_id", l.ID()), zap.String("iommu_group", lease.GetGpuPassthrough().GetIommuGroup()),
				zap.Strings("device_ids", store.PassthroughDevices(lease)))
			return lease, nil
		}
	}
	return nil, fmt.Errorf("activate whole GPU of %s: lease %s: %w", l.ID(), name, store.ErrIllegalTransition)
}

// EnsureDevicesLocked makes the locked instance's whole GPUs launchable:
// every held lease active and its group on vfio-pci (bound again after a
// reboot, from the recorded binding). ErrClaimNotActive for a lease whose
// claim has not finished.
func (w *Whole) EnsureDevicesLocked(ctx context.Context, l *store.Locked) ([]*vmflowv1.Lease, error) {
	rec, err := l.Get()
	if err != nil {
		return nil, fmt.Errorf("ensure whole GPUs of %s: %w", l.ID(), err)
	}
	var out []*vmflowv1.Lease
	for _, lease := range store.HeldPassthrough(rec) {
		if lease.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			return nil, fmt.Errorf("whole GPU of %s (IOMMU group %s) is %s: %w", l.ID(), lease.GetGpuPassthrough().GetIommuGroup(), lease.GetPhase(), ErrClaimNotActive)
		}
		if _, err := w.bind(ctx, l, lease); err != nil {
			return nil, fmt.Errorf("instance %s: whole GPU of IOMMU group %s: %w: %w", l.ID(), lease.GetGpuPassthrough().GetIommuGroup(), ErrClaimDeviceMissing, err)
		}
		out = append(out, lease)
	}
	return out, nil
}

// takenBy maps what held whole-GPU leases name (IOMMU groups and PCI
// addresses) to the instance, leaving out self's lease named except, for
// BindRequest.Taken and placement.
func (w *Whole) takenBy(self, except string) func(context.Context) (map[string]string, error) {
	return func(context.Context) (map[string]string, error) {
		recs, err := w.st.List()
		bad, listed := store.Unreadable(err)
		if !listed {
			return nil, fmt.Errorf("passthrough: read claims: %w", err)
		}
		m := heldGroups(recs, self, except)
		if len(bad) > 0 {
			return m, fmt.Errorf("%w: %d record(s)", gpu.ErrRecordsUnreadable, len(bad))
		}
		return m, nil
	}
}

// heldGroups is the ledger of invariant 10 for whole GPUs: every group and
// function a held lease names, mapped to its instance, except self's lease
// named except.
func heldGroups(recs []*vmflowv1.InstanceRecord, self, except string) map[string]string {
	m := map[string]string{}
	for _, r := range recs {
		for _, lease := range store.HeldPassthrough(r) {
			if r.GetId() == self && store.LeaseName(lease) == except {
				continue
			}
			m[lease.GetGpuPassthrough().GetIommuGroup()] = r.GetId()
			for _, a := range store.PassthroughDevices(lease) {
				m[a] = r.GetId()
			}
		}
	}
	return m
}

// ownGroup refuses (ErrClaimedByOther) when another instance's held lease
// names lease's group: it is not this instance's to return.
func (w *Whole) ownGroup(ctx context.Context, id string, lease *vmflowv1.Lease) error {
	err := gpu.NotClaimedByOther(ctx, w.takenBy(id, store.LeaseName(lease)), lease.GetGpuPassthrough().GetIommuGroup())
	if errors.Is(err, gpu.ErrClaimedByOther) {
		return fmt.Errorf("instance %s: %w", id, err)
	}
	return err
}

// Release returns every whole GPU instance id holds, through the engine
// (Engine.Release, with wholeDriver): each only when the VM may not live
// and nothing holds its group's VFIO node (invariant 2); a failed unbind,
// reset or rebind keeps that lease and moves the record to ReleaseFailed;
// the others are released. devices names the functions returned now.
func (w *Whole) Release(ctx context.Context, id string) (released bool, devices []string, err error) {
	out, err := w.eng.Release(ctx, id, store.KindPassthrough)
	for _, l := range out.Released {
		devices = append(devices, store.PassthroughDevices(l)...)
	}
	return out.All, devices, err
}

// wholeGPUs are the GPUs (display functions) of a whole-GPU lease: what
// its failures count against.
func wholeGPUs(lease *vmflowv1.Lease) []string {
	var gpus []string
	for _, f := range lease.GetGpuPassthrough().GetFunctions() {
		if f.GetDisplay() {
			gpus = append(gpus, f.GetAddr())
		}
	}
	return gpus
}

// rollback undoes the held whole-GPU leases of a failed claim while the
// record never launched, as Claims.rollback does vGPUs'.
func (w *Whole) rollback(ctx context.Context, l *store.Locked) error {
	rec, err := l.Get()
	if err != nil {
		return err
	}
	if !store.NeverLaunched(rec) {
		return nil
	}
	var errs []error
	for _, lease := range store.HeldPassthrough(rec) {
		name := store.LeaseName(lease)
		err := w.ownGroup(ctx, l.ID(), lease)
		if err == nil {
			err = nodeFree(ctx, w.drv.VFIONode(lease.GetGpuPassthrough().GetIommuGroup()), proc.Holders, w.ignore)
		}
		if err == nil {
			_, err = l.Apply(store.LeaseRollingBack(name))
		}
		if err == nil {
			crashpoint.Hit(crashpoint.ClaimRollingBack)
			err = w.drv.Return(ctx, bindingOf(lease))
		}
		if err == nil {
			_, err = l.Apply(store.LeaseRolledBack(name))
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("whole GPU of IOMMU group %s: %w", lease.GetGpuPassthrough().GetIommuGroup(), err))
			continue
		}
		crashpoint.Hit(crashpoint.ClaimRolledBack)
		w.log.Info("whole GPU claim rolled back", zap.String("instance_id", l.ID()), zap.String("iommu_group", lease.GetGpuPassthrough().GetIommuGroup()))
	}
	return errors.Join(errs...)
}

// Reconcile runs one round, as Claims.Reconcile does for vGPUs: the whole
// GPUs of instances being deleted whose VM is gone are released; a group
// vmflow marked (driver_override=vfio-pci) that no held lease names, past
// the grace (measured from this agent's first sighting, persisted) and
// held by nobody, is returned to its drivers. A group vmflow never bound
// carries no mark and is never touched.
func (w *Whole) Reconcile(ctx context.Context) (*vmflowv1.ReconcileVGPUResult, error) {
	res := &vmflowv1.ReconcileVGPUResult{}
	recs, listErr := w.st.List()
	bad, listed := store.Unreadable(listErr)
	if !listed {
		return res, fmt.Errorf("reconcile whole GPUs: list records: %w", listErr)
	}
	res.UnreadableRecords = uint32(len(bad))
	for _, r := range recs {
		if len(store.HeldPassthrough(r)) == 0 {
			continue
		}
		if !store.IsDeleting(r) {
			res.Skipped++
			continue
		}
		released, devs, err := w.Release(ctx, r.GetId())
		switch {
		case err != nil:
			res.Failed++
			w.log.Info("reconcile: whole GPU not released", zap.String("instance_id", r.GetId()), zap.Strings("device_ids", devs), zap.Error(err))
		case released:
			res.ClaimsReleased++
			res.RetriedDeletes = append(res.RetriedDeletes, r.GetId())
		}
	}
	if listErr != nil {
		return res, nil // an unreadable record may name any group
	}
	marked, err := w.drv.MarkedGroups(ctx)
	if err != nil {
		return res, fmt.Errorf("reconcile whole GPUs: %w", err)
	}
	seen, err := loadLedger(w.ledger, w.log)
	if err != nil {
		return res, err
	}
	claimed := heldGroups(recs, "", "")
	now := w.now()
	next := map[string]time.Time{}
	for _, b := range marked {
		if _, ok := claimed[b.Group]; ok {
			continue
		}
		first := w.seen.since(seen, b.Group, now)
		if now.Sub(first) < w.grace {
			next[b.Group] = first
			res.Skipped++
			continue
		}
		if err := nodeFree(ctx, w.drv.VFIONode(b.Group), proc.Holders, w.ignore); err != nil {
			next[b.Group] = first
			res.Skipped++
			continue
		}
		if err := w.drv.Return(ctx, b); err != nil {
			next[b.Group] = first
			res.Failed++
			w.log.Warn("reconcile: returning an unclaimed group failed", zap.String("iommu_group", b.Group), zap.Error(err))
			continue
		}
		res.OrphansRemoved++
		w.log.Info("reconcile: unclaimed group returned to its drivers", zap.String("iommu_group", b.Group),
			zap.String("functions", strings.Join(b.Addrs(), " ")), zap.Duration("unclaimed_for", now.Sub(first)))
	}
	w.seen.set(next) // as Claims.Reconcile: a returned group starts its grace again
	return res, saveLedger(w.ledger, next)
}
