package activities

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// WholeGPUs is what the activities need of whole-GPU (passthrough) claims;
// lease.Whole implements it.
type WholeGPUs interface {
	// Claim gives the instance count whole GPUs of model ("" any), all
	// or none.
	Claim(ctx context.Context, instanceID, model string, count int) ([]*vmflowv1.Lease, error)
	// Release returns every whole GPU the instance holds, as GPUs.Release.
	Release(ctx context.Context, instanceID string) (released bool, devices []string, err error)
	// LeaseDriver is the lease engine's driver of whole-GPU leases.
	LeaseDriver() lease.Driver
	// Reconcile runs one reconcile round over the host's whole GPUs.
	Reconcile(ctx context.Context) (*vmflowv1.ReconcileVGPUResult, error)
}

// claimWhole is ClaimDevices for an admitted claim of whole GPUs.
func (a *Activities) claimWhole(ctx context.Context, log *zap.Logger, id string, want deviceClaim) (*vmflowv1.ClaimVGPUResult, error) {
	if a.Whole == nil {
		return nil, classify(fmt.Errorf("gpu_passthrough_count %d: %w: this host hands out no whole GPUs (--gpu-passthrough)",
			want.passthrough, admission.ErrInvalid))
	}
	leases, err := a.Whole.Claim(ctx, id, want.model, want.passthrough)
	if err != nil {
		return nil, classify(fmt.Errorf("claim whole GPU: %w", err))
	}
	crashpoint.Hit(crashpoint.ActivityClaimDevicesDone)
	a.changed()
	res := &vmflowv1.ClaimVGPUResult{}
	for _, l := range leases {
		res.DeviceIds = append(res.DeviceIds, store.PassthroughDevices(l)...)
	}
	if len(res.DeviceIds) > 0 {
		res.DeviceId = res.DeviceIds[0]
	}
	log.Info("whole GPUs claimed", zap.Strings("device_ids", res.DeviceIds), zap.String("kind", store.KindPassthrough))
	return res, nil
}

// reconcileGPUs runs the vGPU and whole-GPU reconcile rounds this host has,
// their counts added up.
func (a *Activities) reconcileGPUs(ctx context.Context) (*vmflowv1.ReconcileVGPUResult, error) {
	res := &vmflowv1.ReconcileVGPUResult{}
	var errs []error
	for _, round := range []func(context.Context) (*vmflowv1.ReconcileVGPUResult, error){a.vgpuRound(), a.wholeRound()} {
		if round == nil {
			continue
		}
		r, err := round(ctx)
		if err != nil {
			errs = append(errs, err)
		}
		res.ClaimsReleased += r.GetClaimsReleased()
		res.OrphansRemoved += r.GetOrphansRemoved()
		res.Skipped += r.GetSkipped()
		res.Failed += r.GetFailed()
		res.UnreadableRecords = max(res.UnreadableRecords, r.GetUnreadableRecords())
		res.RetriedDeletes = append(res.RetriedDeletes, r.GetRetriedDeletes()...)
	}
	return res, errors.Join(errs...)
}

func (a *Activities) vgpuRound() func(context.Context) (*vmflowv1.ReconcileVGPUResult, error) {
	if a.GPUs == nil {
		return nil
	}
	return a.GPUs.Reconcile
}

func (a *Activities) wholeRound() func(context.Context) (*vmflowv1.ReconcileVGPUResult, error) {
	if a.Whole == nil {
		return nil
	}
	return a.Whole.Reconcile
}
