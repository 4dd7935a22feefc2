package network

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"vmflow/hostagent/store"
)

// ReconcileTAPs rebuilds the anti-spoofing filter from the records
// (RebuildGuard), then removes the TAPs (named with TAPPrefix) that no
// record's held lease names once they have been seen unleased for the
// orphan grace. The agent writes a lease before it makes its TAP, so these
// are TAPs of a record removed by hand, or made by a hand. The TAPs are
// listed before the records, so a launch that leases and makes one in
// between is seen leased. Nothing
// is removed while a record cannot be read (it may name a TAP). It returns
// the TAPs it removed.
func (n *Net) ReconcileTAPs(ctx context.Context) ([]string, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("reconcile taps: %w", err)
	}
	gerr := n.RebuildGuard(ctx)
	taps, err := n.taps()
	if err != nil {
		return nil, errors.Join(gerr, fmt.Errorf("reconcile taps: %w", err))
	}
	recs, err := n.cfg.Store.List()
	if bad, listed := store.Unreadable(err); !listed || len(bad) > 0 {
		return nil, errors.Join(gerr, fmt.Errorf("reconcile taps: %w: %w", ErrRecordsUnreadable, err))
	}
	leased := map[string]bool{}
	for _, r := range recs {
		if l := store.Network(r); store.LeaseHeld(l) {
			leased[l.GetNetwork().GetTap()] = true
		}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	now := n.cfg.Now()
	var removed []string
	var errs []error
	for name := range n.seen {
		if !slices.Contains(taps, name) || leased[name] {
			delete(n.seen, name)
		}
	}
	for _, name := range taps {
		if leased[name] {
			continue
		}
		first, ok := n.seen[name]
		if !ok {
			n.seen[name] = now
			n.cfg.Logger.Info("TAP no record leases; removed after the grace", zap.String("tap", name), zap.Duration("grace", n.cfg.OrphanGrace))
			continue
		}
		if now.Sub(first) < n.cfg.OrphanGrace {
			continue
		}
		if err := n.removeTAP(name); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(n.seen, name)
		removed = append(removed, name)
		n.cfg.Logger.Warn("unleased TAP removed", zap.String("tap", name))
	}
	return removed, errors.Join(append(errs, gerr)...)
}
