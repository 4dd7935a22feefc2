package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"

	"go.uber.org/zap"

	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TAPRound is what one ReconcileTAPs round did.
type TAPRound struct {
	// Removed are the unleased TAPs removed, past their grace.
	Removed []string
	// Reattached are the leased TAPs set up again as guests' ports: put
	// back on the bridge (a hand or a tool deleted the bridge, or moved
	// the port), or given back their port settings or static FDB entry (a
	// hand changed them).
	Reattached []string
}

// ReconcileTAPs rebuilds the anti-spoofing filter from the records
// (RebuildGuard) and makes the bridge again when it is gone
// (EnsureBridge); sets every leased TAP that is not a whole guest's port
// of the bridge up again (reattach); then removes the TAPs (named with
// TAPPrefix) that no record's held lease names once they have been seen
// unleased for the orphan grace. The agent writes a lease before it makes
// its TAP, so these are TAPs of a record removed by hand, or made by a
// hand. The records are read and the TAPs removed under the placement
// lock, so a lease placed meanwhile is either seen (its TAP kept) or
// placed after the removal (its TAP made afresh). Nothing is removed while
// a record cannot be read (it may name a TAP).
func (n *Net) ReconcileTAPs(ctx context.Context) (TAPRound, error) {
	var round TAPRound
	if err := ctx.Err(); err != nil {
		return round, fmt.Errorf("reconcile taps: %w", err)
	}
	gerr := n.RebuildGuard(ctx)
	if err := n.EnsureBridge(ctx); err != nil {
		gerr = errors.Join(gerr, fmt.Errorf("reconcile taps: %w", err))
	}
	hl, err := n.hostLock(ctx)
	if err != nil {
		return round, errors.Join(gerr, fmt.Errorf("reconcile taps: %w", err))
	}
	defer hl.Release(false)
	taps, err := n.taps()
	if err != nil {
		return round, errors.Join(gerr, fmt.Errorf("reconcile taps: %w", err))
	}
	recs, err := n.cfg.Store.List()
	// One read of every port's settings for the round; without it only
	// ports off the bridge are found.
	ports, perr := n.readBridgePorts()
	if perr != nil {
		gerr = errors.Join(gerr, fmt.Errorf("reconcile taps: %w", perr))
		ports = nil
	}
	// Leased TAPs go back on the bridge whatever else the records say.
	leased := map[string]bool{}
	for _, r := range recs {
		l := store.Network(r)
		if !store.LeaseHeld(l) {
			continue
		}
		leased[l.GetNetwork().GetTap()] = true
		if !slices.Contains(taps, l.GetNetwork().GetTap()) {
			continue // made by the VM's next launch
		}
		if did, rerr := n.reattach(ctx, l.GetNetwork(), ports); rerr != nil {
			gerr = errors.Join(gerr, fmt.Errorf("reconcile taps: instance %s: %w", r.GetId(), rerr))
		} else if did {
			round.Reattached = append(round.Reattached, l.GetNetwork().GetTap())
			n.cfg.Logger.Warn("leased TAP was off the bridge, or its port settings or FDB entry changed; set up again",
				zap.String("instance_id", r.GetId()), zap.String("tap", l.GetNetwork().GetTap()), zap.String("bridge", n.cfg.Bridge))
		}
	}
	if bad, listed := store.Unreadable(err); !listed || len(bad) > 0 {
		return round, errors.Join(gerr, fmt.Errorf("reconcile taps: %w: %w", ErrRecordsUnreadable, err))
	}
	if n.afterList != nil {
		n.afterList()
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	now := n.cfg.Now()
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
		round.Removed = append(round.Removed, name)
		n.cfg.Logger.Warn("unleased TAP removed", zap.String("tap", name))
	}
	return round, errors.Join(append(errs, gerr)...)
}

// reattach sets a leased TAP up again as a guest's port of the bridge
// (setupPort) when it is not one: off the bridge (a hand deleted the
// bridge or moved the port), or, as ports (nil: not known) says, on it
// without a guest port's settings or its FDB entry (a hand changed them);
// and reports whether it had to. The TAP itself is never made again here:
// a running QEMU holds its queue.
func (n *Net) reattach(ctx context.Context, nl *vmflowv1.NetworkLease, ports *bridgePorts) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	mac, err := net.ParseMAC(nl.GetMac())
	if err != nil || len(mac) != 6 {
		return false, fmt.Errorf("%w: lease mac %q", ErrInvalid, nl.GetMac())
	}
	t, err := n.tap(nl.GetTap())
	if err != nil || t == nil {
		return false, err
	}
	br, err := n.h.LinkByName(n.cfg.Bridge)
	if err != nil {
		return false, fmt.Errorf("bridge %s: %w", n.cfg.Bridge, err)
	}
	if t.Attrs().MasterIndex == br.Attrs().Index && (ports == nil || ports.whole(t.Attrs().Index, mac, br.Attrs().Index)) {
		return false, nil
	}
	return true, n.setupPort(t, br, mac)
}
