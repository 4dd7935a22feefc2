package spec

import (
	"context"
	"errors"
	"fmt"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Devices is the vGPU side a launch needs: the claim's device made sure of
// (re-created after a reboot) under the instance lock, and its sysfs path.
// vgpu.Claims implements it.
type Devices interface {
	EnsureDeviceLocked(ctx context.Context, l *store.Locked) (*vmflowv1.GpuClaim, error)
	DevicePath(claim *vmflowv1.GpuClaim) string
}

// ErrNoVGPUDriver: the instance holds a vGPU claim but the agent runs
// without a vGPU driver, so its VM cannot get its GPU.
var ErrNoVGPUDriver = errors.New("the instance holds a vGPU claim and this agent has no vGPU driver")

// PrepareLaunch returns the supervisor's Config.PrepareLaunch for a host:
// before every launch and every restart, under the instance lock, the
// record is admitted against the host's current policy (h.AdmitRecord: a
// refusal wraps ErrAdmissionRefused, and nothing is opened, created or
// started), then the record's vGPU device is made sure of (missing after a host reboot: re-created
// under the same UUID or on the same VF, or the launch fails naming the
// claim), then QEMU's spec is built from the record with the device
// attached when attach is set (vgpu-sim devices cannot be opened by QEMU).
// devs is nil on a host without vGPUs; a record holding a claim is then
// refused with ErrNoVGPUDriver rather than started without its GPU.
func PrepareLaunch(h Host, devs Devices, attach bool) func(context.Context, *store.Locked, *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
	return func(ctx context.Context, l *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
		if err := h.AdmitRecord(ctx, rec); err != nil {
			return vmm.VMSpec{}, err
		}
		if !store.ClaimHeld(rec) {
			if rec.GetSpec().GetVgpuProfile() != "" {
				// The spawn's claim has not been made (or was released):
				// a VM that asked for a GPU never starts without one.
				return vmm.VMSpec{}, fmt.Errorf("instance %s asks for vGPU %q but holds no claim: %w",
					rec.GetId(), rec.GetSpec().GetVgpuProfile(), ErrInvalid)
			}
			return ForRecord(rec, ""), nil
		}
		if devs == nil {
			c := rec.GetGpuClaim()
			return vmm.VMSpec{}, fmt.Errorf("instance %s (claim %q on %s): %w", rec.GetId(), c.GetProfile(), store.ClaimDevice(c), ErrNoVGPUDriver)
		}
		claim, err := devs.EnsureDeviceLocked(ctx, l)
		if err != nil {
			return vmm.VMSpec{}, fmt.Errorf("prepare launch of %s: %w", rec.GetId(), err)
		}
		vfio := ""
		if attach {
			vfio = devs.DevicePath(claim)
		}
		return ForRecord(rec, vfio), nil
	}
}
