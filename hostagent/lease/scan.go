package lease

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Work is what a reconcile round would act on, found by Scan without
// changing anything. Each item is a stable key ("release:<instance>",
// "wake:<instance>", "orphan:<device>", "orphan-group:<iommu group>"), so
// two scans can be compared.
type Work struct {
	// Items are sorted.
	Items []string
	// UnreadableRecords: records Scan could not read (orphans are then
	// not looked for, as Reconcile does).
	UnreadableRecords int
}

// Any says whether a reconcile round has something to do.
func (w Work) Any() bool { return len(w.Items) > 0 }

// ScanAll is one scan of every scan given (vGPUs, whole GPUs): their items
// merged, sorted and without repeats; the first error ends it.
func ScanAll(scans ...func(context.Context) (Work, error)) func(context.Context) (Work, error) {
	return func(ctx context.Context) (Work, error) {
		var all Work
		for _, scan := range scans {
			w, err := scan(ctx)
			if err != nil {
				return all, err
			}
			all.Items = append(all.Items, w.Items...)
			all.UnreadableRecords = max(all.UnreadableRecords, w.UnreadableRecords)
		}
		slices.Sort(all.Items)
		all.Items = slices.Compact(all.Items)
		return all, nil
	}
}

// scanSeen remembers when Scan first saw each unclaimed device, for the
// devices the reconcile ledger does not know yet (the ledger is written
// only by Reconcile, which now runs only when there is work).
type scanSeen struct {
	mu    sync.Mutex
	first map[string]time.Time
}

// Scan says, reading only, what a Reconcile round would do (release, wake,
// orphan), with no lock and no Temporal call, so it is free to run every
// minute. A delete in progress shows for a moment: act on what two scans saw (Due).
func (c *Claims) Scan(ctx context.Context) (Work, error) {
	return scanRecords(ctx, c.st, c.scanFDs, func(r *vmflowv1.InstanceRecord, holders holdersFunc) string {
		return scanItem(ctx, c.eng, c.LeaseDriver(), r, holders)
	}, func(recs []*vmflowv1.InstanceRecord, holders holdersFunc) ([]string, error) {
		return c.scanOrphans(ctx, heldDevices(recs, "", "", c.drv.Kind()), holders)
	})
}

// scanRecords is both scans' shape: the records listed once and each asked
// for its item ("" for none), then, only when every record was read (an
// unreadable one may name any device), the orphans; one /proc walk shared.
func scanRecords(ctx context.Context, st *store.Store, scanFDs func(context.Context) (*proc.FDScan, error),
	item func(*vmflowv1.InstanceRecord, holdersFunc) string, orphans func([]*vmflowv1.InstanceRecord, holdersFunc) ([]string, error)) (Work, error) {
	var w Work
	holders := sharedHolders(scanFDs)
	recs, listErr := st.List()
	bad, listed := store.Unreadable(listErr)
	if !listed {
		return w, fmt.Errorf("scan: list records: %w", listErr)
	}
	w.UnreadableRecords = len(bad)
	for _, r := range recs {
		if it := item(r, holders); it != "" {
			w.Items = append(w.Items, it)
		}
	}
	if listErr == nil {
		more, err := orphans(recs, holders)
		if err != nil {
			return w, err
		}
		w.Items = append(w.Items, more...)
	}
	slices.Sort(w.Items)
	return w, nil
}

func (c *Claims) scanOrphans(ctx context.Context, claimed map[string]string, holders holdersFunc) ([]string, error) {
	devs, err := c.drv.Devices(ctx)
	if err != nil {
		return nil, fmt.Errorf("scan: list devices: %w", err)
	}
	ledger, err := c.loadLedger()
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(devs))
	for i, d := range devs {
		ids[i] = d.ID
	}
	return c.seen.pastGrace(orphanDevice, ids, claimed, ledger, c.now(), c.grace, func(i int) bool {
		return c.deviceFree(ctx, devs[i], holders) == nil
	}), nil
}

// since is when id was first seen unclaimed: the earlier of this process's
// first sighting by a scan and the reconcile ledger's, now when neither saw it.
func (s *scanSeen) since(ledger map[string]time.Time, id string, now time.Time) time.Time {
	s.mu.Lock()
	first, ok := s.first[id]
	s.mu.Unlock()
	if !ok {
		first = now
	}
	if l, ok := ledger[id]; ok && l.Before(first) {
		first = l
	}
	return first
}

// set replaces the sightings with next: what the latest scan saw unclaimed.
func (s *scanSeen) set(next map[string]time.Time) {
	s.mu.Lock()
	s.first = next
	s.mu.Unlock()
}

// Scan says, reading only, what a Reconcile round would do with whole
// GPUs: release the groups of a record being deleted whose VM is gone and
// whose nodes nobody holds, return a marked group no lease names once past
// the grace. As Claims.Scan: no lock, no write, no Temporal call.
func (w *Whole) Scan(ctx context.Context) (Work, error) {
	return scanRecords(ctx, w.st, w.scanFDs, func(r *vmflowv1.InstanceRecord, holders holdersFunc) string {
		return scanItem(ctx, w.eng, w.LeaseDriver(), r, holders)
	}, func(recs []*vmflowv1.InstanceRecord, holders holdersFunc) ([]string, error) {
		return w.scanOrphans(ctx, heldGroups(recs, "", ""), holders)
	})
}

func (w *Whole) scanOrphans(ctx context.Context, claimed map[string]string, holders holdersFunc) ([]string, error) {
	marked, err := w.drv.MarkedGroups(ctx)
	if err != nil {
		return nil, fmt.Errorf("scan whole GPUs: %w", err)
	}
	ledger, err := loadLedger(w.ledger, w.log)
	if err != nil {
		return nil, err
	}
	claimed = claimedGroups(marked, claimed) // held leases name functions, not group numbers
	ids := make([]string, len(marked))
	for i, b := range marked {
		ids[i] = b.Group
	}
	return w.seen.pastGrace(orphanGroup, ids, claimed, ledger, w.now(), w.grace, func(i int) bool {
		return nodeFree(ctx, w.drv.VFIONode(ids[i]), holders, w.ignore) == nil
	}), nil
}

// pastGrace is prefix+id for each of ids no claim names, unclaimed for the
// grace (since its first sighting: a scan's or the ledger's) and free; the
// sightings become the ids this scan saw unclaimed.
func (s *scanSeen) pastGrace(prefix string, ids []string, claimed map[string]string, ledger map[string]time.Time,
	now time.Time, grace time.Duration, free func(i int) bool) []string {
	next := map[string]time.Time{}
	var out []string
	for i, id := range ids {
		if _, ok := claimed[id]; ok {
			continue
		}
		first := s.since(ledger, id, now)
		next[id] = first
		if now.Sub(first) >= grace && free(i) {
			out = append(out, prefix+id)
		}
	}
	s.set(next)
	return out
}

// sharedHolders answers one scan's items from one /proc walk, taken at the
// first ask; fine for a read-only scan, as a release asks afresh.
func sharedHolders(scanFDs func(context.Context) (*proc.FDScan, error)) holdersFunc {
	var scan *proc.FDScan
	return func(ctx context.Context, path string) ([]proc.Holder, error) {
		if scan == nil {
			s, err := scanFDs(ctx)
			if err != nil {
				return nil, err
			}
			scan = s
		}
		return scan.Holders(path)
	}
}

// Orphan item prefixes: a device of the vGPU driver, a vfio-pci group
// (whole GPUs) that no held lease names, past the grace.
const (
	orphanDevice = "orphan:"
	orphanGroup  = "orphan-group:"
)

// NewOrphans counts by lease kind (store.KindVGPU, store.KindPassthrough)
// the orphans cur found that prev did not: each orphan once, at the first
// scan that sees it past its grace.
func NewOrphans(prev, cur Work) map[string]int {
	out := map[string]int{}
	for _, it := range cur.Items {
		if _, found := slices.BinarySearch(prev.Items, it); found {
			continue
		}
		switch {
		case strings.HasPrefix(it, orphanGroup):
			out[store.KindPassthrough]++
		case strings.HasPrefix(it, orphanDevice):
			out[store.KindVGPU]++
		}
	}
	return out
}

// Due returns the items of cur that prev had too: work that outlived one
// scan interval, which a delete in progress does not.
func Due(prev, cur Work) []string {
	var out []string
	for _, it := range cur.Items {
		if _, found := slices.BinarySearch(prev.Items, it); found {
			out = append(out, it)
		}
	}
	return out
}

// Gate spaces out reconcile triggers for the same work: a claim whose
// release keeps failing would otherwise start a reconcile on every scan.
// The first trigger for new work is immediate; the same work again waits
// Min, then twice as long each time, up to Max.
type Gate struct {
	Min, Max time.Duration

	key  string
	at   time.Time
	wait time.Duration
}

// Should says whether to trigger a reconcile for due at now, and if so
// records the trigger.
func (g *Gate) Should(now time.Time, due []string) bool {
	if len(due) == 0 {
		g.key = ""
		return false
	}
	key := fmt.Sprint(due)
	if key != g.key {
		g.key, g.at, g.wait = key, now, g.Min
		return true
	}
	if now.Sub(g.at) < g.wait {
		return false
	}
	g.at = now
	g.wait = min(g.wait*2, max(g.Max, g.Min))
	return true
}
