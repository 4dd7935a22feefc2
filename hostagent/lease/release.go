package lease

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Release releases every vGPU instance id holds, through the engine
// (Engine.Release): each refused while the VM may live (ErrVMAlive) or its
// VFIO node is held (ErrDeviceHeld). A failure keeps that lease and moves
// to ReleaseFailed (invariant 1); the others are released all the same.
// released: every held vGPU lease is released now.
func (c *Claims) Release(ctx context.Context, id string) (released bool, devices []string, err error) {
	out, err := c.eng.Release(ctx, id, store.KindVGPU)
	for _, l := range out.Released {
		devices = append(devices, store.ClaimDevice(l.GetVgpu()))
	}
	return out.All, devices, err
}

// vgpuDriver is the engine's driver of vGPU leases (mdev or vendor VF,
// as the host's gpu.Driver makes them).
type vgpuDriver struct{ c *Claims }

var _ Driver = vgpuDriver{}

// LeaseDriver is the engine's driver of the vGPU leases these claims make.
func (c *Claims) LeaseDriver() Driver { return vgpuDriver{c} }

func (d vgpuDriver) Kind() string { return store.KindVGPU }

func (d vgpuDriver) Owned(ctx context.Context, id string, l *vmflowv1.Lease) error {
	return d.c.ownDevice(ctx, id, l)
}

func (d vgpuDriver) Nodes(_ context.Context, l *vmflowv1.Lease) ([]string, error) {
	n, err := d.c.vfioNode(deviceOf(l, d.c.drv.Kind()))
	return []string{n}, err
}

// Release removes the vGPU; one already gone is released (the driver's
// rule), and a write still in flight is ErrReleaseInProgress (Busy).
func (d vgpuDriver) Release(ctx context.Context, _ string, l *vmflowv1.Lease) error {
	return d.c.drv.Release(ctx, deviceOf(l, d.c.drv.Kind()))
}

func (d vgpuDriver) Devices(l *vmflowv1.Lease) []string {
	return []string{quarantineKey(deviceOf(l, d.c.drv.Kind()))}
}

func (d vgpuDriver) Points() ReleasePoints {
	return ReleasePoints{Releasing: crashpoint.ReleaseReleasing, Done: crashpoint.ReleaseWritten, Recorded: crashpoint.ReleaseRecorded}
}

// holdersFunc answers who holds a path: proc.Holders (a fresh walk of
// /proc, before a release) or one FDScan shared by a scan's items.
type holdersFunc func(ctx context.Context, path string) ([]proc.Holder, error)

// vmGone is the VM's half of invariant 2: rec's whole thread group must be
// confirmed gone (store.MayQEMULive, an unproven absence counting as
// alive), else ErrVMAlive.
func vmGone(st *store.Store, rec *vmflowv1.InstanceRecord) error {
	// QEMU creates its QMP socket while it sets up its backends, before it
	// opens any VFIO device, and both files stay until TearDown, which runs
	// after the release: without them (and no start or exit recorded) the
	// instance never launched.
	launched := func() (bool, error) {
		paths, err := st.Paths(rec.GetId())
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
	return nil
}

// deviceFree is the device's half of invariant 2: nothing holds its VFIO
// node (asked of holders); a device that is gone is free.
func (c *Claims) deviceFree(ctx context.Context, dev gpu.Device, holders holdersFunc) error {
	node, err := c.vfioNode(dev)
	if err != nil {
		return err
	}
	return nodeFree(ctx, node, holders, c.ignore)
}

// nodeFree: nothing holds the VFIO node (pids in ignore whose descriptors
// cannot be read excepted); "" is a node that is gone, and free.
func nodeFree(ctx context.Context, node string, holders holdersFunc, ignore []int) error {
	if node == "" {
		return nil // the device is gone: nothing can hold it
	}
	hs, err := holders(ctx, node)
	if err != nil {
		return fmt.Errorf("%w: cannot tell who holds %s: %w", ErrDeviceHeld, node, err)
	}
	var held []string
	for _, h := range hs {
		if h.Uncertain && slices.Contains(ignore, h.PID) {
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
func (c *Claims) vfioNode(dev gpu.Device) (string, error) {
	link := filepath.Join(gpu.DevicePath(c.sysfs, dev), "iommu_group")
	target, err := os.Readlink(link)
	if errors.Is(err, os.ErrNotExist) {
		if dev.Kind == gpu.KindVendor {
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

// recordTimeout bounds writing down an outcome that already happened
// (a failure's count), whatever deadline the step itself had.
const recordTimeout = 10 * time.Second

// deviceFault reports whether err, from a device's own step (a create,
// bind, unbind, reset, rebind or remove), is the device's failure: not a
// write still in flight or a deadline that ended a wait (Busy, a context
// error), which is no failure of the device's; not a device that is gone
// (NotFound: the card there now, if any, is another device and inherits
// nothing); and not a refusal, which never reaches the device's step.
func deviceFault(err error) bool {
	if err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	c := errdefs.ClassOf(err)
	return c != errdefs.Busy && c != errdefs.NotFound
}

// stateMayRemain reports a failure after which the device may still hold
// what its last tenant left (its reset or the operator's scrub failed):
// quarantined at once.
func stateMayRemain(err error) bool {
	return errors.Is(err, gpu.ErrResetFailed) || errors.Is(err, ErrScrubFailed)
}

// strikeIfFault counts err against devices when it is their fault
// (deviceFault), quarantining those at the threshold: the one place a
// failure becomes a quarantine (at once when the device's state may
// remain). cards names the card each device is, where a reboot may swap
// it (nil: not known). Its error is the quarantine's own (the count could
// not be written), already logged.
func strikeIfFault(ctx context.Context, q *Quarantine, log *zap.Logger, id string, err error, devices, cards []string) error {
	if !deviceFault(err) {
		return nil
	}
	// Counted even when the caller's deadline is what ended the step: the
	// failure happened, and the quarantine's lock is brief.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	added, qerr := q.strike(ctx, stateMayRemain(err), id, err.Error(), devices, cards)
	switch {
	case qerr != nil:
		log.Error("count a GPU failure toward quarantine", zap.String("instance_id", id), zap.Strings("device_ids", devices), zap.Error(qerr))
	case len(added) > 0:
		log.Warn("GPU quarantined: placement skips it until an operator clears it (vmflow-hostagent devices clear)",
			zap.String("instance_id", id), zap.Strings("device_ids", added), zap.NamedError("cause", err))
	}
	return qerr
}

// succeeded ends devices' runs of failures after a step of theirs went
// through.
func succeeded(ctx context.Context, q *Quarantine, log *zap.Logger, devices ...string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	if err := q.Succeeded(ctx, devices...); err != nil {
		log.Warn("reset a GPU's failure count", zap.Strings("device_ids", devices), zap.Error(err))
	}
}

// releaseDone records a release write that returned after every caller
// stopped waiting (a blocked mdev remove), so the record says what happened.
func (c *Claims) releaseDone(dev gpu.Device, err error) {
	if err != nil {
		return // the next Release receives this outcome from the driver and records it then
	}
	go c.recordLateRelease(dev)
}

// recordLateRelease marks released the held lease of dev: its device and
// its UUID, since a vendor VF may be another instance's claim by now.
func (c *Claims) recordLateRelease(dev gpu.Device) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	recs, lerr := c.st.List()
	if lerr != nil && len(recs) == 0 {
		return
	}
	for _, r := range recs {
		i := slices.IndexFunc(store.HeldVGPUs(r), func(l *vmflowv1.Lease) bool {
			d := deviceOf(l, c.drv.Kind())
			return d.ID == dev.ID && d.UUID == dev.UUID
		})
		if i < 0 {
			continue
		}
		lease := store.HeldVGPUs(r)[i]
		_, uerr := c.st.Apply(ctx, r.GetId(), store.LeaseReleased(store.LeaseName(lease), c.now()))
		if errors.Is(uerr, store.ErrNotFound) || errors.Is(uerr, fs.ErrNotExist) || errors.Is(uerr, store.ErrIllegalTransition) {
			// The waiting caller recorded it first, or the record is gone
			// since: nothing left to say.
			return
		}
		if uerr != nil {
			c.log.Warn("record late release", zap.String("instance_id", r.GetId()), zap.Error(uerr))
		}
		return
	}
}
