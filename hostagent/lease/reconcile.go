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
	for _, r := range recs {
		switch roundFor(r) {
		case roundNone:
			continue
		case roundWake:
			res.RetriedDeletes = append(res.RetriedDeletes, r.GetId())
			continue
		case roundOwned:
			res.Skipped++
			continue
		}
		released, devs, err := c.Release(ctx, r.GetId())
		switch {
		case err != nil:
			res.Failed++
			c.log.Info("reconcile: claim not released", zap.String("instance_id", r.GetId()), zap.Strings("device_ids", devs), zap.Error(err))
		case released:
			crashpoint.Hit(crashpoint.ReconcileReleased)
			res.ClaimsReleased++
			res.RetriedDeletes = append(res.RetriedDeletes, r.GetId())
		}
	}
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
	now := c.now()
	next := map[string]time.Time{}
	for _, d := range devs {
		if _, ok := claimed[d.ID]; ok {
			continue
		}
		// A scan's sighting counts: it is this agent's as much as the ledger's.
		first := c.seen.since(seen, d.ID, now)
		if now.Sub(first) < c.grace {
			next[d.ID] = first
			res.Skipped++
			continue
		}
		if err := c.deviceFree(ctx, d, proc.Holders); err != nil {
			next[d.ID] = first
			res.Skipped++
			c.log.Info("reconcile: orphan held, left alone", zap.String("device_id", d.ID), zap.Error(err))
			continue
		}
		if err := c.drv.Release(ctx, d); err != nil {
			next[d.ID] = first
			res.Failed++
			c.log.Warn("reconcile: orphan removal failed", zap.String("device_id", d.ID), zap.Error(err))
			continue
		}
		res.OrphansRemoved++
		c.log.Info("reconcile: orphan removed", zap.String("device_id", d.ID), zap.Duration("unclaimed_for", now.Sub(first)))
	}
	// The scan's sightings become the round's: a device removed or found
	// claimed now starts its grace again if it is ever unclaimed again (a
	// VF reused by a claim whose intent this round's listing missed).
	c.seen.set(next)
	if err := c.saveLedger(next); err != nil {
		return res, err
	}
	return res, nil
}

// roundAction is what a reconcile round does with one record's vGPU lease.
type roundAction int

const (
	roundNone  roundAction = iota // no vGPU lease
	roundOwned                    // held by a live instance: a spawn or a restart owns it
	// roundWake: released, but its delete may still wait out a backoff:
	// the round that released it (a predecessor, or the delete's own) may
	// have died before the wake-up was sent. Waking it again is harmless;
	// never waking it leaves the record for up to 15 minutes.
	roundWake
	roundRelease // held by a deleting instance: release it (if mayRelease)
)

// roundFor is the one reading, for Reconcile and Scan alike, of what a
// round does with rec: only a delete's lease is ever released.
func roundFor(rec *vmflowv1.InstanceRecord) roundAction {
	switch {
	case len(store.VGPUs(rec)) == 0:
		return roundNone
	case !store.IsDeleting(rec):
		if store.ClaimHeld(rec) {
			return roundOwned
		}
		return roundNone
	case store.ClaimHeld(rec):
		return roundRelease
	}
	return roundWake
}
