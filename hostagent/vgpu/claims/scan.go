package claims

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
)

// Work is what a reconcile round would act on, found by Scan without
// changing anything. Each item is a stable key ("release:<instance>",
// "wake:<instance>", "orphan:<device>"), so two scans can be compared.
type Work struct {
	// Items are sorted.
	Items []string
	// UnreadableRecords: records Scan could not read (orphans are then
	// not looked for, as Reconcile does).
	UnreadableRecords int
}

// Any says whether a reconcile round has something to do.
func (w Work) Any() bool { return len(w.Items) > 0 }

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
	var w Work
	holders := sharedHolders(c.scanFDs)
	recs, listErr := c.st.List()
	bad, listed := store.Unreadable(listErr)
	if !listed {
		return w, fmt.Errorf("scan: list records: %w", listErr)
	}
	w.UnreadableRecords = len(bad)
	for _, r := range recs {
		switch roundFor(r) {
		case roundWake:
			w.Items = append(w.Items, "wake:"+r.GetId())
		case roundRelease:
			if c.mayRelease(ctx, r, deviceOf(store.VGPU(r), c.drv.Kind()), holders) == nil {
				w.Items = append(w.Items, "release:"+r.GetId())
			}
		}
	}
	if listErr == nil {
		orphans, err := c.scanOrphans(ctx, heldDevices(recs, "", c.drv.Kind()), holders)
		if err != nil {
			return w, err
		}
		w.Items = append(w.Items, orphans...)
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
	now := c.now()
	c.seen.mu.Lock()
	defer c.seen.mu.Unlock()
	next := map[string]time.Time{}
	var out []string
	for _, d := range devs {
		if _, ok := claimed[d.ID]; ok {
			continue
		}
		first, ok := c.seen.first[d.ID]
		if !ok {
			first = now
		}
		if l, ok := ledger[d.ID]; ok && l.Before(first) {
			first = l
		}
		next[d.ID] = first
		if now.Sub(first) < c.grace {
			continue
		}
		if c.deviceFree(ctx, d, holders) != nil {
			continue
		}
		out = append(out, "orphan:"+d.ID)
	}
	c.seen.first = next
	return out, nil
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
