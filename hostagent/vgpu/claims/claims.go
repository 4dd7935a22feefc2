// Package claims keeps vGPU claims in the instance records, over a
// vgpu.Driver: a claim's intent is written before its device is created and
// kept until its release is confirmed; a release is refused while the VM or
// a VFIO holder may live (invariant 2); a device another instance's held
// claim names is never touched (invariant 10); and Reconcile and Scan
// finish or undo what a crash left. It joins the store and proc to the
// kernel ABI of package vgpu, which knows neither.
package claims

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"go.uber.org/zap"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vgpu"
	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
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
	Driver vgpu.Config
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
}

// Claims keeps vGPU claims in the instance records: written ahead of the
// device's creation and kept until its release is confirmed, so a crash at
// any instant leaves either a claim that reconcile can finish or undo, or
// nothing; never a device no record knows, and never a record deleted while
// its GPU is still allocated (invariant 1: the store refuses too).
type Claims struct {
	drv     vgpu.Driver
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
}

// New sets up the driver and the claims over cfg.Store.
func New(cfg Config) (*Claims, error) {
	if cfg.Store == nil {
		return nil, fmt.Errorf("vgpu claims: %w: no store", vgpu.ErrInvalid)
	}
	c := &Claims{
		st: cfg.Store, devRoot: cfg.DevRoot, grace: cfg.OrphanGrace, ignore: cfg.IgnoreUninspectable,
		log: cfg.Logger, now: cfg.Now, scanFDs: proc.ScanFDs,
	}
	if c.devRoot == "" {
		c.devRoot = "/dev"
	}
	if c.grace <= 0 {
		c.grace = DefaultOrphanGrace
	}
	if c.log == nil {
		c.log = zap.NewNop()
	}
	if c.now == nil {
		c.now = time.Now
	}
	dc := cfg.Driver.WithDefaults()
	c.sysfs = dc.SysfsRoot
	c.ledger = filepath.Join(cfg.Store.StateDir(), "vgpu-unclaimed.json")
	dc.OnReleaseDone = c.releaseDone
	drv, err := vgpu.New(dc)
	if err != nil {
		if cfg.Optional {
			c.log.Info("no vGPUs on this host", zap.String("sysfs_root", dc.SysfsRoot), zap.Error(err))
			return nil, nil
		}
		return nil, err
	}
	c.drv = drv
	return c, nil
}

// Driver is the driver the claims use.
func (c *Claims) Driver() vgpu.Driver { return c.drv }

// Profiles lists the profile names the host offers, each once.
func (c *Claims) Profiles(ctx context.Context) ([]string, error) {
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

func deviceOf(lease *vmflowv1.Lease, kind vgpu.Kind) vgpu.Device {
	claim := lease.GetVgpu()
	d := vgpu.Device{Kind: kind, UUID: claim.GetUuid(), Profile: claim.GetProfile(), TypeID: claim.GetTypeId(), Parent: claim.GetParent()}
	if claim.GetDriver() != "" {
		d.Kind = vgpu.Kind(claim.GetDriver())
	}
	d.ID = store.ClaimDevice(claim)
	return d
}

// Claim gives instance id a vGPU of profile. The claim's intent (profile,
// placement, UUID) is in the record before the device is created, then the
// claim is marked active. Idempotent: an active claim of the same profile
// is returned; an intent left by a crash is finished at its recorded
// placement.
func (c *Claims) Claim(ctx context.Context, id, profile string) (*vmflowv1.Lease, error) {
	l, err := c.st.Lock(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, err)
	}
	defer l.Unlock()
	rec, err := l.Get()
	if err != nil {
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, err)
	}
	if store.IsDeleting(rec) {
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, store.ErrDeleting)
	}
	req := vgpu.CreateRequest{Profile: profile, Taken: c.takenBy(id), Held: c.heldBy(id)}
	if store.ClaimHeld(rec) {
		have := store.VGPU(rec)
		if p := have.GetVgpu().GetProfile(); p != profile {
			return nil, fmt.Errorf("claim %q for %s: %w (%q)", profile, id, ErrClaimConflict, p)
		}
		if have.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			return c.ensureActive(ctx, l, have)
		}
		// An intent whose device may or may not exist: finish it where it
		// was placed, under the same UUID, if the device is its own.
		dev := deviceOf(have, c.drv.Kind())
		if err := c.ownDevice(ctx, id, dev); err != nil {
			return nil, fmt.Errorf("claim %q for %s: %w", profile, id, err)
		}
		req.UUID = have.GetVgpu().GetUuid()
		req.At = placementOf(have)
		if exists, err := c.exists(ctx, dev); err == nil && exists {
			return c.activate(l, dev)
		}
	} else {
		req.UUID = uuid.NewString()
		req.Intent = func(pl vgpu.Placement) error {
			_, err := l.Apply(store.LeaseIntent(store.VGPULease(&vmflowv1.VgpuLease{
				Profile: pl.Profile, Parent: pl.Parent, TypeId: pl.TypeID, Uuid: req.UUID, DeviceId: pl.VF, Driver: string(c.drv.Kind()),
			}), c.now()))
			crashpoint.Hit(crashpoint.ClaimIntentWritten)
			return err
		}
	}
	dev, err := c.drv.Create(ctx, req)
	if err != nil {
		// The intent stays: a held claim whose device never came to be is
		// released as "already gone" by the delete path or reconcile.
		return nil, fmt.Errorf("claim %q for %s: %w", profile, id, err)
	}
	crashpoint.Hit(crashpoint.ClaimDeviceCreated)
	return c.activate(l, dev)
}

// EnsureDeviceLocked makes the locked instance's held claim launchable: for
// an ACTIVE claim it checks that the device exists and is the claim's own
// (no other instance's held claim names it: ErrClaimedByOther; for vendor
// VFIO, the VF runs the claim's type) and, when the device is missing (a
// host reboot removes mdevs and resets VF types), re-creates it under the
// same UUID (mdev) or on the same VF with the same type (vendor). It
// returns the claim, or an error wrapping ErrClaimDeviceMissing (naming the
// instance, profile and device) when the re-creation failed. No held claim:
// (nil, nil). A held claim that is not active: ErrClaimNotActive. Call it
// under the instance lock before every launch and restart.
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

// placementOf is where a recorded vGPU lease was placed.
func placementOf(lease *vmflowv1.Lease) *vgpu.Placement {
	cl := lease.GetVgpu()
	return &vgpu.Placement{Profile: cl.GetProfile(), TypeID: cl.GetTypeId(), Parent: cl.GetParent(), VF: cl.GetDeviceId()}
}

// heldDevices is the record ledger of invariant 10: every device a held
// claim names (whatever its phase and the record's state: intent, active,
// releasing, release-failed), mapped to the instance naming it, except
// self's own claim.
func heldDevices(recs []*vmflowv1.InstanceRecord, self string, kind vgpu.Kind) map[string]string {
	m := map[string]string{}
	for _, r := range recs {
		if r.GetId() == self || !store.ClaimHeld(r) {
			continue
		}
		m[deviceOf(store.VGPU(r), kind).ID] = r.GetId()
	}
	return m
}

// takenBy reads the ledger for vgpu.CreateRequest.Taken: the devices held by
// instances other than self. When records cannot be read the map holds the
// readable ones and the error wraps vgpu.ErrRecordsUnreadable.
func (c *Claims) takenBy(self string) func(context.Context) (map[string]string, error) {
	return func(context.Context) (map[string]string, error) {
		recs, err := c.st.List()
		bad, listed := store.Unreadable(err)
		n := len(bad)
		if !listed {
			return nil, fmt.Errorf("vgpu: read claims: %w", err)
		}
		m := heldDevices(recs, self, c.drv.Kind())
		if n > 0 {
			// The records' errors are quoted, not wrapped: they are other
			// instances' troubles, and a caller branching on
			// store.ErrInvalidRecord must not take them for its own.
			return m, fmt.Errorf("%w: %d record(s): %s", vgpu.ErrRecordsUnreadable, n, strings.ReplaceAll(err.Error(), "\n", "; "))
		}
		return m, nil
	}
}

// heldBy reads the records for vgpu.CreateRequest.Held: the devices of
// the held claims of instances other than self, with their placements.
func (c *Claims) heldBy(self string) func(context.Context) ([]vgpu.Device, error) {
	return func(context.Context) ([]vgpu.Device, error) {
		recs, err := c.st.List()
		bad, listed := store.Unreadable(err)
		if !listed {
			return nil, fmt.Errorf("vgpu: read claims: %w", err)
		}
		var out []vgpu.Device
		for _, r := range recs {
			if r.GetId() != self && store.ClaimHeld(r) {
				out = append(out, deviceOf(store.VGPU(r), c.drv.Kind()))
			}
		}
		if len(bad) > 0 {
			return out, fmt.Errorf("%w: %d record(s)", vgpu.ErrRecordsUnreadable, len(bad))
		}
		return out, nil
	}
}

// ownDevice refuses (ErrClaimedByOther, naming both instances) when another
// instance's held claim names dev: release, adoption and re-creation act
// only on the claim's own device. A record that cannot be read does not
// refuse here: placement never puts a claim on a device while a record is
// unreadable, so one cannot name a device id's held claim has named since
// it was placed.
func (c *Claims) ownDevice(ctx context.Context, id string, dev vgpu.Device) error {
	err := vgpu.NotClaimedByOther(ctx, c.takenBy(id), dev.ID)
	if errors.Is(err, vgpu.ErrClaimedByOther) {
		return fmt.Errorf("instance %s: %w", id, err)
	}
	return err
}

func (c *Claims) activate(l *store.Locked, dev vgpu.Device) (*vmflowv1.Lease, error) {
	rec, err := l.Apply(store.VGPUActive(dev.ID, dev.Parent))
	if err != nil {
		return nil, fmt.Errorf("activate claim of %s: %w", l.ID(), err)
	}
	crashpoint.Hit(crashpoint.ClaimActivated)
	c.log.Info("vGPU claimed", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID), zap.String("profile", dev.Profile))
	return store.VGPU(rec), nil
}

func (c *Claims) exists(ctx context.Context, d vgpu.Device) (bool, error) {
	devs, err := c.drv.Devices(ctx)
	if err != nil {
		return false, err
	}
	for _, have := range devs {
		// A VF running another type, or an mdev of another type under the
		// same UUID, is not the claim's device.
		if have.ID == d.ID && (d.TypeID == "" || have.TypeID == d.TypeID) {
			return true, nil
		}
	}
	return false, nil
}

// Release releases instance id's vGPU. It refuses while the VM may live
// (ErrVMAlive) or anything holds the device's VFIO node (ErrDeviceHeld). A
// failed release keeps the claim, counts the attempt, records the error and
// moves the record to ReleaseFailed; a later Release retries from the
// record. released is false when the instance holds no claim.
func (c *Claims) Release(ctx context.Context, id string) (released bool, deviceID string, err error) {
	l, err := c.st.Lock(ctx, id)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return false, "", nil
		}
		return false, "", fmt.Errorf("release vGPU of %s: %w", id, err)
	}
	defer l.Unlock()
	return c.releaseLocked(ctx, l)
}

func (c *Claims) releaseLocked(ctx context.Context, l *store.Locked) (bool, string, error) {
	rec, err := l.Get()
	if errors.Is(err, store.ErrNotFound) {
		return false, "", nil
	}
	if err != nil {
		return false, "", err
	}
	if !store.ClaimHeld(rec) {
		return false, "", nil
	}
	lease := store.VGPU(rec)
	name := store.LeaseName(lease)
	dev := deviceOf(lease, c.drv.Kind())
	// Invariant 10 first: a device another claim names is not ours to
	// release, whatever sysfs says about it.
	err = c.ownDevice(ctx, l.ID(), dev)
	if err == nil {
		err = c.mayRelease(ctx, rec, dev, proc.Holders)
	}
	if err != nil {
		c.recordFailure(l, name, err)
		return false, dev.ID, err
	}
	if _, err := l.Apply(store.LeaseReleasing(name)); err != nil {
		return false, dev.ID, err
	}
	crashpoint.Hit(crashpoint.ReleaseReleasing)
	if err := c.drv.Release(ctx, dev); err != nil {
		c.recordFailure(l, name, err)
		return false, dev.ID, err
	}
	crashpoint.Hit(crashpoint.ReleaseWritten)
	if _, err := l.Apply(store.LeaseReleased(name, c.now())); err != nil {
		// The device is gone but the record still holds the claim: the next
		// release finds it "already gone" and records it then.
		return false, dev.ID, fmt.Errorf("record release of %s: %w", dev.ID, err)
	}
	crashpoint.Hit(crashpoint.ReleaseRecorded)
	c.log.Info("vGPU released", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID))
	return true, dev.ID, nil
}

// holdersFunc answers who holds a path: proc.Holders (a fresh walk of
// /proc, before a release) or one FDScan shared by a scan's items.
type holdersFunc func(ctx context.Context, path string) ([]proc.Holder, error)

// mayRelease is invariant 2: the VM's whole thread group must be confirmed
// gone (store.MayQEMULive, with an unproven absence counting as alive),
// and nothing may hold the device's VFIO node (deviceFree).
func (c *Claims) mayRelease(ctx context.Context, rec *vmflowv1.InstanceRecord, dev vgpu.Device, holders holdersFunc) error {
	// QEMU creates its QMP socket while it sets up its backends, before it
	// opens any VFIO device, and both files stay until TearDown, which runs
	// after the release: without them (and no start or exit recorded) the
	// instance never launched.
	launched := func() (bool, error) {
		paths, err := c.st.Paths(rec.GetId())
		if err != nil {
			return false, err
		}
		for _, f := range []string{paths.Socket, paths.PID} {
			if _, err := os.Lstat(f); err == nil {
				return true, nil
			} else if !errors.Is(err, os.ErrNotExist) {
				return false, err
			}
		}
		return false, nil
	}
	if err := store.MayQEMULive(rec, true, launched); err != nil {
		return fmt.Errorf("%w: %w", ErrVMAlive, err)
	}
	return c.deviceFree(ctx, dev, holders)
}

// deviceFree is the device's half of invariant 2: nothing holds its VFIO
// node (asked of holders); a device that is gone is free.
func (c *Claims) deviceFree(ctx context.Context, dev vgpu.Device, holders holdersFunc) error {
	node, err := c.vfioNode(dev)
	if err != nil {
		return err
	}
	if node == "" {
		return nil // the device is gone: nothing can hold it
	}
	hs, err := holders(ctx, node)
	if err != nil {
		return fmt.Errorf("%w: cannot tell who holds %s: %w", ErrDeviceHeld, node, err)
	}
	var held []string
	for _, h := range hs {
		if h.Uncertain && slices.Contains(c.ignore, h.PID) {
			continue
		}
		held = append(held, h.String())
	}
	if len(held) > 0 {
		return fmt.Errorf("%w: %s: %s", ErrDeviceHeld, node, strings.Join(held, "; "))
	}
	return nil
}

// vfioNode is <DevRoot>/vfio/<iommu group> of the device, or "" when the
// device no longer exists.
func (c *Claims) vfioNode(dev vgpu.Device) (string, error) {
	link := filepath.Join(vgpu.DevicePath(c.sysfs, dev), "iommu_group")
	target, err := os.Readlink(link)
	if errors.Is(err, os.ErrNotExist) {
		if dev.Kind == vgpu.KindVendor {
			if _, serr := os.Stat(filepath.Dir(link)); serr == nil {
				// The VF exists without an IOMMU group: cannot tell.
				return "", fmt.Errorf("%w: %s has no iommu_group", ErrDeviceHeld, dev.ID)
			}
		}
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("%w: %s: %w", ErrDeviceHeld, link, err)
	}
	return filepath.Join(c.devRoot, "vfio", filepath.Base(target)), nil
}

func (c *Claims) recordFailure(l *store.Locked, name string, cause error) {
	_, err := l.Apply(store.LeaseReleaseFailed(name, cause.Error()))
	if err != nil {
		c.log.Error("record release failure", zap.String("instance_id", l.ID()), zap.Error(err), zap.NamedError("cause", cause))
	}
}

// releaseDone records the outcome of a release write that returned after
// every caller stopped waiting (a blocked mdev remove), so the record says
// what happened even if no one asks again.
func (c *Claims) releaseDone(dev vgpu.Device, err error) {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		recs, lerr := c.st.List()
		if lerr != nil && len(recs) == 0 {
			return
		}
		for _, r := range recs {
			lease := store.VGPU(r)
			if !store.LeaseHeld(lease) || deviceOf(lease, c.drv.Kind()).ID != dev.ID {
				continue
			}
			if err != nil {
				// The next Release receives this outcome from the driver
				// and records it then.
				return
			}
			_, uerr := c.st.Apply(ctx, r.GetId(), store.LeaseReleased(store.LeaseName(lease), c.now()))
			if uerr != nil {
				c.log.Warn("record late release", zap.String("instance_id", r.GetId()), zap.Error(uerr))
			}
			return
		}
	}()
}

// Reconcile runs one round over the host, under each instance's lock:
// claims of instances being deleted whose VM is confirmed gone are
// released; devices no record claims, unclaimed for longer than the grace
// period (measured from when this agent first saw them, persisted) and held
// by nobody, are removed; everything a spawn or a restart owns, or whose VM
// is alive or ambiguous, is left alone.
func (c *Claims) Reconcile(ctx context.Context) (*vmflowv1.ReconcileVGPUResult, error) {
	res := &vmflowv1.ReconcileVGPUResult{}
	recs, listErr := c.st.List()
	bad, listed := store.Unreadable(listErr)
	unreadable := len(bad)
	if !listed {
		return res, fmt.Errorf("reconcile: list records: %w", listErr)
	}
	res.UnreadableRecords = uint32(unreadable)
	if listErr != nil {
		// An unreadable record might claim any device: removing orphans
		// now could take a GPU from under it.
		c.log.Warn("reconcile: unreadable records, orphans left alone", zap.Int("unreadable_records", unreadable), zap.Error(listErr))
	}
	claimed := heldDevices(recs, "", c.drv.Kind())
	for _, r := range recs {
		switch roundFor(r) {
		case roundNone:
			continue
		case roundWake:
			res.RetriedDeletes = append(res.RetriedDeletes, r.GetId())
			continue
		case roundOwned:
			res.Skipped++
			continue
		}
		released, dev, err := c.Release(ctx, r.GetId())
		switch {
		case err != nil:
			res.Failed++
			c.log.Info("reconcile: claim not released", zap.String("instance_id", r.GetId()), zap.String("device_id", dev), zap.Error(err))
		case released:
			crashpoint.Hit(crashpoint.ReconcileReleased)
			res.ClaimsReleased++
			res.RetriedDeletes = append(res.RetriedDeletes, r.GetId())
		}
	}
	if listErr != nil {
		return res, nil
	}
	devs, err := c.drv.Devices(ctx)
	if err != nil {
		return res, fmt.Errorf("reconcile: list devices: %w", err)
	}
	seen, err := c.loadLedger()
	if err != nil {
		return res, err
	}
	now := c.now()
	next := map[string]time.Time{}
	for _, d := range devs {
		if _, ok := claimed[d.ID]; ok {
			continue
		}
		first, ok := seen[d.ID]
		if !ok {
			first = now
		}
		if now.Sub(first) < c.grace {
			next[d.ID] = first
			res.Skipped++
			continue
		}
		if err := c.deviceFree(ctx, d, proc.Holders); err != nil {
			next[d.ID] = first
			res.Skipped++
			c.log.Info("reconcile: orphan held, left alone", zap.String("device_id", d.ID), zap.Error(err))
			continue
		}
		if err := c.drv.Release(ctx, d); err != nil {
			next[d.ID] = first
			res.Failed++
			c.log.Warn("reconcile: orphan removal failed", zap.String("device_id", d.ID), zap.Error(err))
			continue
		}
		res.OrphansRemoved++
		c.log.Info("reconcile: orphan removed", zap.String("device_id", d.ID), zap.Duration("unclaimed_for", now.Sub(first)))
	}
	if err := c.saveLedger(next); err != nil {
		return res, err
	}
	return res, nil
}

// roundAction is what a reconcile round does with one record's vGPU lease.
type roundAction int

const (
	roundNone  roundAction = iota // no vGPU lease
	roundOwned                    // held by a live instance: a spawn or a restart owns it
	// roundWake: released, but its delete may still wait out a backoff:
	// the round that released it (a predecessor, or the delete's own) may
	// have died before the wake-up was sent. Waking it again is harmless;
	// never waking it leaves the record for up to 15 minutes.
	roundWake
	roundRelease // held by a deleting instance: release it (if mayRelease)
)

// roundFor is the one reading, for Reconcile and Scan alike, of what a
// round does with rec: only a delete's lease is ever released.
func roundFor(rec *vmflowv1.InstanceRecord) roundAction {
	l := store.VGPU(rec)
	switch {
	case l == nil:
		return roundNone
	case !store.IsDeleting(rec):
		if store.LeaseHeld(l) {
			return roundOwned
		}
		return roundNone
	case store.LeaseHeld(l):
		return roundRelease
	}
	return roundWake
}

// The ledger of devices seen unclaimed, and since when, survives agent
// restarts so the grace period is not restarted by one.
func (c *Claims) loadLedger() (map[string]time.Time, error) {
	b, err := os.ReadFile(c.ledger)
	if errors.Is(err, os.ErrNotExist) {
		return map[string]time.Time{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reconcile ledger: %w", err)
	}
	m := map[string]time.Time{}
	if err := json.Unmarshal(b, &m); err != nil {
		// A torn ledger only delays orphan removal by one grace period.
		c.log.Warn("reconcile ledger unreadable, starting over", zap.Error(err))
		return map[string]time.Time{}, nil
	}
	return m, nil
}

func (c *Claims) saveLedger(m map[string]time.Time) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	// Durable like a record: a power cut must not restart the grace period
	// of every orphan, nor leave an empty ledger.
	if err := fsx.WriteFile(c.ledger, b, nil); err != nil {
		return fmt.Errorf("reconcile ledger: %w", err)
	}
	return nil
}
