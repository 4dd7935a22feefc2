package claims

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vgpu"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// EnsureDeviceLocked makes the locked instance's held claim launchable: its
// device must exist and be its own (ErrClaimedByOther), and one lost in a
// reboot is re-created under the same UUID or VF (else ErrClaimDeviceMissing).
// No claim: (nil, nil); not active: ErrClaimNotActive. Before every launch.
func (c *Claims) EnsureDeviceLocked(ctx context.Context, l *store.Locked) (*vmflowv1.Lease, error) {
	rec, err := l.Get()
	if err != nil {
		return nil, fmt.Errorf("ensure vGPU of %s: %w", l.ID(), err)
	}
	if !store.ClaimHeld(rec) {
		return nil, nil
	}
	return c.ensureActive(ctx, l, store.VGPU(rec))
}

func (c *Claims) ensureActive(ctx context.Context, l *store.Locked, lease *vmflowv1.Lease) (*vmflowv1.Lease, error) {
	dev := deviceOf(lease, c.drv.Kind())
	cl := lease.GetVgpu()
	if lease.GetPhase() != vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
		return nil, fmt.Errorf("vGPU of %s (profile %q, device %s) is %s: %w", l.ID(), cl.GetProfile(), dev.ID, lease.GetPhase(), ErrClaimNotActive)
	}
	if err := c.ownDevice(ctx, l.ID(), dev); err != nil {
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
		Taken: c.takenBy(l.ID()), Held: c.heldBy(l.ID())}); err != nil {
		return nil, fmt.Errorf("instance %s: vGPU %q device %s: %w: %w", l.ID(), cl.GetProfile(), dev.ID, ErrClaimDeviceMissing, err)
	}
	c.log.Info("vGPU re-created", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID), zap.String("profile", cl.GetProfile()))
	return lease, nil
}
