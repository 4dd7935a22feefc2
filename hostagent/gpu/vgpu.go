// Package gpu holds every way vmflow hands a VM a GPU, at the kernel's sysfs
// ABI: vGPUs by mdev (up to Ampere) and NVIDIA's SR-IOV "vendor VFIO" (vGPU 17+, Ada and
// Hopper), and whole GPUs by VFIO passthrough (passthrough.go), as
// KubeVirt keeps mdev, vendor VFs and PCI passthrough under one gpu
// package. Drivers do plain file I/O under a sysfs root (/sys in
// production, a vgpusim mount in tests) and have no other seams, so the code
// that runs in tests is the code that runs on hardware.
//
// This package is the kernel ABI only: sysfs paths and files, placement,
// the Driver interface and its errors. It knows nothing of instance records
// or processes, and nothing of QEMU: a driver names a device by its sysfs
// path, and vmm alone turns that into QEMU's syntax.
//
// The Driver interface is deliberately small so that the claim layer
// (package lease: write the intent to the instance record, refuse a
// release while the VM or a VFIO holder lives, reconcile) can wrap it:
// CreateRequest.Intent runs under the host lock after placement and before
// the device exists, and Config.OnReleaseDone reports the outcome of every
// release write, including those that finished after every caller stopped
// waiting.
//
// Whole GPUs (passthrough.go) are the same ABI layer for VFIO passthrough:
// Passthrough lists display-class PCI functions with their IOMMU groups
// (GPUs, each with Viable, Marked, Offered), Bind hands a whole group to
// vfio-pci (BindRequest.Intent writes the lease ahead, Resume finishes a
// recorded half-done bind) and returns the Binding the lease keeps, Return
// gives a Binding back to the drivers it had; GPUFilter is
// --gpu-passthrough. Errors: ErrGroupNotViable, ErrNotGPU, ErrVGPUParent,
// ErrAlreadyBound (refusals, nothing written), ErrNotOurs (left alone),
// ErrUnbindFailed, ErrResetFailed, ErrProbeFailed (retryable), and a
// blocked unbind as ErrReleaseInProgress (Busy).
package gpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"syscall"

	"github.com/google/uuid"

	"vmflow/hostagent/topology"
	"vmflow/internal/contract"
	"vmflow/internal/errdefs"
)

// Kind names a vGPU sysfs ABI.
type Kind string

// The two ABIs.
const (
	KindMdev   Kind = "mdev"
	KindVendor Kind = "vendor"
)

// DefaultSysfsRoot is Config.SysfsRoot's default; StateDir's is
// contract.DefaultStateDir, the agent's.
const DefaultSysfsRoot = "/sys"

// Profile is one vGPU type on one physical GPU.
type Profile struct {
	// Name is exactly as the hardware names it: an mdev type's name file
	// ("GRID A100-4C") or the name half of a vendor "ID : name" line
	// ("NVIDIA L40-4Q").
	Name string `json:"name"`
	// TypeID is the mdev type directory ("nvidia-471") or the vendor type
	// id ("592").
	TypeID string `json:"type_id"`
	// Parent is the physical GPU's PCI address (for vendor VFIO, the PF).
	Parent string `json:"parent"`
	// Available is the free capacity on Parent: available_instances for
	// mdev; for vendor VFIO the number of free VFs that list the type (an
	// upper bound: the GPU's own limits apply at creation).
	Available int `json:"available"`
	// Used counts the vGPUs of any type on Parent; placement prefers the
	// least used parent.
	Used int `json:"used"`
	// PCILocality is where Parent sits, and so every vGPU on it: its
	// NUMA node and PCIe root (unknown when sysfs cannot say).
	topology.PCILocality
}

// Placement is where a device will be created.
type Placement struct {
	Profile string `json:"profile"`
	TypeID  string `json:"type_id"`
	Parent  string `json:"parent"`
	// VF is the virtual function (vendor VFIO only).
	VF string `json:"vf,omitempty"`
}

// Device is a created vGPU.
type Device struct {
	Kind Kind `json:"kind"`
	// ID names the device on this host: the mdev UUID, or the VF's PCI
	// address for vendor VFIO.
	ID string `json:"id"`
	// UUID is the vGPU's UUID: the mdev's own, or for vendor VFIO the one
	// the caller chose (sysfs does not hold it; QEMU needs it as -uuid).
	UUID    string `json:"uuid,omitempty"`
	Profile string `json:"profile,omitempty"`
	TypeID  string `json:"type_id,omitempty"`
	Parent  string `json:"parent,omitempty"`
}

// CreateRequest asks for one vGPU.
type CreateRequest struct {
	// Profile is the hardware's name for the type ("GRID A100-4C").
	Profile string
	// UUID identifies the vGPU (mdev: its name in sysfs).
	UUID string
	// At pins the placement (a recorded intent being finished after a
	// crash); nil lets the driver choose the least used parent.
	At *Placement
	// Near are NUMA nodes a new placement prefers (the node of the
	// claim's other vGPUs, so the VM's GPUs, CPUs and memory can share
	// one); with OnlyNear, the only ones it may take. Empty: any node.
	Near     []int
	OnlyNear bool
	// Intent, if set, is called under the host lock once the placement is
	// chosen and before the device is created: the place to write the
	// claim ahead. Its error aborts the create.
	Intent func(Placement) error
	// Taken, if set, is called under the host lock (the lock Intent runs
	// under, so no other placement can interleave) before the device is
	// chosen or adopted. It returns the devices (mdev UUID, vendor VF
	// address) that other instances' held claims name, each with the
	// instance naming it. Invariant 10: the create never chooses, creates
	// or adopts a device in that map (ErrClaimedByOther). Its error may
	// wrap ErrRecordsUnreadable, with the map filled from the records it
	// could read: a vendor placement, which chooses among existing VFs, then
	// refuses (an unreadable record may name any VF); a create at a name
	// the caller already owns (At, or a fresh mdev UUID) goes on with the
	// readable records (a fresh mdev placement is refused by Held). Any
	// other error refuses the create.
	Taken func(ctx context.Context) (map[string]string, error)
	// Held, if set, is called under the host lock before a placement is
	// chosen. It returns the devices (placement included) of other
	// instances' held claims, whether or not they exist now: after a
	// reboot every mdev is gone and every VF reads type 0 while the claims
	// stay held, and each must keep its slot and its parent's type
	// (reserveHeld). Its error may wrap ErrRecordsUnreadable: the placement
	// is then refused, mdev's too (see held).
	Held func(ctx context.Context) ([]Device, error)
}

// held calls req.Held before a fresh placement. Records that cannot be read
// refuse it: their claims' devices may be missing (a reboot), and only the
// records say which slots those keep.
func (req CreateRequest) held(ctx context.Context) ([]Device, error) {
	if req.Held == nil {
		return nil, nil
	}
	return req.Held(ctx)
}

// reserveHeld makes profs count held claims whose device is missing now: each
// keeps a slot of its type on its parent, and as a parent runs one type at a
// time (NVIDIA, the simulator), other types there have none.
func reserveHeld(profs []Profile, held []Device, exists map[string]bool, countSlots bool) []Profile {
	for _, h := range held {
		if exists[h.ID] {
			continue // sysfs counts it already
		}
		for i := range profs {
			p := &profs[i]
			if p.Parent != h.Parent {
				continue
			}
			switch {
			case p.TypeID != h.TypeID:
				p.Available = 0
			case countSlots:
				// The driver's availability counts devices, not the claims' VFs.
				p.Available = max(0, p.Available-1)
				p.Used++
			}
		}
	}
	return profs
}

// taken calls req.Taken. choosing: the caller picks a device among existing
// ones, so records it cannot read refuse (see CreateRequest.Taken).
func (req CreateRequest) taken(ctx context.Context, choosing bool) (map[string]string, error) {
	return readTaken(ctx, req.Taken, choosing)
}

// readTaken is the one policy for unreadable records: they refuse choosing
// among existing devices, else the readable ones decide. nil taken: none.
func readTaken(ctx context.Context, taken func(context.Context) (map[string]string, error), choosing bool) (map[string]string, error) {
	if taken == nil {
		return nil, nil
	}
	m, err := taken(ctx)
	if err != nil && (choosing || !errors.Is(err, ErrRecordsUnreadable)) {
		return nil, err
	}
	return m, nil
}

// NotClaimedByOther is invariant 10's check on a device the caller names
// (adoption, re-creation, release): ErrClaimedByOther if another's held claim
// names it; unreadable records do not refuse. nil taken: none.
func NotClaimedByOther(ctx context.Context, taken func(context.Context) (map[string]string, error), deviceID string) error {
	m, err := readTaken(ctx, taken, false)
	if err != nil {
		return err
	}
	return claimedBy(m, deviceID)
}

// claimedBy is invariant 10's one rule: a device in taken (device -> holding
// instance) is never acted on for anyone else; the error names both.
func claimedBy(taken map[string]string, deviceID string) error {
	if other, ok := taken[deviceID]; ok {
		return fmt.Errorf("device %s is named by instance %s's held claim: %w", deviceID, other, ErrClaimedByOther)
	}
	return nil
}

// Driver creates, lists and releases vGPUs of one Kind.
type Driver interface {
	Kind() Kind
	// Profiles lists every type on every parent with its free capacity.
	Profiles(ctx context.Context) ([]Profile, error)
	// Devices lists the vGPUs that exist now.
	Devices(ctx context.Context) ([]Device, error)
	// Create places and creates a vGPU under the host-wide lock.
	Create(ctx context.Context, req CreateRequest) (Device, error)
	// Release removes a vGPU. "Already gone" is success. ctx bounds the
	// wait, not the write: see ReleaseInProgressError.
	Release(ctx context.Context, dev Device) error
	// DevicePath is dev's directory in sysfs: what QEMU's vfio-pci device
	// opens (vmm writes the option) and where its iommu_group link is.
	DevicePath(dev Device) string
}

// Errors callers branch on. Kernel errnos stay reachable too:
// errors.Is(err, syscall.EBUSY) works on every error from this package.
var (
	// ErrReleaseInProgress: a release write is still running (modern
	// kernels block mdev remove while a VFIO user holds the device). Retry.
	ErrReleaseInProgress = errdefs.Busy.New("vgpu: release in progress")
	// ErrNoCapacity: no parent can take another vGPU of the profile.
	ErrNoCapacity = errdefs.NoCapacity.New("vgpu: no capacity")
	// ErrUnknownProfile: no parent offers a type with that name.
	ErrUnknownProfile = errdefs.NoCapacity.New("vgpu: unknown profile")
	// ErrDeviceMismatch: the device in sysfs is not the one described (a
	// vendor VF now runs another type), so it is left alone.
	ErrDeviceMismatch = errdefs.Unavailable.New("vgpu: device mismatch")
	// ErrInvalid: a malformed UUID, PCI address or request.
	ErrInvalid = errdefs.Internal.New("vgpu: invalid argument")
	// ErrClaimedByOther: another instance's held claim names the device
	// (invariant 10), so it is neither placed on, adopted, re-created nor
	// released. Not retryable as is: two records naming one device need an
	// operator.
	ErrClaimedByOther = errdefs.ClaimedTwice.New("vgpu: device claimed by another instance")
	// ErrRecordsUnreadable: some instance record could not be read, and it
	// may name the device a vendor placement would choose. Retry once the
	// record is readable (or quarantined away).
	ErrRecordsUnreadable = errdefs.Unavailable.New("vgpu: instance records unreadable")
)

// Errno returns the kernel errno inside err, if any.
func Errno(err error) (syscall.Errno, bool) {
	var e syscall.Errno
	if errors.As(err, &e) {
		return e, true
	}
	return 0, false
}

// Config configures a driver.
type Config struct {
	// SysfsRoot is where sysfs is mounted (default /sys).
	SysfsRoot string
	// StateDir holds the host-wide placement lock file (default
	// /var/lib/vmflow).
	StateDir string
	// Kind forces an ABI; empty detects it (see Detect).
	Kind Kind
	// OnReleaseDone is called once for every release write when it
	// returns, with its outcome (nil on success), from the goroutine that
	// made the write. It must not block for long. It lets a later layer
	// record the outcome even when every caller stopped waiting.
	OnReleaseDone func(dev Device, err error)
}

// WithDefaults is c with every empty field that has a default set to it.
func (c Config) WithDefaults() Config {
	if c.SysfsRoot == "" {
		c.SysfsRoot = DefaultSysfsRoot
	}
	if c.StateDir == "" {
		c.StateDir = contract.DefaultStateDir
	}
	return c
}

// Detect picks the ABI of the host under sysfsRoot: mdev when
// class/mdev_bus has parents, vendor VFIO otherwise.
func Detect(sysfsRoot string) (Kind, error) {
	if sysfsRoot == "" {
		sysfsRoot = DefaultSysfsRoot
	}
	ents, err := os.ReadDir(filepath.Join(sysfsRoot, "class", "mdev_bus"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("vgpu: detect: %w", err)
	}
	if len(ents) > 0 {
		return KindMdev, nil
	}
	return KindVendor, nil
}

// New returns the driver for cfg.Kind, detecting it when empty.
func New(cfg Config) (Driver, error) {
	cfg = cfg.WithDefaults()
	kind := cfg.Kind
	if kind == "" {
		k, err := Detect(cfg.SysfsRoot)
		if err != nil {
			return nil, err
		}
		kind = k
	}
	switch kind {
	case KindMdev:
		return NewMdev(cfg), nil
	case KindVendor:
		return NewVendor(cfg), nil
	default:
		return nil, fmt.Errorf("vgpu: kind %q: %w", kind, ErrInvalid)
	}
}

// pciAddr is a PCI address as sysfs names it; checked before it becomes
// part of a path.
var pciAddr = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

// canonicalUUID returns the lower-case canonical form, as sysfs names mdevs.
func canonicalUUID(s string) (string, error) {
	if len(s) != 36 {
		return "", fmt.Errorf("uuid %q: %w", s, ErrInvalid)
	}
	u, err := uuid.Parse(s)
	if err != nil {
		return "", fmt.Errorf("uuid %q: %w: %w", s, ErrInvalid, err)
	}
	return u.String(), nil
}
