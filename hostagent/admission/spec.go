// Package admission admits a spawn request on this host, and a recorded instance
// again before every launch and restart: it checks every field that will
// reach a path, an argv or a sysfs write against the host (bounds, image
// roots, size, the vGPU profiles it offers), and turns an admitted request
// into the record's spec and QEMU's typed spec.
//
// The agent runs as root, so nothing from a workflow input is trusted: a
// kernel, initrd or disk path must lie under an --image-root and is opened
// beneath it (ImageRoots), at admission and again at every launch, and every
// rejection names its field.
package admission

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/internal/contract"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The restart policies a record may name (supervise applies them); empty
// is RestartNever.
const (
	RestartNever     = "never"
	RestartOnFailure = "on-failure"
	RestartAlways    = "always"
)

// NetworkDefault is the one network a spec may ask for: the host's bridge
// and subnet. Empty is none.
const NetworkDefault = "default"

// Accepted values of the enum-like string fields. A spawn may not ask for
// every machine vmm knows: pc is not offered.
var (
	Machines = []string{string(vmm.MachineNone), string(vmm.MachineQ35), string(vmm.MachineMicroVM)}
	Accels   = []string{string(vmm.AccelKVM), string(vmm.AccelTCG)}
	// NUMAPolicies: "preferred" (what empty means) or "strict".
	NUMAPolicies = []string{"preferred", "strict"}
	// HugepageSizes are the pages guest RAM may come in.
	HugepageSizes   = []string{"2M", "1G"}
	RestartPolicies = []string{RestartNever, RestartOnFailure, RestartAlways}
	Networks        = []string{NetworkDefault}
)

// ErrInvalid marks every admission failure; FieldError says which field.
var ErrInvalid = errdefs.InvalidInput.New("invalid spawn request")

// FieldError is one rejected field.
type FieldError struct {
	Field  string
	Reason string
	// Err is the cause when there is one (ErrEscapesRoot, ...): errors.Is
	// reaches it. Reason is its text.
	Err error
}

// fieldError is a FieldError for field caused by err.
func fieldError(field string, err error) *FieldError {
	return &FieldError{Field: field, Reason: err.Error(), Err: err}
}

func (e *FieldError) Error() string { return fmt.Sprintf("%s: %s", e.Field, e.Reason) }

// Is makes errors.Is(err, ErrInvalid), and so its class, true for every
// field error.
func (e *FieldError) Is(target error) bool { return errors.Is(ErrInvalid, target) }

// Unwrap is the cause, if any.
func (e *FieldError) Unwrap() error { return e.Err }

// Host is what admission checks against.
type Host struct {
	// Images are the folders kernel, initrd and disk must lie in, opened
	// once (see ImageRoots); nil means none.
	Images *ImageRoots
	// QEMUImg is the qemu-img binary that creates disk overlays;
	// vmm.DefaultQEMUImg in PATH when empty.
	QEMUImg string
	// MaxVCPUs and MaxMemoryMiB bound one VM: the host's size.
	MaxVCPUs     uint32
	MaxMemoryMiB uint32
	// Profiles lists the vGPU profile names the host offers; nil means the
	// host has no vGPUs.
	Profiles func(ctx context.Context) ([]string, error)
	// KVM is the host's KVM node as the agent found it at start
	// (vmm.CheckKVM): with its Err set, a spec that asks for KVM (accel
	// "kvm", or empty) is refused before anything is created for it, where
	// the launch would only fail later. The zero value is a usable KVM.
	KVM vmm.KVMAccess
	// Network says the host has a network (--net-subnet): a spec asking for
	// one is refused without it.
	Network bool
	// MemlockLimit is the agent's own hard RLIMIT_MEMLOCK
	// (vmm.MemlockLimit), which a VFIO VM's pinned RAM must fit under;
	// 0 bounds nothing.
	MemlockLimit uint64
	// Whole is the host's whole-GPU claims (--gpu-passthrough); nil when
	// it hands out none, and a spec asking for one is refused.
	Whole WholeDevices
	// DedicatedCPUs is how many CPUs the host keeps for VMs with
	// dedicated_cpus (--dedicated-cpus): a larger one is refused.
	DedicatedCPUs uint32
}

// SystemHost describes this machine: CPUs, memory, KVM node (default
// vmm.DefaultKVMDevice) and image roots, opened for the agent's life.
func SystemHost(imageRoots []string, kvmDevice string, profiles func(context.Context) ([]string, error)) (Host, error) {
	h := Host{MaxVCPUs: uint32(runtime.NumCPU()), Profiles: profiles, KVM: vmm.CheckKVM(kvmDevice), MemlockLimit: vmm.MemlockLimit()}
	mem, err := memTotalMiB()
	if err != nil {
		return Host{}, err
	}
	h.MaxMemoryMiB = mem
	if h.Images, err = OpenImageRoots(imageRoots); err != nil {
		return Host{}, err
	}
	return h, nil
}

func memTotalMiB() (uint32, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("host memory: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kib, err := strconv.ParseUint(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("host memory: %q: %w", sc.Text(), err)
			}
			return uint32(min(kib/1024, 1<<31)), nil
		}
	}
	return 0, fmt.Errorf("host memory: no MemTotal in /proc/meminfo")
}

// ErrAdmissionRefused: this host's current policy does not admit a recorded
// instance (AdmitRecord). The record was admitted when it was written, so
// the policy changed since (an image root removed, a lower maximum), or the
// record was written by someone who skipped admission; either way nothing
// is started for it. Refusals also match ErrInvalid through their
// FieldErrors.
var ErrAdmissionRefused = errdefs.Refused.New("refused by this host's admission policy")

// Validate checks req against the host with admit's checks plus host_id and
// the offered vGPU profiles, returning every field error joined (ErrInvalid);
// failing to list profiles is returned as is (retryable).
func (h Host) Validate(ctx context.Context, req *vmflowv1.SpawnRequest) error {
	if req == nil {
		return &FieldError{Field: "request", Reason: "empty"}
	}
	var errs []error
	if err := CheckBound("host_id", req.GetHostId()); err != nil {
		errs = append(errs, err)
	} else if err := store.ValidateID(req.GetHostId()); err != nil {
		errs = append(errs, &FieldError{Field: "host_id", Reason: fmt.Sprintf("%q does not match %s", req.GetHostId(), contract.IDPattern)})
	}
	fieldErrs, err := h.admit(ctx, req.GetInstanceId(), req.GetRestartPolicy(), RecordSpec(req), true)
	if err != nil {
		return err
	}
	return errors.Join(append(errs, fieldErrs...)...)
}

// AdmitRecord checks a record against the host's current policy before every
// launch, as it may predate the policy or have skipped admission; a refusal
// wraps ErrAdmissionRefused and every FieldError. The profile is not re-listed.
func (h Host) AdmitRecord(ctx context.Context, rec *vmflowv1.InstanceRecord) error {
	if rec == nil || rec.GetSpec() == nil {
		return fmt.Errorf("%w: %w", ErrAdmissionRefused, &FieldError{Field: "spec", Reason: "the record has none"})
	}
	fieldErrs, err := h.admit(ctx, rec.GetId(), rec.GetRestartPolicy(), rec.GetSpec(), false)
	if err == nil && len(fieldErrs) > 0 {
		err = errors.Join(fieldErrs...)
	}
	if err != nil {
		return fmt.Errorf("instance %s %w: %w", rec.GetId(), ErrAdmissionRefused, err)
	}
	return nil
}

// admit is the one list of admission checks, for requests and records alike;
// err is only a failure to list vGPU profiles (with listProfiles).
func (h Host) admit(ctx context.Context, id, restartPolicy string, s *vmflowv1.VMSpec, listProfiles bool) (fieldErrs []error, err error) {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &FieldError{Field: field, Reason: fmt.Sprintf(format, args...)})
	}
	// Bounds first: nothing else looks at (or resolves) an oversized value.
	for _, f := range []struct{ field, v string }{
		{"machine", s.GetMachine()}, {"accel", s.GetAccel()}, {"restart_policy", restartPolicy},
		{"kernel", s.GetKernel()}, {"initrd", s.GetInitrd()}, {"cmdline", s.GetCmdline()},
		{"disk", s.GetDisk()}, {"vgpu_profile", s.GetVgpuProfile()}, {"uuid", s.GetUuid()}, {"gpu_passthrough_model", s.GetGpuPassthroughModel()},
		{"network", s.GetNetwork()}, {"instance_id", id}, {"hugepages", s.GetHugepages()}, {"numa", s.GetNuma()},
	} {
		if err := CheckBound(f.field, f.v); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return errs, nil
	}
	if err := store.ValidateID(id); err != nil {
		bad("instance_id", "%q does not match %s", id, contract.IDPattern)
	}
	switch {
	case s.GetVcpus() == 0:
		bad("vcpus", "must be at least 1")
	case s.GetVcpus() > h.MaxVCPUs:
		bad("vcpus", "%d exceeds this host's %d CPUs", s.GetVcpus(), h.MaxVCPUs)
	case s.GetMachine() == "none" && s.GetVcpus() != 1:
		bad("vcpus", "machine \"none\" has exactly 1 vCPU")
	}
	switch {
	case s.GetMemoryMib() == 0:
		bad("memory_mib", "must be at least 1")
	case s.GetMemoryMib() > h.MaxMemoryMiB:
		bad("memory_mib", "%d exceeds this host's %d MiB", s.GetMemoryMib(), h.MaxMemoryMiB)
	}
	oneOf := func(field, v string, allowed []string, emptyOK bool) {
		if (v == "" && emptyOK) || slices.Contains(allowed, v) {
			return
		}
		bad(field, "%q is not one of %s", v, strings.Join(allowed, ", "))
	}
	oneOf("machine", s.GetMachine(), Machines, false)
	oneOf("accel", s.GetAccel(), Accels, true)
	if a := s.GetAccel(); (a == "" || a == string(vmm.AccelKVM)) && h.KVM.Err != nil {
		bad("accel", "KVM (what an empty accel means): %s; ask for accel \"tcg\" to run this VM without it (emulated: slower)",
			noKVM(h.KVM.Err))
	}
	oneOf("restart_policy", restartPolicy, RestartPolicies, true)
	oneOf("numa", s.GetNuma(), NUMAPolicies, true)
	oneOf("hugepages", s.GetHugepages(), HugepageSizes, true)
	if kib := uint32(vmm.HugepageKiB(s.GetHugepages())); kib > 0 && s.GetMemoryMib()%(kib/1024) != 0 {
		bad("memory_mib", "%d is not whole %s hugepages", s.GetMemoryMib(), s.GetHugepages())
	}
	if s.GetDedicatedCpus() && s.GetVcpus() > h.DedicatedCPUs {
		bad("dedicated_cpus", "%d vCPUs: this host offers %d dedicated CPUs (--dedicated-cpus)", s.GetVcpus(), h.DedicatedCPUs)
	}
	oneOf("network", s.GetNetwork(), Networks, true)
	if s.GetNetwork() != "" {
		switch {
		case !h.Network:
			bad("network", "%q: this host has no network (the agent runs without --net-subnet)", s.GetNetwork())
		case s.GetMachine() == string(vmm.MachineNone):
			bad("network", "machine \"none\" has no bus for a NIC")
		}
	}

	// The images are opened as a launch opens them, and handed to vmm's
	// check below (which knows which machines take a kernel or a disk).
	images := map[string]*os.File{}
	defer func() {
		for _, f := range images {
			f.Close()
		}
	}()
	for _, p := range []struct{ field, path string }{{"kernel", s.GetKernel()}, {"initrd", s.GetInitrd()}, {"disk", s.GetDisk()}} {
		if p.path == "" {
			continue
		}
		f, err := h.checkImage(p.path, p.field != "disk")
		if err != nil {
			errs = append(errs, fieldError(p.field, err))
			continue
		}
		images[p.field] = f
	}
	if s.GetInitrd() != "" && s.GetKernel() == "" {
		bad("initrd", "needs kernel")
	}
	if s.GetCmdline() != "" && s.GetKernel() == "" {
		bad("cmdline", "needs kernel")
	}
	if strings.ContainsAny(s.GetCmdline(), "\x00\n\r") {
		bad("cmdline", "must be one line of text")
	}
	if err := CheckPassthrough(s.GetVgpuProfile(), s.GetGpuPassthroughCount(), s.GetGpuPassthroughModel()); err != nil {
		errs = append(errs, err)
	} else if s.GetGpuPassthroughCount() > 0 && h.Whole == nil {
		bad("gpu_passthrough_count", "%d: this host hands out no whole GPUs (--gpu-passthrough)", s.GetGpuPassthroughCount())
	}
	switch n := s.GetVgpuCount(); {
	case n > 0 && s.GetVgpuProfile() == "":
		bad("vgpu_count", "%d needs vgpu_profile", n)
	case n > store.MaxVGPUs:
		bad("vgpu_count", "%d exceeds the %d vGPUs an instance may hold", n, store.MaxVGPUs)
	}
	if p := s.GetVgpuProfile(); p != "" && listProfiles {
		if h.Profiles == nil {
			bad("vgpu_profile", "%q: this host has no vGPUs", p)
		} else {
			offered, err := h.Profiles(ctx)
			if err != nil {
				return nil, fmt.Errorf("list vGPU profiles: %w", err)
			}
			if !slices.Contains(offered, p) {
				bad("vgpu_profile", "%q is not offered by this host (offered: %s)", p, strings.Join(offered, ", "))
			}
		}
	}
	if len(errs) == 0 {
		// vmm's own check catches what the above does not know about
		// (QEMU limits); its message names the spec field.
		v := ForRecord(&vmflowv1.InstanceRecord{Id: id, Spec: s}, nil)
		v.Kernel, v.Initrd = images["kernel"], images["initrd"]
		if base := images["disk"]; base != nil {
			v.Disk = &vmm.Disk{Base: base} // the overlay is made at launch
		}
		if err := v.Validate(); err != nil {
			bad("request", "%v", err)
		}
	}
	return errs, nil
}

// noKVM says why this host cannot run a KVM guest: no node (no vmx/svm, no
// kvm module), or a node a confined QEMU could not open.
func noKVM(err error) string {
	var ke *vmm.KVMAccessError
	if errors.As(err, &ke) && errors.Is(err, fs.ErrNotExist) {
		return "this host has no KVM (no " + ke.Path + ")"
	}
	return "this host's KVM is unusable (" + err.Error() + ")"
}

// checkImage admits an absolute, clean path under an image root that opens
// as a launch would open it (ImageRoots.Open), and returns the open file.
func (h Host) checkImage(p string, boot bool) (*os.File, error) {
	ref, err := h.Images.Locate(p)
	if err != nil {
		return nil, err
	}
	return h.Images.Open(ref, boot)
}

// instanceNamespace seeds the instance UUIDs: a fixed namespace, so the same
// id always gives the same UUID and a retried create carries the same spec.
var instanceNamespace = uuid.MustParse("6f0b2c1e-9a43-4d5e-8c6f-2a7d1b3e4f50")

// InstanceUUID is the UUID QEMU gets with -uuid for an instance id.
func InstanceUUID(instanceID string) string {
	return uuid.NewSHA1(instanceNamespace, []byte(instanceID)).String()
}

// RecordSpec is the record's copy of an admitted request.
func RecordSpec(req *vmflowv1.SpawnRequest) *vmflowv1.VMSpec {
	accel := req.GetAccel()
	if accel == "" {
		accel = string(vmm.AccelKVM)
	}
	return &vmflowv1.VMSpec{
		Vcpus:       req.GetVcpus(),
		MemoryMib:   req.GetMemoryMib(),
		Machine:     req.GetMachine(),
		Accel:       accel,
		Kernel:      req.GetKernel(),
		Initrd:      req.GetInitrd(),
		Cmdline:     req.GetCmdline(),
		Disk:        req.GetDisk(),
		VgpuProfile: req.GetVgpuProfile(),
		VgpuCount:   req.GetVgpuCount(),

		GpuPassthroughCount: req.GetGpuPassthroughCount(),
		GpuPassthroughModel: req.GetGpuPassthroughModel(),
		Uuid:                InstanceUUID(req.GetInstanceId()),
		Network:             req.GetNetwork(),
		DiskIo:              proto.CloneOf(req.GetDiskIo()),
		DedicatedCpus:       req.GetDedicatedCpus(),
		Hugepages:           req.GetHugepages(),
		Numa:                req.GetNuma(),
	}
}

// RecordSpec is the record's copy of an admitted request: RecordSpec plus each
// image's root and relative path, which every launch opens.
func (h Host) RecordSpec(req *vmflowv1.SpawnRequest) (*vmflowv1.VMSpec, error) {
	s := RecordSpec(req)
	var errs []error
	for _, im := range []struct {
		field string
		path  string
		ref   **vmflowv1.ImageRef
	}{{"kernel", s.GetKernel(), &s.KernelImage}, {"initrd", s.GetInitrd(), &s.InitrdImage}, {"disk", s.GetDisk(), &s.DiskImage}} {
		if im.path == "" {
			continue
		}
		ref, err := h.Images.Locate(im.path)
		if err != nil {
			errs = append(errs, fieldError(im.field, err))
			continue
		}
		*im.ref = ref
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return s, nil
}

// CheckPassthrough checks the request's whole-GPU fields alone (a
// *FieldError): at most store.MaxPassthrough, a vendor:device model or none,
// never beside a vGPU profile. The model must have passed CheckBound.
func CheckPassthrough(profile string, count uint32, model string) error {
	switch {
	case count > 0 && profile != "":
		return &FieldError{Field: "gpu_passthrough_count", Reason: "whole GPUs and vgpu_profile do not mix in one VM"}
	case count > store.MaxPassthrough:
		return &FieldError{Field: "gpu_passthrough_count", Reason: fmt.Sprintf("%d exceeds the %d whole GPUs an instance may hold", count, store.MaxPassthrough)}
	case model != "" && count == 0:
		return &FieldError{Field: "gpu_passthrough_model", Reason: "needs gpu_passthrough_count"}
	case model != "" && !gpu.ValidPCIID(model):
		return &FieldError{Field: "gpu_passthrough_model", Reason: fmt.Sprintf("%q is not a PCI vendor:device id in lower-case hex (10de:2335)", model)}
	}
	return nil
}
