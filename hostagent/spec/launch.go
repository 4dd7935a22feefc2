package spec

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Devices is the vGPU side a launch needs: the claim's device made sure of
// (re-created after a reboot) under the instance lock, and its sysfs path.
// claims.Claims implements it.
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
// started), the record's vGPU device is made sure of (missing after a host
// reboot: re-created under the same UUID or on the same VF, or the launch
// fails naming the claim), the record's images are opened beneath their
// roots (OpenImages), then QEMU's spec is built from the record with the
// files and, when attach is set, the device (vgpu-sim devices cannot be
// opened by QEMU). devs is nil on a host without vGPUs; a record holding a
// claim is then refused with ErrNoVGPUDriver rather than started without its
// GPU. The returned spec owns open files: vmm.Launch closes them, and so
// must a caller that does not launch (VMSpec.Close).
func PrepareLaunch(h Host, devs Devices, attach bool) func(context.Context, *store.Locked, *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
	return func(ctx context.Context, l *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
		if err := h.AdmitRecord(ctx, rec); err != nil {
			return vmm.VMSpec{}, err
		}
		v, err := prepareDevice(ctx, devs, attach, l, rec)
		if err != nil {
			return vmm.VMSpec{}, err
		}
		if err := h.OpenImages(ctx, l.Paths(), rec, &v); err != nil {
			return vmm.VMSpec{}, fmt.Errorf("prepare launch of %s: %w", rec.GetId(), err)
		}
		return v, nil
	}
}

// prepareDevice is QEMU's spec for rec without its images, with its vGPU
// made sure of.
func prepareDevice(ctx context.Context, devs Devices, attach bool, l *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
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

// OpenImages opens rec's kernel, initrd and disk beneath their image roots
// into v, and opens (creating it at the first launch) the instance's disk
// overlay under paths. A record written before records kept the root has
// only absolute paths: they are located under the current roots here. An
// image the host's policy refuses is a *FieldError (ErrInvalid); an overlay
// that cannot be made wraps vmm.ErrOverlay. On error nothing stays open.
func (h Host) OpenImages(ctx context.Context, paths store.Paths, rec *vmflowv1.InstanceRecord, v *vmm.VMSpec) (err error) {
	s := rec.GetSpec()
	var opened []*os.File
	defer func() {
		if err != nil {
			for _, f := range opened {
				f.Close()
			}
		}
	}()
	open := func(field, path string, ref *vmflowv1.ImageRef, boot bool) (*os.File, *vmflowv1.ImageRef, error) {
		if ref == nil {
			if path == "" {
				return nil, nil, nil
			}
			var lerr error
			if ref, lerr = h.Images.Locate(path); lerr != nil {
				return nil, nil, fieldError(field, lerr)
			}
		}
		f, err := h.Images.Open(ref, boot)
		if err != nil {
			return nil, nil, fieldError(field, err)
		}
		opened = append(opened, f)
		return f, ref, nil
	}
	if v.Kernel, _, err = open("kernel", s.GetKernel(), s.GetKernelImage(), true); err != nil {
		return err
	}
	if v.Initrd, _, err = open("initrd", s.GetInitrd(), s.GetInitrdImage(), true); err != nil {
		return err
	}
	base, ref, err := open("disk", s.GetDisk(), s.GetDiskImage(), false)
	if err != nil || base == nil {
		return err
	}
	overlay, _, err := vmm.OpenOverlay(ctx, vmm.OverlayConfig{
		Path: paths.Overlay, Temp: paths.OverlayTemp, Base: base,
		BackingName: filepath.Join(ref.GetRoot(), ref.GetPath()), QEMUImg: h.QEMUImg,
	})
	if err != nil {
		return err
	}
	v.Disk = &vmm.Disk{Base: base, Overlay: overlay}
	return nil
}
