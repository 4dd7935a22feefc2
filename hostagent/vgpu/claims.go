package vgpu

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
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Errors a release refusal carries; both are retryable.
var (
	// ErrVMAlive: the instance's VM may still run (its thread group is not
	// confirmed gone; "can't tell" counts as alive). Invariant 2.
	ErrVMAlive = errors.New("vgpu: VM may still be running")
	// ErrDeviceHeld: a process has the device's VFIO node open, or may
	// have it (its descriptors could not be read).
	ErrDeviceHeld = errors.New("vgpu: device held open")
	// ErrClaimConflict: the instance already claims another profile.
	ErrClaimConflict = errors.New("vgpu: instance already claims another vGPU")
)

// DefaultOrphanGrace is how long an unclaimed device must stay unclaimed
// before reconcile removes it.
const DefaultOrphanGrace = 5 * time.Minute

// ClaimsConfig configures Claims.
type ClaimsConfig struct {
	Driver Config
	Store  *store.Store
	// DevRoot holds the VFIO nodes (<DevRoot>/vfio/<iommu group>).
	DevRoot string
	// OrphanGrace: see DefaultOrphanGrace.
	OrphanGrace time.Duration
	Logger      *zap.Logger
	// Optional: when no vGPU sysfs is found, NewClaims returns nil, nil
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
	drv     Driver
	st      *store.Store
	devRoot string
	sysfs   string
	ledger  string
	grace   time.Duration
	ignore  []int
	log     *zap.Logger
	now     func() time.Time
}

// NewClaims sets up the driver and the claims over st.
func NewClaims(cfg ClaimsConfig) (*Claims, error) {
	if cfg.Store == nil {
		return nil, fmt.Errorf("vgpu claims: %w: no store", ErrInvalid)
	}
	c := &Claims{
		st: cfg.Store, devRoot: cfg.DevRoot, grace: cfg.OrphanGrace, ignore: cfg.IgnoreUninspectable,
		log: cfg.Logger, now: cfg.Now,
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
	dc := cfg.Driver.withDefaults()
	c.sysfs = dc.SysfsRoot
	c.ledger = filepath.Join(cfg.Store.StateDir(), "vgpu-unclaimed.json")
	dc.OnReleaseDone = c.releaseDone
	drv, err := New(dc)
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
func (c *Claims) Driver() Driver { return c.drv }

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

// DevicePath is the sysfs path QEMU's vfio-pci device opens for a claim.
func (c *Claims) DevicePath(claim *vmflowv1.GpuClaim) string {
	return strings.TrimPrefix(c.drv.QEMUDeviceArg(deviceOf(claim, c.drv.Kind())), "vfio-pci,sysfsdev=")
}

func deviceOf(claim *vmflowv1.GpuClaim, kind Kind) Device {
	d := Device{Kind: kind, UUID: claim.GetUuid(), Profile: claim.GetProfile(), TypeID: claim.GetTypeId(), Parent: claim.GetParent()}
	if claim.GetDriver() != "" {
		d.Kind = Kind(claim.GetDriver())
	}
	d.ID = claim.GetDeviceId()
	if d.ID == "" {
		d.ID = claim.GetUuid()
	}
	return d
}

// Claim gives instance id a vGPU of profile. The claim's intent (profile,
// placement, UUID) is in the record before the device is created, then the
// claim is marked active. Idempotent: an active claim of the same profile
// is returned; an intent left by a crash is finished at its recorded
// placement.
func (c *Claims) Claim(ctx context.Context, id, profile string) (*vmflowv1.GpuClaim, error) {
	l, err := c.st.Lock(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, err)
	}
	defer l.Unlock()
	rec, err := l.Get()
	if err != nil {
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, err)
	}
	switch rec.GetState() {
	case vmflowv1.InstanceState_INSTANCE_STATE_DELETING, vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED:
		return nil, fmt.Errorf("claim vGPU for %s: %w", id, store.ErrDeleting)
	}
	req := CreateRequest{Profile: profile}
	if store.ClaimHeld(rec) {
		have := rec.GetGpuClaim()
		if have.GetProfile() != profile {
			return nil, fmt.Errorf("claim %q for %s: %w (%q)", profile, id, ErrClaimConflict, have.GetProfile())
		}
		if have.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE {
			return have, nil
		}
		// An intent whose device may or may not exist: finish it where it
		// was placed, under the same UUID.
		req.UUID = have.GetUuid()
		req.At = &Placement{Profile: profile, TypeID: have.GetTypeId(), Parent: have.GetParent(), VF: have.GetDeviceId()}
		if exists, err := c.exists(ctx, deviceOf(have, c.drv.Kind())); err == nil && exists {
			return c.activate(l, deviceOf(have, c.drv.Kind()))
		}
	} else {
		req.UUID = uuid.NewString()
		req.Intent = func(pl Placement) error {
			_, err := l.Update(func(r *vmflowv1.InstanceRecord) error {
				r.GpuClaim = &vmflowv1.GpuClaim{
					Profile: pl.Profile, Parent: pl.Parent, TypeId: pl.TypeID, Uuid: req.UUID, DeviceId: pl.VF,
					Phase: vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, ClaimedAt: timestamppb.New(c.now()), Driver: string(c.drv.Kind()),
				}
				return nil
			})
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

func (c *Claims) activate(l *store.Locked, dev Device) (*vmflowv1.GpuClaim, error) {
	rec, err := l.Update(func(r *vmflowv1.InstanceRecord) error {
		cl := r.GetGpuClaim()
		if cl == nil {
			return fmt.Errorf("claim of %s vanished from its record", l.ID())
		}
		cl.DeviceId, cl.Phase = dev.ID, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		if dev.Parent != "" {
			cl.Parent = dev.Parent
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("activate claim of %s: %w", l.ID(), err)
	}
	crashpoint.Hit(crashpoint.ClaimActivated)
	c.log.Info("vGPU claimed", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID), zap.String("profile", dev.Profile))
	return rec.GetGpuClaim(), nil
}

func (c *Claims) exists(ctx context.Context, d Device) (bool, error) {
	devs, err := c.drv.Devices(ctx)
	if err != nil {
		return false, err
	}
	for _, have := range devs {
		if have.ID == d.ID && (d.Kind != KindVendor || have.TypeID == d.TypeID) {
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
	claim := rec.GetGpuClaim()
	dev := deviceOf(claim, c.drv.Kind())
	if err := c.mayRelease(ctx, rec, dev); err != nil {
		c.recordFailure(l, err)
		return false, dev.ID, err
	}
	if _, err := l.Update(func(r *vmflowv1.InstanceRecord) error {
		r.GetGpuClaim().Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING
		return nil
	}); err != nil {
		return false, dev.ID, err
	}
	crashpoint.Hit(crashpoint.ReleaseReleasing)
	if err := c.drv.Release(ctx, dev); err != nil {
		c.recordFailure(l, err)
		return false, dev.ID, err
	}
	crashpoint.Hit(crashpoint.ReleaseWritten)
	if _, err := l.Update(func(r *vmflowv1.InstanceRecord) error {
		r.GetGpuClaim().ReleasedAt = timestamppb.New(c.now())
		r.GetGpuClaim().LastReleaseError = ""
		if r.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED {
			r.State = vmflowv1.InstanceState_INSTANCE_STATE_DELETING
		}
		return nil
	}); err != nil {
		// The device is gone but the record still holds the claim: the next
		// release finds it "already gone" and records it then.
		return false, dev.ID, fmt.Errorf("record release of %s: %w", dev.ID, err)
	}
	crashpoint.Hit(crashpoint.ReleaseRecorded)
	c.log.Info("vGPU released", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID))
	return true, dev.ID, nil
}

// mayRelease is invariant 2: the VM's whole thread group must be confirmed
// gone, and nothing may hold the device's VFIO node.
func (c *Claims) mayRelease(ctx context.Context, rec *vmflowv1.InstanceRecord, dev Device) error {
	if p := rec.GetProcess(); p != nil {
		pid := store.IdentityOf(p)
		if st := proc.Inspect(pid); st.Alive {
			return fmt.Errorf("%w: %v is %s with %d tasks", ErrVMAlive, pid, st.State, st.Tasks)
		}
	}
	node, err := c.vfioNode(dev)
	if err != nil {
		return err
	}
	if node == "" {
		return nil // the device is gone: nothing can hold it
	}
	hs, err := proc.Holders(ctx, node)
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
func (c *Claims) vfioNode(dev Device) (string, error) {
	var link string
	switch dev.Kind {
	case KindVendor:
		link = filepath.Join(c.sysfs, "bus", "pci", "devices", dev.ID, "iommu_group")
	default:
		link = filepath.Join(c.sysfs, "bus", "mdev", "devices", dev.ID, "iommu_group")
	}
	target, err := os.Readlink(link)
	if errors.Is(err, os.ErrNotExist) {
		if dev.Kind == KindVendor {
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

func (c *Claims) recordFailure(l *store.Locked, cause error) {
	_, err := l.Update(func(r *vmflowv1.InstanceRecord) error {
		cl := r.GetGpuClaim()
		cl.ReleaseAttempts++
		cl.LastReleaseError = cause.Error()
		if cl.GetPhase() == vmflowv1.ClaimPhase_CLAIM_PHASE_RELEASING {
			cl.Phase = vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE
		}
		r.LastError = "release vGPU: " + cause.Error()
		if r.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_DELETING {
			r.State = vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED
		}
		return nil
	})
	if err != nil {
		c.log.Error("record release failure", zap.String("instance_id", l.ID()), zap.Error(err), zap.NamedError("cause", cause))
	}
}

// releaseDone records the outcome of a release write that returned after
// every caller stopped waiting (a blocked mdev remove), so the record says
// what happened even if no one asks again.
func (c *Claims) releaseDone(dev Device, err error) {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		recs, lerr := c.st.List()
		if lerr != nil && len(recs) == 0 {
			return
		}
		for _, r := range recs {
			cl := r.GetGpuClaim()
			if !store.ClaimHeld(r) || deviceOf(cl, c.drv.Kind()).ID != dev.ID {
				continue
			}
			if err != nil {
				// The next Release receives this outcome from the driver
				// and records it then.
				return
			}
			_, uerr := c.st.Update(ctx, r.GetId(), func(r *vmflowv1.InstanceRecord) error {
				if r.GetGpuClaim() != nil && r.GetGpuClaim().GetReleasedAt() == nil {
					r.GetGpuClaim().ReleasedAt = timestamppb.New(c.now())
				}
				if r.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED {
					r.State = vmflowv1.InstanceState_INSTANCE_STATE_DELETING
				}
				return nil
			})
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
	if listErr != nil {
		// An unreadable record might claim any device: removing orphans
		// now could take a GPU from under it.
		c.log.Warn("reconcile: unreadable records, orphans left alone", zap.Error(listErr))
	}
	claimed := map[string]bool{}
	for _, r := range recs {
		if cl := r.GetGpuClaim(); cl != nil {
			claimed[deviceOf(cl, c.drv.Kind()).ID] = true
		}
	}
	for _, r := range recs {
		if !store.ClaimHeld(r) {
			continue
		}
		switch r.GetState() {
		case vmflowv1.InstanceState_INSTANCE_STATE_DELETING, vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED:
		default:
			res.Skipped++ // a spawn or a restart owns it
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
		if claimed[d.ID] {
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
		if err := c.mayRelease(ctx, &vmflowv1.InstanceRecord{}, d); err != nil {
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
	tmp := c.ledger + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("reconcile ledger: %w", err)
	}
	if err := os.Rename(tmp, c.ledger); err != nil {
		return fmt.Errorf("reconcile ledger: %w", err)
	}
	return nil
}
