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

// Release releases every vGPU instance id holds, each refused while the VM
// may live (ErrVMAlive) or its VFIO node is held (ErrDeviceHeld). A failure
// keeps that lease and moves to ReleaseFailed (invariant 1); the others are
// released all the same. released: every held lease is released now.
func (c *Claims) Release(ctx context.Context, id string) (released bool, devices []string, err error) {
	l, rec, err := lockToRelease(ctx, c.st, id, "vGPUs")
	if l == nil || err != nil {
		return false, nil, err
	}
	defer l.Unlock()
	held := store.HeldVGPUs(rec)
	var errs []error
	for _, lease := range held {
		dev, err := c.releaseLocked(ctx, l, rec, lease)
		if err != nil {
			errs = append(errs, fmt.Errorf("vGPU %s: %w", dev, err))
			continue
		}
		devices = append(devices, dev)
	}
	return len(held) > 0 && len(errs) == 0, devices, errors.Join(errs...)
}

// releaseLocked releases one held vGPU lease of the locked instance rec.
func (c *Claims) releaseLocked(ctx context.Context, l *store.Locked, rec *vmflowv1.InstanceRecord, lease *vmflowv1.Lease) (string, error) {
	name := store.LeaseName(lease)
	dev := deviceOf(lease, c.drv.Kind())
	// Invariant 10 first: a device another claim names is not ours to
	// release, whatever sysfs says about it.
	err := c.ownDevice(ctx, l.ID(), lease)
	if err == nil {
		err = c.mayRelease(ctx, rec, dev, proc.Holders)
	}
	if err != nil {
		c.recordFailure(l, name, err)
		return dev.ID, err
	}
	if _, err := l.Apply(store.LeaseReleasing(name)); err != nil {
		return dev.ID, err
	}
	crashpoint.Hit(crashpoint.ReleaseReleasing)
	if err := c.drv.Release(ctx, dev); err != nil {
		c.recordFailure(l, name, err)
		strikeIfFault(ctx, c.quar, c.log, l.ID(), err, quarantineKey(dev))
		return dev.ID, err
	}
	crashpoint.Hit(crashpoint.ReleaseWritten)
	succeeded(ctx, c.quar, c.log, quarantineKey(dev))
	if _, err := l.Apply(store.LeaseReleased(name, c.now())); err != nil {
		// The device is gone but the record still holds the claim: the next
		// release finds it "already gone" and records it then.
		return dev.ID, fmt.Errorf("record release of %s: %w", dev.ID, err)
	}
	crashpoint.Hit(crashpoint.ReleaseRecorded)
	c.log.Info("vGPU released", zap.String("instance_id", l.ID()), zap.String("device_id", dev.ID))
	return dev.ID, nil
}

// holdersFunc answers who holds a path: proc.Holders (a fresh walk of
// /proc, before a release) or one FDScan shared by a scan's items.
type holdersFunc func(ctx context.Context, path string) ([]proc.Holder, error)

// mayRelease is invariant 2: the VM's group confirmed gone (an unproven
// absence counts as alive) and nothing holding the device's VFIO node.
func (c *Claims) mayRelease(ctx context.Context, rec *vmflowv1.InstanceRecord, dev gpu.Device, holders holdersFunc) error {
	if err := vmGone(c.st, rec); err != nil {
		return err
	}
	return c.deviceFree(ctx, dev, holders)
}

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
// error), which is no failure of the device's, and not a refusal, which
// never reaches the device's step.
func deviceFault(err error) bool {
	if err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	return errdefs.ClassOf(err) != errdefs.Busy
}

// strikeIfFault counts err against devices when it is their fault
// (deviceFault), quarantining those at the threshold: the one place a
// failure becomes a quarantine.
func strikeIfFault(ctx context.Context, q *Quarantine, log *zap.Logger, id string, err error, devices ...string) {
	if !deviceFault(err) {
		return
	}
	// Counted even when the caller's deadline is what ended the step: the
	// failure happened, and the quarantine's lock is brief.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	added, qerr := q.Strike(ctx, id, err.Error(), devices...)
	switch {
	case qerr != nil:
		log.Error("count a GPU failure toward quarantine", zap.String("instance_id", id), zap.Strings("device_ids", devices), zap.Error(qerr))
	case len(added) > 0:
		log.Warn("GPU quarantined: placement skips it until an operator clears it (vmflow-hostagent devices clear)",
			zap.String("instance_id", id), zap.Strings("device_ids", added), zap.NamedError("cause", err))
	}
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

func (c *Claims) recordFailure(l *store.Locked, name string, cause error) {
	_, err := l.Apply(store.LeaseReleaseFailed(name, cause.Error()))
	if err != nil {
		c.log.Error("record release failure", zap.String("instance_id", l.ID()), zap.Error(err), zap.NamedError("cause", cause))
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
