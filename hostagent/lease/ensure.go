package lease

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// EnsureDevicesLocked makes the locked instance's held vGPU leases
// launchable, in claim order: each device must exist and be its own
// (ErrClaimedByOther); one lost in a reboot is re-created under the same UUID
// or VF (else ErrClaimDeviceMissing). No lease: (nil, nil); one not active:
// ErrClaimNotActive. Before every launch and restart.
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
	if _, err := c.drv.Create(ctx, gpu.CreateRequest{Profile: cl.GetProfile(), UUID: cl.GetUuid(), At: placementOf(lease),
		Taken: c.takenBy(l.ID(), store.LeaseName(lease)), Held: c.heldBy(l.ID(), store.LeaseName(lease))}); err != nil {
		return nil, fmt.Errorf("instance %s: vGPU %q device %s: %w: %w", l.ID(), cl.GetProfile(), dev.ID, ErrClaimDeviceMissing, err)
	}
	c.log.Info("vGPU re-created", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID), zap.String("profile", cl.GetProfile()))
	return lease, nil
}
