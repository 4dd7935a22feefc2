package claims

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vgpu"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// EnsureDevicesLocked makes the locked instance's held vGPU leases
// launchable, each as ensureActive does: for an ACTIVE lease it checks that the device exists and is the claim's own
// (no other instance's held claim names it: ErrClaimedByOther; for vendor
// VFIO, the VF runs the claim's type) and, when the device is missing (a
// host reboot removes mdevs and resets VF types), re-creates it under the
// same UUID (mdev) or on the same VF with the same type (vendor). It
// returns the leases in claim order, or an error wrapping
// ErrClaimDeviceMissing (naming the instance, profile and device) when a
// re-creation failed. No held lease: (nil, nil). A held lease that is not
// active: ErrClaimNotActive. Call it under the instance lock before every
// launch and restart.
func (c *Claims) EnsureDevicesLocked(ctx context.Context, l *store.Locked) ([]*vmflowv1.Lease, error) {
	rec, err := l.Get()
	if err != nil {
		return nil, fmt.Errorf("ensure vGPUs of %s: %w", l.ID(), err)
	}
	var out []*vmflowv1.Lease
	for _, lease := range store.HeldVGPUs(rec) {
		got, err := c.ensureActive(ctx, l, lease)
		if err != nil {
			return nil, err
		}
		out = append(out, got)
	}
	return out, nil
}

func (c *Claims) ensureActive(ctx context.Context, l *store.Locked, lease *vmflowv1.Lease) (*vmflowv1.Lease, error) {
	dev := deviceOf(lease, c.drv.Kind())
	cl := lease.GetVgpu()
	if lease.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
		return nil, fmt.Errorf("vGPU of %s (profile %q, device %s) is %s: %w", l.ID(), cl.GetProfile(), dev.ID, lease.GetPhase(), ErrClaimNotActive)
	}
	if err := c.ownDevice(ctx, l.ID(), lease); err != nil {
		return nil, fmt.Errorf("ensure vGPU of %s: %w", l.ID(), err)
	}
	exists, err := c.exists(ctx, dev)
	if err != nil {
		return nil, fmt.Errorf("ensure vGPU of %s: %w", l.ID(), err)
	}
	if exists {
		return lease, nil
	}
	c.log.Warn("vGPU of an active claim is missing, re-creating it", zap.String("instance_id", l.ID()),
		zap.String("device_id", dev.ID), zap.String("profile", cl.GetProfile()))
	if _, err := c.drv.Create(ctx, vgpu.CreateRequest{Profile: cl.GetProfile(), UUID: cl.GetUuid(), At: placementOf(lease),
		Taken: c.takenBy(l.ID(), store.LeaseName(lease)), Held: c.heldBy(l.ID(), store.LeaseName(lease))}); err != nil {
		return nil, fmt.Errorf("instance %s: vGPU %q device %s: %w: %w", l.ID(), cl.GetProfile(), dev.ID, ErrClaimDeviceMissing, err)
	}
	c.log.Info("vGPU re-created", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID), zap.String("profile", cl.GetProfile()))
	return lease, nil
}
