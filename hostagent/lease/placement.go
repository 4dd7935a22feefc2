package lease

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/google/uuid"
	"go.uber.org/zap"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Claim gives instance id count vGPUs of profile, all or none, each intent
// written before its device is created (invariant 13). Idempotent: held
// leases are finished first. A final failure (no capacity, a refusal) rolls
// back this claim's leases while the record never launched; any other
// failure or a crash leaves leases the next Claim or the delete finishes.
func (c *Claims) Claim(ctx context.Context, id, profile string, count int) ([]*vmflowv1.Lease, error) {
	if count < 1 || count > store.MaxVGPUs {
		return nil, fmt.Errorf("claim %d vGPUs for %s: %w: from 1 to %d", count, id, gpu.ErrInvalid, store.MaxVGPUs)
	}
	l, rec, err := lockToClaim(ctx, c.st, id, "vGPU")
	if err != nil {
		return nil, err
	}
	defer l.Unlock()
	held := store.HeldVGPUs(rec)
	for _, have := range held {
		if p := have.GetVgpu().GetProfile(); p != profile {
			return nil, fmt.Errorf("claim %q for %s: %w (%q)", profile, id, ErrClaimConflict, p)
		}
	}
	return ClaimAll(ctx, id, count, ClaimSteps{
		What:   "vGPU",
		Detail: fmt.Sprintf(" (%q)", profile),
		Held:   held,
		Finish: func(ctx context.Context, have *vmflowv1.Lease) (*vmflowv1.Lease, error) {
			return c.finish(ctx, l, have)
		},
		Place:    func(ctx context.Context, _ int) (*vmflowv1.Lease, error) { return c.claimOne(ctx, l, profile) },
		Rollback: func(ctx context.Context) error { return c.rollback(ctx, l) },
	})
}

// final reports whether err ends a claim, which is then undone rather than
// left to a retry: its class says no retry can change the answer, or the
// host has no room for the rest (holding some vGPUs while waiting for
// others would starve every other claim).
func final(err error) bool {
	c := errdefs.ClassOf(err)
	return c == errdefs.NoCapacity || c != nil && !c.Retryable()
}

// rollingBack reports whether lease is being undone by a failed claim.
func rollingBack(lease *vmflowv1.Lease) bool {
	return lease.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING
}

// finish makes a held lease of a claim under way active: an active one is
// ensured, an intent whose device may or may not exist is finished where it
// was placed, under the same UUID, if the device is its own.
func (c *Claims) finish(ctx context.Context, l *store.Locked, have *vmflowv1.Lease) (*vmflowv1.Lease, error) {
	if have.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
		return c.ensureActive(ctx, l, have)
	}
	name := store.LeaseName(have)
	dev := deviceOf(have, c.drv.Kind())
	if err := c.ownDevice(ctx, l.ID(), have); err != nil {
		return nil, err
	}
	if exists, err := c.exists(ctx, dev); err == nil && exists {
		return c.activate(l, name, dev)
	}
	req := gpu.CreateRequest{Profile: have.GetVgpu().GetProfile(), UUID: have.GetVgpu().GetUuid(), At: placementOf(have),
		Taken: c.takenBy(l.ID(), name), Held: c.heldBy(l.ID(), name)}
	dev, err := c.drv.Create(ctx, req)
	if err != nil {
		// The intent stays: a held claim whose device never came to be is
		// released as "already gone" by a rollback, the delete or reconcile.
		return nil, err
	}
	crashpoint.Hit(crashpoint.ClaimDeviceCreated)
	return c.activate(l, name, dev)
}

// claimOne places, writes ahead and creates one new vGPU of profile. The
// instance's other leases count as taken: two of its vGPUs never share a VF.
func (c *Claims) claimOne(ctx context.Context, l *store.Locked, profile string) (*vmflowv1.Lease, error) {
	req := gpu.CreateRequest{Profile: profile, UUID: uuid.NewString(), Taken: c.takenBy(l.ID(), ""), Held: c.heldBy(l.ID(), "")}
	if rec, err := l.Get(); err == nil {
		// Its other vGPUs' node first (numa "strict": only there), so the
		// VM's GPUs, CPUs and memory can share one node.
		req.Near, req.OnlyNear = c.nodesOf(store.HeldVGPUs(rec)), rec.GetSpec().GetNuma() == "strict"
	}
	name := ""
	req.Intent = func(pl gpu.Placement) error {
		lease := store.VGPULease(&vmflowv1.VgpuLease{
			Profile: pl.Profile, Parent: pl.Parent, TypeId: pl.TypeID, Uuid: req.UUID, DeviceId: pl.VF, Driver: string(c.drv.Kind()),
		})
		name = store.LeaseName(lease)
		_, err := l.Apply(store.LeaseIntent(lease, c.now()))
		crashpoint.Hit(crashpoint.ClaimIntentWritten)
		return err
	}
	dev, err := c.drv.Create(ctx, req)
	if err != nil {
		return nil, err
	}
	crashpoint.Hit(crashpoint.ClaimDeviceCreated)
	return c.activate(l, name, dev)
}

// nodesOf are the NUMA nodes of leases' parent GPUs, as sysfs says now;
// a parent whose node cannot be read is left out.
func (c *Claims) nodesOf(leases []*vmflowv1.Lease) []int {
	var nodes []int
	for _, l := range leases {
		loc, err := gpu.Locate(c.sysfs, l.GetVgpu().GetParent())
		if err == nil && loc.NUMANode >= 0 && !slices.Contains(nodes, loc.NUMANode) {
			nodes = append(nodes, loc.NUMANode)
		}
	}
	return nodes
}

// rollback undoes every held vGPU lease of a claim that failed, while the
// record never launched (Engine.Rollback).
func (c *Claims) rollback(ctx context.Context, l *store.Locked) error {
	return c.eng.Rollback(ctx, l, store.KindVGPU)
}

// placementOf is where a recorded vGPU lease was placed.
func placementOf(lease *vmflowv1.Lease) *gpu.Placement {
	cl := lease.GetVgpu()
	return &gpu.Placement{Profile: cl.GetProfile(), TypeID: cl.GetTypeId(), Parent: cl.GetParent(), VF: cl.GetDeviceId()}
}

// heldDevices is invariant 10's record ledger: every device a held claim of
// any phase names, mapped to its instance, except self's lease named except
// ("" keeps all of self's: a new placement must not reuse one).
func heldDevices(recs []*vmflowv1.InstanceRecord, self, except string, kind gpu.Kind) map[string]string {
	m := map[string]string{}
	for _, r := range recs {
		for _, lease := range store.HeldVGPUs(r) {
			if r.GetId() == self && store.LeaseName(lease) == except {
				continue
			}
			m[deviceOf(lease, kind).ID] = r.GetId()
		}
	}
	return m
}

// takenBy reads the ledger for gpu.CreateRequest.Taken: devices held by
// others and by self's leases but except; unreadable records wrap
// gpu.ErrRecordsUnreadable.
func (c *Claims) takenBy(self, except string) func(context.Context) (map[string]string, error) {
	return func(context.Context) (map[string]string, error) {
		recs, err := c.st.Records() // read only
		bad, listed := store.Unreadable(err)
		n := len(bad)
		if !listed {
			return nil, fmt.Errorf("vgpu: read claims: %w", err)
		}
		m := heldDevices(recs, self, except, c.drv.Kind())
		if except == "" {
			// A fresh placement skips a quarantined VF (an mdev parent is
			// left out through heldBy).
			q, err := c.quar.List()
			if err != nil {
				return nil, err
			}
			for id := range q {
				m[id] = "quarantine"
			}
		}
		if n > 0 {
			// The records' errors are quoted, not wrapped: they are other
			// instances' troubles, and a caller branching on
			// store.ErrInvalidRecord must not take them for its own.
			return m, fmt.Errorf("%w: %d record(s): %s", gpu.ErrRecordsUnreadable, n, strings.ReplaceAll(err.Error(), "\n", "; "))
		}
		return m, nil
	}
}

// heldBy reads the records for gpu.CreateRequest.Held: the devices of
// the held claims of other instances and of self's leases other than
// except, with their placements.
func (c *Claims) heldBy(self, except string) func(context.Context) ([]gpu.Device, error) {
	return func(context.Context) ([]gpu.Device, error) {
		recs, err := c.st.Records() // read only
		// In id order, as List's: the devices' order is placement's.
		slices.SortFunc(recs, func(a, b *vmflowv1.InstanceRecord) int { return strings.Compare(a.GetId(), b.GetId()) })
		bad, listed := store.Unreadable(err)
		if !listed {
			return nil, fmt.Errorf("vgpu: read claims: %w", err)
		}
		var out []gpu.Device
		for _, r := range recs {
			for _, lease := range store.HeldVGPUs(r) {
				if r.GetId() == self && store.LeaseName(lease) == except {
					continue
				}
				out = append(out, deviceOf(lease, c.drv.Kind()))
			}
		}
		if except == "" {
			// A quarantined parent GPU keeps a slot of a type none has:
			// reserveHeld then leaves it no capacity of any type.
			q, err := c.quar.List()
			if err != nil {
				return nil, err
			}
			for id := range q {
				out = append(out, gpu.Device{Kind: c.drv.Kind(), ID: "quarantined:" + id, Parent: id, TypeID: "quarantined"})
			}
		}
		if len(bad) > 0 {
			return out, fmt.Errorf("%w: %d record(s)", gpu.ErrRecordsUnreadable, len(bad))
		}
		return out, nil
	}
}

// ownDevice refuses (ErrClaimedByOther) when another instance's held claim
// names lease's device. An unreadable record does not refuse: placement never
// places while one is unreadable, so it cannot name a device placed since.
func (c *Claims) ownDevice(ctx context.Context, id string, lease *vmflowv1.Lease) error {
	dev := deviceOf(lease, c.drv.Kind())
	err := gpu.NotClaimedByOther(ctx, c.takenBy(id, store.LeaseName(lease)), dev.ID)
	if errors.Is(err, gpu.ErrClaimedByOther) {
		return fmt.Errorf("instance %s: %w", id, err)
	}
	return err
}

func (c *Claims) activate(l *store.Locked, name string, dev gpu.Device) (*vmflowv1.Lease, error) {
	rec, err := l.Apply(store.VGPUActive(name, dev.ID, dev.Parent))
	if err != nil {
		return nil, fmt.Errorf("activate claim of %s: %w", l.ID(), err)
	}
	crashpoint.Hit(crashpoint.ClaimActivated)
	c.log.Info("vGPU claimed", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID), zap.String("profile", dev.Profile))
	for _, lease := range store.HeldVGPUs(rec) {
		if store.LeaseName(lease) == name {
			return lease, nil
		}
	}
	return nil, fmt.Errorf("activate claim of %s: lease %s: %w", l.ID(), name, store.ErrIllegalTransition)
}

func (c *Claims) exists(ctx context.Context, d gpu.Device) (bool, error) {
	devs, err := c.drv.Devices(ctx)
	if err != nil {
		return false, err
	}
	for _, have := range devs {
		// A VF running another type, or an mdev of another type under the
		// same UUID, is not the claim's device.
		if have.ID == d.ID && (d.TypeID == "" || have.TypeID == d.TypeID) {
			return true, nil
		}
	}
	return false, nil
}
