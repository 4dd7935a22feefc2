package lease

import (
	"cmp"
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

// ErrNoWholeGPU: no set of offered, unclaimed IOMMU groups gives exactly
// the GPUs of the model asked for (a group is taken whole, so a 2-GPU
// group never serves a request for 1). Retryable: a delete may free one.
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
	// Scrub, if set, is --gpu-scrub: an executable run between tenants,
	// once a released GPU is back on its host driver, with the group's
	// PCI addresses as its arguments (no shell). Its failure quarantines
	// the GPU at once.
	Scrub string
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
	scrub  string
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
	w := &Whole{drv: cfg.Driver, st: cfg.Store, grace: c.OrphanGrace, ignore: cfg.IgnoreUninspectable, log: c.Logger, now: c.Now, quar: cfg.Quarantine, scrub: cfg.Scrub,
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
		b.Functions = append(b.Functions, gpu.BoundFunction{Addr: f.GetAddr(), Previous: f.GetPreviousDriver(), Display: f.GetDisplay(),
			ID: f.GetId(), Serial: f.GetSerial()})
	}
	return b
}

// leaseOf is the lease recording binding b of a GPU of model.
func leaseOf(b gpu.Binding, model string) *vmflowv1.Lease {
	p := &vmflowv1.PassthroughLease{IommuGroup: b.Group, Model: model}
	for _, f := range b.Functions {
		p.Functions = append(p.Functions, &vmflowv1.PassthroughFunction{Addr: f.Addr, PreviousDriver: f.Previous, Display: f.Display,
			Id: f.ID, Serial: f.Serial})
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
// bind resumed from its recorded binding), then groups are placed until
// the instance holds count GPUs (a group of two GPUs gives two); a
// failure that ends the claim (final) undoes its leases while the record
// never launched. A GPU whose bind fails is struck (quarantined at the
// threshold), its lease rolled back, and the claim moves on to the next
// free GPU: one bad card does not stop whole-GPU spawns on its host.
func (w *Whole) Claim(ctx context.Context, id, model string, count int) ([]*vmflowv1.Lease, error) {
	if count < 1 || count > store.MaxPassthrough {
		return nil, fmt.Errorf("claim %d whole GPUs for %s: %w: from 1 to %d", count, id, gpu.ErrInvalid, store.MaxPassthrough)
	}
	l, rec, err := lockToClaim(ctx, w.st, id, "whole GPU")
	if err != nil {
		return nil, err
	}
	defer l.Unlock()
	failed := map[string]bool{} // addresses whose bind failed in this claim
	return ClaimAll(ctx, id, count, ClaimSteps{
		What: "whole GPU",
		Held: store.HeldPassthrough(rec),
		Finish: func(ctx context.Context, lease *vmflowv1.Lease) (*vmflowv1.Lease, error) {
			return w.finish(ctx, l, lease, failed)
		},
		Place: func(ctx context.Context, need int) (*vmflowv1.Lease, error) {
			return w.place(ctx, l, model, need, failed)
		},
		Rollback: func(ctx context.Context) error { return w.rollback(ctx, l) },
		Units:    func(lease *vmflowv1.Lease) int { return len(store.PassthroughGPUs(lease)) },
	})
}

// undoBind reports whether a bind's error undoes its lease and places
// elsewhere: the card failed (deviceFault) or is gone from its address.
func undoBind(err error) bool { return deviceFault(err) || errors.Is(err, gpu.ErrCardGone) }

// finish binds a held lease of a claim under way; one an earlier attempt
// began whose bind now fails on its card is undone as a fresh one is
// (bindFailed) and (nil, nil) returned, for the claim to place anew.
func (w *Whole) finish(ctx context.Context, l *store.Locked, lease *vmflowv1.Lease, failed map[string]bool) (*vmflowv1.Lease, error) {
	got, err := w.bind(ctx, l, lease)
	if err != nil && lease.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT && undoBind(err) {
		return nil, w.bindFailed(ctx, l, lease, err, failed)
	}
	return got, err
}

// freeGroup is an IOMMU group placement may take whole: its GPUs, and
// the NUMA node its first GPU reports (topology.NoNode: not said).
type freeGroup struct {
	group string
	gpus  []string
	node  int
}

// freeGroups lists, in address order, the groups every GPU of which is
// offered, viable, unmarked, of model, not quarantined, not named by a
// held lease and not failed in this claim.
func (w *Whole) freeGroups(ctx context.Context, l *store.Locked, model string, failed map[string]bool) ([]freeGroup, map[string]int, error) {
	gpus, err := w.drv.GPUs(ctx)
	if err != nil {
		return nil, nil, err
	}
	taken, err := w.takenBy(l.ID(), "")(ctx)
	if err != nil {
		return nil, nil, err
	}
	quarantined, err := w.quar.List()
	if err != nil {
		return nil, nil, err
	}
	nodes := map[string]int{}
	var order []string
	groups, bad := map[string]*freeGroup{}, map[string]bool{}
	for _, g := range gpus {
		if g.Group == "" {
			continue
		}
		nodes[g.Addr] = g.NUMANode
		if _, ok := groups[g.Group]; !ok {
			groups[g.Group] = &freeGroup{group: g.Group, node: g.NUMANode}
			order = append(order, g.Group)
		}
		_, q := quarantined[g.Addr]
		_, t := taken[g.Addr]
		if !g.Offered || !g.Viable || g.Marked || (model != "" && g.ID() != model) || q || t || failed[g.Addr] {
			bad[g.Group] = true
		}
		groups[g.Group].gpus = append(groups[g.Group].gpus, g.Addr)
	}
	var out []freeGroup
	for _, g := range order {
		if !bad[g] {
			out = append(out, *groups[g])
		}
	}
	return out, nodes, nil
}

// fitOnOneNode picks groups giving need more GPUs from one NUMA node, so a
// VM's GPUs, CPUs and memory can share one (the capacity ledger places
// its CPUs on its GPUs' node): the node of the GPUs the claim already
// holds, else the node with the fewest free GPUs that has enough (packing
// leaves whole nodes to larger claims). nil when no node has them.
func fitOnOneNode(groups []freeGroup, need int, heldNodes []int) []freeGroup {
	// GPUs whose node the platform did not say (numa_node -1, as on a
	// single-socket host without firmware NUMA tables) are one node of
	// their own here: on a host of several nodes the capacity ledger
	// then finds them on none, and a strict VM is refused there.
	on := func(n int) []freeGroup {
		var out []freeGroup
		for _, g := range groups {
			if g.node == n {
				out = append(out, g)
			}
		}
		return out
	}
	slices.Sort(heldNodes)
	heldNodes = slices.Compact(heldNodes)
	switch len(heldNodes) {
	case 0:
	case 1:
		return fit(on(heldNodes[0]), need)
	default:
		return nil // already spread
	}
	free := map[int]int{}
	var nodes []int
	for _, g := range groups {
		if free[g.node] == 0 {
			nodes = append(nodes, g.node)
		}
		free[g.node] += len(g.gpus)
	}
	slices.SortStableFunc(nodes, func(a, b int) int { return cmp.Or(cmp.Compare(free[a], free[b]), cmp.Compare(a, b)) })
	for _, n := range nodes {
		if pick := fit(on(n), need); pick != nil {
			return pick
		}
	}
	return nil
}

// fit picks, in address order, groups that give exactly need GPUs: two
// GPUs in one group are two, and a claim never takes more GPUs than it
// asked for. nil when none do.
func fit(groups []freeGroup, need int) []freeGroup {
	memo := map[[2]int]bool{}
	var can func(i, n int) bool // groups[i:] can give exactly n
	can = func(i, n int) bool {
		if n == 0 {
			return true
		}
		if n < 0 || i == len(groups) {
			return false
		}
		k := [2]int{i, n}
		if v, ok := memo[k]; ok {
			return v
		}
		v := can(i+1, n-len(groups[i].gpus)) || can(i+1, n)
		memo[k] = v
		return v
	}
	if !can(0, need) {
		return nil
	}
	var out []freeGroup
	for i, n := 0, need; n > 0; i++ {
		if k := len(groups[i].gpus); k <= n && can(i+1, n-k) {
			out = append(out, groups[i])
			n -= k
		}
	}
	return out
}

// place binds one new group toward need more GPUs: the first of the
// groups fit picks. A group another claim took meanwhile (Bind's Taken,
// under the host lock) is passed over for the next; a bind that fails on
// its card is struck and undone (bindFailed) and (nil, nil) returned, for
// the claim to place again.
func (w *Whole) place(ctx context.Context, l *store.Locked, model string, need int, failed map[string]bool) (*vmflowv1.Lease, error) {
	rec, err := l.Get()
	if err != nil {
		return nil, err
	}
	strict := rec.GetSpec().GetNuma() == "strict"
	for {
		groups, nodeOf, err := w.freeGroups(ctx, l, model, failed)
		if err != nil {
			return nil, err
		}
		var heldNodes []int
		for _, h := range store.HeldPassthrough(rec) {
			for _, a := range store.PassthroughGPUs(h) {
				if n, ok := nodeOf[a]; ok { // a GPU no longer listed says nothing
					heldNodes = append(heldNodes, n)
				}
			}
		}
		pick := fitOnOneNode(groups, need, heldNodes)
		if pick == nil && strict {
			return nil, fmt.Errorf("%w: %d more GPUs on the NUMA node of the claim's (numa \"strict\"): no node has them", ErrNoWholeGPU, need)
		}
		if pick == nil {
			pick = fit(groups, need)
		}
		if pick == nil {
			m := model
			if m == "" {
				m = "any model"
			}
			return nil, fmt.Errorf("%w: %d more of %s (offered by --gpu-passthrough %q)", ErrNoWholeGPU, need, m, w.drv.Filter().String())
		}
		g := pick[0]
		var intent *vmflowv1.Lease
		req := gpu.BindRequest{Group: g.group, Taken: w.takenBy(l.ID(), ""), Intent: func(b gpu.Binding) error {
			lease := leaseOf(b, modelOf(b))
			_, err := l.Apply(store.LeaseIntent(lease, w.now()))
			crashpoint.Hit(crashpoint.PassthroughIntentWritten)
			if err == nil {
				intent = lease
			}
			return err
		}}
		_, err = w.drv.Bind(ctx, req)
		switch {
		case err == nil:
			succeeded(ctx, w.quar, w.log, g.gpus...)
			return w.activate(l, store.LeaseName(intent))
		case intent == nil && passOver(err):
			// Nothing written: another claim or user got there first, or
			// the group changed since the listing.
			for _, a := range g.gpus {
				failed[a] = true
			}
			w.log.Info("whole GPU passed over", zap.String("instance_id", l.ID()), zap.String("iommu_group", g.group), zap.Error(err))
			continue
		case intent == nil:
			return nil, err
		case undoBind(err):
			if err := w.bindFailed(ctx, l, intent, err, failed); err != nil {
				return nil, err
			}
			return nil, nil
		default:
			return nil, err // a write still in flight: the intent stays and the retry resumes the bind
		}
	}
}

// passOver reports a bind refused before its intent because the group is
// not to be had now (taken, bound by someone else, changed or gone since
// the listing): placement tries the next.
func passOver(err error) bool {
	if errors.Is(err, gpu.ErrClaimedByOther) || errors.Is(err, gpu.ErrAlreadyBound) {
		return true
	}
	c := errdefs.ClassOf(err)
	return c == errdefs.Refused || c == errdefs.NotFound
}

// modelOf is the vendor:device of b's first GPU.
func modelOf(b gpu.Binding) string {
	for _, f := range b.Functions {
		if f.Display {
			return f.ID
		}
	}
	return ""
}

// bindFailed handles a bind that failed on lease's card (cause): the
// card is struck (strikeIfFault: quarantined at the threshold), what the
// bind wrote is returned and the lease rolled back, and its GPUs are left
// out of the rest of the claim. An error: the rollback did not finish (the
// lease stays, rolling back, for the claim's retry to finish).
func (w *Whole) bindFailed(ctx context.Context, l *store.Locked, lease *vmflowv1.Lease, cause error, failed map[string]bool) error {
	gpus := store.PassthroughGPUs(lease)
	// A card no longer at its address (gpu.ErrCardGone, NotFound) did not
	// fail: deviceFault leaves it out, so the card there now inherits no
	// strike.
	strikeIfFault(ctx, w.quar, w.log, l.ID(), cause, gpus, leaseCards(lease))
	for _, a := range store.PassthroughDevices(lease) {
		failed[a] = true
	}
	w.log.Warn("whole GPU bind failed: trying another", zap.String("instance_id", l.ID()), zap.Strings("device_ids", gpus), zap.Error(cause))
	if err := w.eng.rollbackOne(ctx, l, w.LeaseDriver(), lease); err != nil {
		return fmt.Errorf("whole GPU %s: bind failed (%w), and undoing it too: %w", strings.Join(gpus, " "), cause, err)
	}
	return nil
}

// leaseCards are the cards of lease's GPUs (store.PassthroughGPUs, in
// that order) as it recorded them: vendor:device and serial number; ""
// for a function recorded before identities.
func leaseCards(lease *vmflowv1.Lease) []string {
	var out []string
	for _, f := range lease.GetGpuPassthrough().GetFunctions() {
		if !f.GetDisplay() {
			continue
		}
		card := ""
		if f.GetId() != "" {
			card = f.GetId() + " " + f.GetSerial()
		}
		out = append(out, card)
	}
	return out
}

// bind finishes a held lease: its group bound (resumed from the recorded
// binding, so each function keeps the driver it had) and the lease active.
// Before every launch too: a reboot returns every function to its driver.
// A card no longer at its address is gpu.ErrCardGone: the card there now
// is never bound for this lease.
func (w *Whole) bind(ctx context.Context, l *store.Locked, lease *vmflowv1.Lease) (*vmflowv1.Lease, error) {
	b := bindingOf(lease)
	name := store.LeaseName(lease)
	if _, err := w.drv.Bind(ctx, gpu.BindRequest{Resume: &b, Taken: w.takenBy(l.ID(), name)}); err != nil {
		return nil, err
	}
	if lease.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
		return lease, nil
	}
	succeeded(ctx, w.quar, w.log, store.PassthroughGPUs(lease)...)
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
// claim has not finished; ErrClaimDeviceMissing for one whose card is no
// longer at its address (gone, or another card there: never bound for
// this lease).
func (w *Whole) EnsureDevicesLocked(ctx context.Context, l *store.Locked) ([]*vmflowv1.Lease, error) {
	rec, err := l.Get()
	if err != nil {
		return nil, fmt.Errorf("ensure whole GPUs of %s: %w", l.ID(), err)
	}
	var out []*vmflowv1.Lease
	for _, lease := range store.HeldPassthrough(rec) {
		devs := strings.Join(store.PassthroughDevices(lease), " ")
		if lease.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			return nil, fmt.Errorf("whole GPU of %s (%s) is %s: %w", l.ID(), devs, lease.GetPhase(), ErrClaimNotActive)
		}
		if _, err := w.bind(ctx, l, lease); err != nil {
			return nil, fmt.Errorf("instance %s: whole GPU %s: %w: %w", l.ID(), devs, ErrClaimDeviceMissing, err)
		}
		out = append(out, lease)
	}
	return out, nil
}

// takenBy maps the PCI functions held whole-GPU leases name to the
// instance, leaving out self's lease named except, for BindRequest.Taken
// and placement.
func (w *Whole) takenBy(self, except string) func(context.Context) (map[string]string, error) {
	return func(context.Context) (map[string]string, error) {
		recs, err := w.st.Records() // read only
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

// heldGroups is the ledger of invariant 10 for whole GPUs: every PCI
// function a held lease names, mapped to its instance, except self's
// lease named except. Functions, not group numbers: a reboot may give a
// lease's group number to another card, while a lease holds every
// endpoint of its group.
func heldGroups(recs []*vmflowv1.InstanceRecord, self, except string) map[string]string {
	m := map[string]string{}
	for _, r := range recs {
		for _, lease := range store.HeldPassthrough(r) {
			if r.GetId() == self && store.LeaseName(lease) == except {
				continue
			}
			for _, a := range store.PassthroughDevices(lease) {
				m[a] = r.GetId()
			}
		}
	}
	return m
}

// claimedGroups maps each marked group any function of which a held
// lease names (claimed, from heldGroups) to that lease's instance: what
// reconcile leaves alone.
func claimedGroups(marked []gpu.Binding, claimed map[string]string) map[string]string {
	m := map[string]string{}
	for _, b := range marked {
		for _, a := range b.Addrs() {
			if inst, ok := claimed[a]; ok {
				m[b.Group] = inst
			}
		}
	}
	return m
}

// ownGroup refuses (ErrClaimedByOther) when another instance's held lease
// names a function of lease's: it is not this instance's to return.
func (w *Whole) ownGroup(ctx context.Context, id string, lease *vmflowv1.Lease) error {
	for _, a := range store.PassthroughDevices(lease) {
		err := gpu.NotClaimedByOther(ctx, w.takenBy(id, store.LeaseName(lease)), a)
		if errors.Is(err, gpu.ErrClaimedByOther) {
			return fmt.Errorf("instance %s: %w", id, err)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// Release returns every whole GPU instance id holds, through the engine
// (Engine.Release, with wholeDriver): each only when the VM may not live
// and nothing holds its group's VFIO node (invariant 2); a failed unbind,
// reset or rebind keeps that lease and moves the record to ReleaseFailed;
// the others are released. A card no longer at its address counts as
// released. devices names the functions returned now.
func (w *Whole) Release(ctx context.Context, id string) (released bool, devices []string, err error) {
	out, err := w.eng.Release(ctx, id, store.KindPassthrough)
	for _, l := range out.Released {
		devices = append(devices, store.PassthroughDevices(l)...)
	}
	return out.All, devices, err
}

// nodeOf is the VFIO node of lease's group, read live ("" when its card
// is gone: nothing can hold it).
func (w *Whole) nodeOf(lease *vmflowv1.Lease) (string, error) {
	node, err := w.drv.NodeOf(bindingOf(lease))
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrDeviceHeld, err)
	}
	return node, nil
}

// rollback undoes the held whole-GPU leases of a failed claim while the
// record never launched, as Claims.rollback does vGPUs'.
func (w *Whole) rollback(ctx context.Context, l *store.Locked) error {
	return w.eng.Rollback(ctx, l, store.KindPassthrough)
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
	releaseRound(ctx, w.log, recs, store.KindPassthrough, w.Release, res)
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
	claimed := claimedGroups(marked, heldGroups(recs, "", ""))
	var orphans []orphan
	for _, b := range marked {
		if _, ok := claimed[b.Group]; ok {
			continue
		}
		orphans = append(orphans, orphan{id: b.Group,
			free: func(ctx context.Context) error { return nodeFree(ctx, w.drv.VFIONode(b.Group), proc.Holders, w.ignore) },
			remove: func(ctx context.Context) error {
				return w.drv.Return(ctx, b, w.quarantineOnReset(ctx, "", b.GPUs(), nil)...)
			},
			log: []zap.Field{zap.String("iommu_group", b.Group), zap.String("functions", strings.Join(b.Addrs(), " "))}})
	}
	next := sweepOrphans(ctx, w.log, &w.seen, seen, w.now(), w.grace, orphans, res)
	return res, saveLedger(w.ledger, next)
}
