// The spec's assembly: an admitted record turned into QEMU's spec, its
// devices made sure of and its images opened beneath their roots.

package admission

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Devices is the vGPU side a launch needs: the claim's device made sure of
// (re-created after a reboot) under the instance lock, and its sysfs path.
// lease.Claims implements it.
type Devices interface {
	EnsureDevicesLocked(ctx context.Context, l *store.Locked) ([]*vmflowv1.Lease, error)
	DevicePath(claim *vmflowv1.Lease) string
}

// WholeDevices is what a launch needs of whole-GPU claims: every held lease
// bound, and the sysfs paths of its functions. lease.Whole implements it.
type WholeDevices interface {
	EnsureDevicesLocked(ctx context.Context, l *store.Locked) ([]*vmflowv1.Lease, error)
	DevicePaths(lease *vmflowv1.Lease) []string
}

// ErrNoVGPUDriver: the instance holds a vGPU claim but the agent runs
// without a vGPU driver, so its VM cannot get its GPU.
var ErrNoVGPUDriver = errdefs.NoDriver.New("the instance holds a vGPU claim and this agent has no vGPU driver")

// Assemble returns supervise's Config.PrepareLaunch for a host without its
// admission (Config.Admit, the launch's first stage, admits): under the
// instance lock it makes sure of the record's devices (devs nil refuses a
// vGPU claim: ErrNoVGPUDriver), opens its images and builds QEMU's spec,
// which owns those files (VMSpec.Close if not launched).
func Assemble(h Host, devs Devices, attach bool) func(context.Context, *store.Locked, *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
	return func(ctx context.Context, l *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
		// A device lost in a reboot is re-created (same UUID or VF) or the
		// launch fails naming the claim; vgpu-sim devices are not attached.
		v, err := prepareDevice(ctx, devs, attach, l, rec)
		if err != nil {
			return vmm.VMSpec{}, err
		}
		whole, err := prepareWhole(ctx, h.Whole, attach, l, rec)
		if err != nil {
			return vmm.VMSpec{}, err
		}
		v.VFIO = append(v.VFIO, whole...)
		// Before any image is opened: a host whose own memlock limit cannot
		// cover the device's pinned RAM is refused naming the setting.
		if err := vmm.CheckMemlock(v, h.MemlockLimit); err != nil {
			return vmm.VMSpec{}, fmt.Errorf("prepare launch of %s: %w", rec.GetId(), err)
		}
		if err := h.OpenImages(ctx, l.Paths(), rec, &v); err != nil {
			return vmm.VMSpec{}, fmt.Errorf("prepare launch of %s: %w", rec.GetId(), err)
		}
		if err := checkDiskBase(l, rec, v.Disk); err != nil {
			v.Close()
			return vmm.VMSpec{}, fmt.Errorf("prepare launch of %s: %w", rec.GetId(), err)
		}
		return v, nil
	}
}

// checkDiskBase refuses (ErrAdmissionRefused) a launch whose disk base is not
// the file the overlay was made on (disk_base, recorded at the first launch):
// the overlay would read as a corrupt disk. An older overlay is trusted once.
func checkDiskBase(l *store.Locked, rec *vmflowv1.InstanceRecord, d *vmm.Disk) error {
	if d == nil {
		return nil
	}
	now, err := fileIdentity(d.Base)
	if err != nil {
		return fmt.Errorf("disk base: %w", err)
	}
	was := rec.GetDiskBase()
	if was == nil {
		_, err := l.Apply(store.DiskBaseSeen(now))
		return err
	}
	if !proto.Equal(was, now) {
		return fmt.Errorf("%w: %w", ErrAdmissionRefused, &FieldError{Field: "disk", Reason: fmt.Sprintf(
			"the base image changed since the instance's overlay was made on it (was dev %d inode %d, %d bytes, mtime %d; now dev %d inode %d, %d bytes, mtime %d): "+
				"the overlay would read as a corrupt disk; restore the base, or delete the instance",
			was.GetDev(), was.GetIno(), was.GetSize(), was.GetMtimeUnixNano(), now.GetDev(), now.GetIno(), now.GetSize(), now.GetMtimeUnixNano())})
	}
	return nil
}

// fileIdentity is f's FileIdentity, from fstat of the open file (the one
// QEMU will get, not whatever its path names by now).
func fileIdentity(f *os.File) (*vmflowv1.FileIdentity, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("fstat %s: %w", f.Name(), err)
	}
	return &vmflowv1.FileIdentity{Dev: st.Dev, Ino: st.Ino, Size: uint64(st.Size),
		MtimeUnixNano: st.Mtim.Sec*1e9 + st.Mtim.Nsec}, nil
}

// prepareDevice is QEMU's spec for rec without its images, with its vGPUs
// made sure of: every one the spec asks for, or none is started.
func prepareDevice(ctx context.Context, devs Devices, attach bool, l *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
	want := store.VGPUCount(rec.GetSpec().GetVgpuProfile(), rec.GetSpec().GetVgpuCount())
	held := store.HeldVGPUs(rec)
	if len(held) < want {
		// The spawn's claim has not been made (or was released): a VM
		// that asked for GPUs never starts without all of them.
		return vmm.VMSpec{}, fmt.Errorf("instance %s asks for %d vGPU(s) %q but holds %d: %w",
			rec.GetId(), want, rec.GetSpec().GetVgpuProfile(), len(held), ErrInvalid)
	}
	if len(held) == 0 {
		return ForRecord(rec, nil), nil
	}
	if devs == nil {
		c := held[0].GetVgpu()
		return vmm.VMSpec{}, fmt.Errorf("instance %s (claim %q on %s): %w", rec.GetId(), c.GetProfile(), store.ClaimDevice(c), ErrNoVGPUDriver)
	}
	leases, err := devs.EnsureDevicesLocked(ctx, l)
	if err != nil {
		return vmm.VMSpec{}, fmt.Errorf("prepare launch of %s: %w", rec.GetId(), err)
	}
	var vfio []string
	for _, lease := range leases {
		if attach {
			vfio = append(vfio, devs.DevicePath(lease))
		}
	}
	return ForRecord(rec, vfio), nil
}

// prepareWhole makes sure of rec's whole GPUs (every one the spec asks for
// held and bound) and returns their functions' sysfs paths when attach is
// set (under the simulator QEMU cannot open a simulated function either).
func prepareWhole(ctx context.Context, whole WholeDevices, attach bool, l *store.Locked, rec *vmflowv1.InstanceRecord) ([]string, error) {
	want, held := store.PassthroughCount(rec.GetSpec()), store.HeldPassthrough(rec)
	if n := store.HeldPassthroughGPUs(rec); n < want {
		return nil, fmt.Errorf("instance %s asks for %d whole GPU(s) but holds %d: %w", rec.GetId(), want, n, ErrInvalid)
	}
	if len(held) == 0 {
		return nil, nil
	}
	if whole == nil {
		return nil, fmt.Errorf("instance %s holds whole GPU(s) (IOMMU group %s): %w", rec.GetId(), held[0].GetGpuPassthrough().GetIommuGroup(), ErrNoVGPUDriver)
	}
	leases, err := whole.EnsureDevicesLocked(ctx, l)
	if err != nil {
		return nil, fmt.Errorf("prepare launch of %s: %w", rec.GetId(), err)
	}
	var paths []string
	for _, lease := range leases {
		if attach {
			paths = append(paths, whole.DevicePaths(lease)...)
		}
	}
	return paths, nil
}

// OpenImages opens rec's kernel, initrd and disk beneath their roots into v,
// and the disk overlay (created at the first launch); a policy refusal is a
// *FieldError, an overlay failure vmm.ErrOverlay. On error nothing stays open.
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

// ForRecord is QEMU's spec for a record, without images: the one conversion,
// for first launch and restarts alike. vfioPaths are the devices' sysfs
// paths in claim order (none when the agent does not attach them).
func ForRecord(rec *vmflowv1.InstanceRecord, vfioPaths []string) vmm.VMSpec {
	s := rec.GetSpec()
	v := vmm.VMSpec{
		Name:      rec.GetId(),
		UUID:      s.GetUuid(),
		VCPUs:     int(s.GetVcpus()),
		MemoryMiB: int(s.GetMemoryMib()),
		Machine:   vmm.Machine(s.GetMachine()),
		Accel:     vmm.Accel(s.GetAccel()),
		Cmdline:   s.GetCmdline(),
		// The guest's console goes to qemu.log; -machine none has no
		// serial port to connect.
		SerialToLog: s.GetMachine() != "none",
		// A guest that reboots is restarted by the restart policy, not by
		// QEMU behind the agent's back.
		NoReboot: true,
	}
	v.VFIO = slices.Clone(vfioPaths)
	io := s.GetDiskIo() // nil: no bound of the caller's
	v.IO = vmm.IOLimits{ReadBPS: io.GetReadBps(), WriteBPS: io.GetWriteBps(), ReadIOPS: io.GetReadIops(), WriteIOPS: io.GetWriteIops()}
	// Where the capacity ledger placed it (a held lease only: a launch
	// places before it assembles).
	if l := store.Capacity(rec); store.LeaseHeld(l) {
		c := l.GetCapacity()
		v.Placement = vmm.Placement{CPUs: c.GetCpus(), HugepageKiB: int(c.GetHugepageKib())}
		for _, n := range c.GetNumaNodes() {
			v.Placement.Nodes = append(v.Placement.Nodes, int(n))
		}
	}
	return v
}
