package claims

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"go.uber.org/zap"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vgpu"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Claim gives instance id a vGPU of profile, writing the intent (profile,
// placement, UUID) before creating the device (invariant 13). Idempotent: an
// active claim is returned, a crash's intent finished where it was placed.
func (c *Claims) Claim(ctx context.Context, id, profile string) (*vmflowv1.Lease, error) {
	l, err := c.st.Lock(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, err)
	}
	defer l.Unlock()
	rec, err := l.Get()
	if err != nil {
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, err)
	}
	if store.IsDeleting(rec) {
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, store.ErrDeleting)
	}
	req := vgpu.CreateRequest{Profile: profile, Taken: c.takenBy(id), Held: c.heldBy(id)}
	if store.ClaimHeld(rec) {
		have := store.VGPU(rec)
		if p := have.GetVgpu().GetProfile(); p != profile {
			return nil, fmt.Errorf("claim %q for %s: %w (%q)", profile, id, ErrClaimConflict, p)
		}
		if have.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			return c.ensureActive(ctx, l, have)
		}
		// An intent whose device may or may not exist: finish it where it
		// was placed, under the same UUID, if the device is its own.
		dev := deviceOf(have, c.drv.Kind())
		if err := c.ownDevice(ctx, id, dev); err != nil {
			return nil, fmt.Errorf("claim %q for %s: %w", profile, id, err)
		}
		req.UUID = have.GetVgpu().GetUuid()
		req.At = placementOf(have)
		if exists, err := c.exists(ctx, dev); err == nil && exists {
			return c.activate(l, dev)
		}
	} else {
		req.UUID = uuid.NewString()
		req.Intent = func(pl vgpu.Placement) error {
			_, err := l.Apply(store.LeaseIntent(store.VGPULease(&vmflowv1.VgpuLease{
				Profile: pl.Profile, Parent: pl.Parent, TypeId: pl.TypeID, Uuid: req.UUID, DeviceId: pl.VF, Driver: string(c.drv.Kind()),
			}), c.now()))
			crashpoint.Hit(crashpoint.ClaimIntentWritten)
			return err
		}
	}
	dev, err := c.drv.Create(ctx, req)
	if err != nil {
		// The intent stays: a held claim whose device never came to be is
		// released as "already gone" by the delete path or reconcile.
		return nil, fmt.Errorf("claim %q for %s: %w", profile, id, err)
	}
	crashpoint.Hit(crashpoint.ClaimDeviceCreated)
	return c.activate(l, dev)
}

// placementOf is where a recorded vGPU lease was placed.
func placementOf(lease *vmflowv1.Lease) *vgpu.Placement {
	cl := lease.GetVgpu()
	return &vgpu.Placement{Profile: cl.GetProfile(), TypeID: cl.GetTypeId(), Parent: cl.GetParent(), VF: cl.GetDeviceId()}
}

// heldDevices is invariant 10's record ledger: every device a held claim of
// any phase names, mapped to its instance, self's excepted.
func heldDevices(recs []*vmflowv1.InstanceRecord, self string, kind vgpu.Kind) map[string]string {
	m := map[string]string{}
	for _, r := range recs {
		if r.GetId() == self || !store.ClaimHeld(r) {
			continue
		}
		m[deviceOf(store.VGPU(r), kind).ID] = r.GetId()
	}
	return m
}

// takenBy reads the ledger for vgpu.CreateRequest.Taken: devices held by
// others than self; unreadable records wrap vgpu.ErrRecordsUnreadable.
func (c *Claims) takenBy(self string) func(context.Context) (map[string]string, error) {
	return func(context.Context) (map[string]string, error) {
		recs, err := c.st.List()
		bad, listed := store.Unreadable(err)
		n := len(bad)
		if !listed {
			return nil, fmt.Errorf("vgpu: read claims: %w", err)
		}
		m := heldDevices(recs, self, c.drv.Kind())
		if n > 0 {
			// The records' errors are quoted, not wrapped: they are other
			// instances' troubles, and a caller branching on
			// store.ErrInvalidRecord must not take them for its own.
			return m, fmt.Errorf("%w: %d record(s): %s", vgpu.ErrRecordsUnreadable, n, strings.ReplaceAll(err.Error(), "\n", "; "))
		}
		return m, nil
	}
}

// heldBy reads the records for vgpu.CreateRequest.Held: the devices of
// the held claims of instances other than self, with their placements.
func (c *Claims) heldBy(self string) func(context.Context) ([]vgpu.Device, error) {
	return func(context.Context) ([]vgpu.Device, error) {
		recs, err := c.st.List()
		bad, listed := store.Unreadable(err)
		if !listed {
			return nil, fmt.Errorf("vgpu: read claims: %w", err)
		}
		var out []vgpu.Device
		for _, r := range recs {
			if r.GetId() != self && store.ClaimHeld(r) {
				out = append(out, deviceOf(store.VGPU(r), c.drv.Kind()))
			}
		}
		if len(bad) > 0 {
			return out, fmt.Errorf("%w: %d record(s)", vgpu.ErrRecordsUnreadable, len(bad))
		}
		return out, nil
	}
}

// ownDevice refuses (ErrClaimedByOther) when another instance's held claim
// names dev. An unreadable record does not refuse: placement never places
// while one is unreadable, so it cannot name a device placed since.
func (c *Claims) ownDevice(ctx context.Context, id string, dev vgpu.Device) error {
	err := vgpu.NotClaimedByOther(ctx, c.takenBy(id), dev.ID)
	if errors.Is(err, vgpu.ErrClaimedByOther) {
		return fmt.Errorf("instance %s: %w", id, err)
	}
	return err
}

func (c *Claims) activate(l *store.Locked, dev vgpu.Device) (*vmflowv1.Lease, error) {
	rec, err := l.Apply(store.VGPUActive(dev.ID, dev.Parent))
	if err != nil {
		return nil, fmt.Errorf("activate claim of %s: %w", l.ID(), err)
	}
	crashpoint.Hit(crashpoint.ClaimActivated)
	c.log.Info("vGPU claimed", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID), zap.String("profile", dev.Profile))
	return store.VGPU(rec), nil
}

func (c *Claims) exists(ctx context.Context, d vgpu.Device) (bool, error) {
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
