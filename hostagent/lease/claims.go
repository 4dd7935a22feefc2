// Package lease is the lease engine: it keeps a VM's GPU leases (vGPUs over
// a gpu.Driver, whole GPUs over gpu.Passthrough) in the instance records: a
// lease's intent is written before its device is made and kept until its
// release is confirmed; a release is refused while the VM or a VFIO holder
// may live (invariant 2); a device another instance's held lease names is
// never touched (invariant 10); and Reconcile and Scan finish or undo what a
// crash left. It joins the store and proc to the kernel ABI of package gpu,
// which knows neither.
package lease

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Errors a release refusal carries; both are retryable.
var (
	// ErrVMAlive: the instance's VM may still run (its thread group is not
	// confirmed gone; "can't tell" counts as alive). Invariant 2.
	ErrVMAlive = errdefs.StillAlive.New("vgpu: VM may still be running")
	// ErrDeviceHeld: a process has the device's VFIO node open, or may
	// have it (its descriptors could not be read).
	ErrDeviceHeld = errdefs.Busy.New("vgpu: device held open")
	// ErrClaimConflict: the instance already claims another profile.
	ErrClaimConflict = errdefs.Conflict.New("vgpu: instance already claims another vGPU")
	// ErrClaimDeviceMissing: an active claim's device is gone (a host
	// reboot removes mdevs and resets VF types) and could not be
	// re-created; the error names the instance, profile and device.
	ErrClaimDeviceMissing = errdefs.DeviceMissing.New("vgpu: claimed device missing")
	// ErrClaimNotActive: the claim is held but not active (an intent whose
	// spawn has not finished claiming, or a release under way), so there
	// is no device to launch with yet.
	ErrClaimNotActive = errdefs.DeviceMissing.New("vgpu: claim not active")
)

// DefaultOrphanGrace is how long an unclaimed device must stay unclaimed
// before reconcile removes it.
const DefaultOrphanGrace = 5 * time.Minute

// Config configures Claims.
type Config struct {
	Driver gpu.Config
	Store  *store.Store
	// DevRoot holds the VFIO nodes (<DevRoot>/vfio/<iommu group>).
	DevRoot string
	// OrphanGrace: see DefaultOrphanGrace.
	OrphanGrace time.Duration
	Logger      *zap.Logger
	// Optional: when no vGPU sysfs is found, New returns nil, nil
	// (a host without vGPUs) instead of an error.
	Optional bool
	// IgnoreUninspectable lists pids whose open files cannot be read and
	// that are known not to hold VFIO devices (a sandbox's own init, more
	// privileged than the agent). Any other uninspectable process blocks a
	// release. Empty in production, where the agent has CAP_SYS_PTRACE.
	IgnoreUninspectable []int
	// Now stamps records and the orphan ledger (time.Now when nil).
	Now func() time.Time
	// Quarantine, if set, takes a device whose release failed K times
	// (a vendor VF, an mdev's parent GPU) out of placement.
	Quarantine *Quarantine
}

// Claims keeps vGPU claims in the instance records: written ahead of the
// device's creation and kept until its release is confirmed, so a crash at
// any instant leaves either a claim that reconcile can finish or undo, or
// nothing; never a device no record knows, and never a record deleted while
// its GPU is still allocated (invariant 1: the store refuses too).
type Claims struct {
	drv     gpu.Driver
	st      *store.Store
	devRoot string
	sysfs   string
	ledger  string
	grace   time.Duration
	ignore  []int
	log     *zap.Logger
	now     func() time.Time
	seen    scanSeen // Scan's own first sightings of unclaimed devices
	scanFDs func(context.Context) (*proc.FDScan, error)
	quar    *Quarantine
	// eng runs the protocol for the vGPU leases these claims make (its
	// one driver is LeaseDriver): Release is the engine's.
	eng *Engine
}

// WithDefaults is c with every zero field that has a default set to it.
func (c Config) WithDefaults() Config {
	if c.DevRoot == "" {
		c.DevRoot = "/dev"
	}
	if c.OrphanGrace <= 0 {
		c.OrphanGrace = DefaultOrphanGrace
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	c.Driver = c.Driver.WithDefaults()
	return c
}

// New sets up the driver and the claims over cfg.Store.
func New(cfg Config) (*Claims, error) {
	if cfg.Store == nil {
		return nil, fmt.Errorf("vgpu claims: %w: no store", gpu.ErrInvalid)
	}
	cfg = cfg.WithDefaults()
	c := &Claims{
		st: cfg.Store, devRoot: cfg.DevRoot, grace: cfg.OrphanGrace, ignore: cfg.IgnoreUninspectable,
		log: cfg.Logger, now: cfg.Now, scanFDs: proc.ScanFDs, quar: cfg.Quarantine,
	}
	dc := cfg.Driver
	c.sysfs = dc.SysfsRoot
	c.ledger = filepath.Join(cfg.Store.StateDir(), "vgpu-unclaimed.json")
	dc.OnReleaseDone = c.releaseDone
	drv, err := gpu.New(dc)
	if err != nil {
		if cfg.Optional {
			c.log.Info("no vGPUs on this host", zap.String("sysfs_root", dc.SysfsRoot), zap.Error(err))
			return nil, nil
		}
		return nil, err
	}
	c.drv = drv
	c.eng = NewEngine(EngineConfig{Store: cfg.Store, Quarantine: cfg.Quarantine, IgnoreUninspectable: cfg.IgnoreUninspectable, Logger: cfg.Logger, Now: cfg.Now})
	c.eng.Register(c.LeaseDriver())
	return c, nil
}

// Driver is the driver the claims use.
func (c *Claims) Driver() gpu.Driver { return c.drv }

// Profiles lists the profile names the host offers, each once (a driver
// that can name them without reading what is free does: admission asks
// only whether a name is offered).
func (c *Claims) Profiles(ctx context.Context) ([]string, error) {
	if n, ok := c.drv.(interface {
		ProfileNames(context.Context) ([]string, error)
	}); ok {
		return n.ProfileNames(ctx)
	}
	ps, err := c.drv.Profiles(ctx)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, p := range ps {
		if !slices.Contains(names, p.Name) {
			names = append(names, p.Name)
		}
	}
	return names, nil
}

// DevicePath is the sysfs path QEMU's vfio-pci device opens for a vGPU
// lease.
func (c *Claims) DevicePath(claim *vmflowv1.Lease) string {
	return c.drv.DevicePath(deviceOf(claim, c.drv.Kind()))
}

// quarantineKey is the device a failed vGPU release quarantines: the VF
// (vendor VFIO), else the mdev's parent GPU (an mdev UUID is never reused).
func quarantineKey(dev gpu.Device) string {
	if dev.Kind == gpu.KindVendor {
		return dev.ID
	}
	return dev.Parent
}

func deviceOf(lease *vmflowv1.Lease, kind gpu.Kind) gpu.Device {
	claim := lease.GetVgpu()
	d := gpu.Device{Kind: kind, UUID: claim.GetUuid(), Profile: claim.GetProfile(), TypeID: claim.GetTypeId(), Parent: claim.GetParent()}
	if claim.GetDriver() != "" {
		d.Kind = gpu.Kind(claim.GetDriver())
	}
	d.ID = store.ClaimDevice(claim)
	return d
}

// lockToClaim locks instance id for a claim of what ("vGPU", "whole GPU")
// and reads its record, refusing one being deleted. The caller unlocks.
func lockToClaim(ctx context.Context, st *store.Store, id, what string) (*store.Locked, *vmflowv1.InstanceRecord, error) {
	l, err := st.Lock(ctx, id)
	if err != nil {
		return nil, nil, fmt.Errorf("claim %s for %s: %w", what, id, err)
	}
	rec, err := l.Get()
	if err == nil && store.IsDeleting(rec) {
		err = store.ErrDeleting
	}
	if err != nil {
		l.Unlock()
		return nil, nil, fmt.Errorf("claim %s for %s: %w", what, id, err)
	}
	return l, rec, nil
}

// lockToRelease locks instance id for a release and reads its record; a
// record that is gone is (nil, nil, nil): nothing to release. The caller
// unlocks a non-nil lock.
func lockToRelease(ctx context.Context, st *store.Store, id, what string) (*store.Locked, *vmflowv1.InstanceRecord, error) {
	l, err := st.Lock(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("release %s of %s: %w", what, id, err)
	}
	rec, err := l.Get()
	if err != nil {
		l.Unlock()
		if errors.Is(err, store.ErrNotFound) {
			return nil, nil, nil
		}
		return nil, nil, err
	}
	return l, rec, nil
}
