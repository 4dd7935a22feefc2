package lease

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Reconcile runs one round, under each instance's lock: releases deleting
// instances' claims whose VM is confirmed gone, removes devices unclaimed past
// the grace period and held by nobody, and leaves everything else alone.
func (c *Claims) Reconcile(ctx context.Context) (*vmflowv1.ReconcileVGPUResult, error) {
	res := &vmflowv1.ReconcileVGPUResult{}
	recs, listErr := c.st.List()
	bad, listed := store.Unreadable(listErr)
	unreadable := len(bad)
	if !listed {
		return res, fmt.Errorf("reconcile: list records: %w", listErr)
	}
	res.UnreadableRecords = uint32(unreadable)
	if listErr != nil {
		// An unreadable record might claim any device: removing orphans
		// now could take a GPU from under it.
		c.log.Warn("reconcile: unreadable records, orphans left alone", zap.Int("unreadable_records", unreadable), zap.Error(listErr))
	}
	claimed := heldDevices(recs, "", "", c.drv.Kind())
	releaseRound(ctx, c.log, recs, store.KindVGPU, c.Release, res)
	if listErr != nil {
		return res, nil
	}
	devs, err := c.drv.Devices(ctx)
	if err != nil {
		return res, fmt.Errorf("reconcile: list devices: %w", err)
	}
	seen, err := c.loadLedger()
	if err != nil {
		return res, err
	}
	var orphans []orphan
	for _, d := range devs {
		if _, ok := claimed[d.ID]; ok {
			continue
		}
		orphans = append(orphans, orphan{id: d.ID,
			free:   func(ctx context.Context) error { return c.deviceFree(ctx, d, proc.Holders) },
			remove: func(ctx context.Context) error { return c.drv.Release(ctx, d) },
			log:    []zap.Field{zap.String("device_id", d.ID)}})
	}
	next := sweepOrphans(ctx, c.log, &c.seen, seen, c.now(), c.grace, orphans, res)
	if err := c.saveLedger(next); err != nil {
		return res, err
	}
	return res, nil
}

// roundAction is what a reconcile round does with one record's leases of
// one kind.
type roundAction int

const (
	roundNone  roundAction = iota // no lease of the kind
	roundOwned                    // held by a live instance: a spawn or a restart owns it
	// roundWake: released, but its delete may still wait out a backoff:
	// the round that released it (a predecessor, or the delete's own) may
	// have died before the wake-up was sent. Waking it again is harmless;
	// never waking it leaves the record for up to 15 minutes.
	roundWake
	roundRelease // held by a deleting instance: release it (if mayRelease)
)

// roundFor is the one reading, for every kind's Reconcile and Scan, of
// what a round does with rec's leases of kind: only a delete's lease is
// ever released.
func roundFor(rec *vmflowv1.InstanceRecord, kind string) roundAction {
	var some, held bool
	for _, l := range rec.GetLeases() {
		if store.LeaseKind(l) == kind {
			some, held = true, held || store.LeaseHeld(l)
		}
	}
	switch {
	case !some:
		return roundNone
	case !store.IsDeleting(rec):
		if held {
			return roundOwned
		}
		return roundNone
	case held:
		return roundRelease
	}
	return roundWake
}

// releaseRound is the release part of a reconcile round for kind: each
// deleting record's leases released through release (which takes the
// instance's lock and asks MayRelease), and each released or already
// released one's delete woken.
func releaseRound(ctx context.Context, log *zap.Logger, recs []*vmflowv1.InstanceRecord, kind string,
	release func(context.Context, string) (bool, []string, error), res *vmflowv1.ReconcileVGPUResult) {
	for _, r := range recs {
		switch roundFor(r, kind) {
		case roundNone:
			continue
		case roundWake:
			res.RetriedDeletes = append(res.RetriedDeletes, r.GetId())
			continue
		case roundOwned:
			res.Skipped++
			continue
		}
		released, devs, err := release(ctx, r.GetId())
		switch {
		case err != nil:
			res.Failed++
			log.Info("reconcile: lease not released", zap.String("instance_id", r.GetId()), zap.String("kind", kind), zap.Strings("device_ids", devs), zap.Error(err))
		case released:
			crashpoint.Hit(crashpoint.ReconcileReleased)
			res.ClaimsReleased++
			res.RetriedDeletes = append(res.RetriedDeletes, r.GetId())
		}
	}
}

// scanItem is what a scan reports of rec's leases of kind, as a round
// would act on them: a wake, a release MayRelease allows now, or "".
func scanItem(ctx context.Context, e *Engine, d Driver, rec *vmflowv1.InstanceRecord, holders holdersFunc) string {
	switch roundFor(rec, d.Kind()) {
	case roundWake:
		return "wake:" + rec.GetId()
	case roundRelease:
		for _, l := range store.HeldLeases(rec) {
			if store.LeaseKind(l) == d.Kind() && e.mayRelease(ctx, rec, d, l, holders) == nil {
				return "release:" + rec.GetId()
			}
		}
	}
	return ""
}

// orphan is a device on the host that no held lease names: a vGPU no
// claim made, a group vmflow marked and no lease holds.
type orphan struct {
	id     string // its key in the grace ledger
	free   func(context.Context) error
	remove func(context.Context) error
	log    []zap.Field
}

// sweepOrphans is the orphan part of a reconcile round for every kind:
// each orphan unclaimed for the grace (since its first sighting, a scan's
// or the ledger's) and held by no process is removed; the others wait. It
// returns the next round's ledger: the orphans still there, with their
// first sighting. A device removed, or found claimed, starts its grace
// again if it is ever unclaimed again (a VF reused by a claim whose intent
// this round's listing missed).
func sweepOrphans(ctx context.Context, log *zap.Logger, seen *scanSeen, ledger map[string]time.Time, now time.Time, grace time.Duration,
	orphans []orphan, res *vmflowv1.ReconcileVGPUResult) map[string]time.Time {
	next := map[string]time.Time{}
	for _, o := range orphans {
		first := seen.since(ledger, o.id, now)
		if now.Sub(first) < grace {
			next[o.id] = first
			res.Skipped++
			continue
		}
		if err := o.free(ctx); err != nil {
			next[o.id] = first
			res.Skipped++
			log.Info("reconcile: orphan held, left alone", append(o.log, zap.Error(err))...)
			continue
		}
		if err := o.remove(ctx); err != nil {
			next[o.id] = first
			res.Failed++
			log.Warn("reconcile: orphan removal failed", append(o.log, zap.Error(err))...)
			continue
		}
		res.OrphansRemoved++
		log.Info("reconcile: orphan removed", append(o.log, zap.Duration("unclaimed_for", now.Sub(first)))...)
	}
	seen.set(next)
	return next
}
