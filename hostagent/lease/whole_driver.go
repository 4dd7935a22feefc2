package lease

import (
	"context"

	"go.uber.org/zap"

	"vmflow/hostagent/store"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// wholeDriver is the engine's driver of whole-GPU leases: a group handed
// to vfio-pci, given back by a reset and a return to the drivers its
// functions had.
type wholeDriver struct{ w *Whole }

var _ Driver = wholeDriver{}

// LeaseDriver is the engine's driver of the whole-GPU leases w makes.
func (w *Whole) LeaseDriver() Driver { return wholeDriver{w} }

func (d wholeDriver) Kind() string { return store.KindPassthrough }

func (d wholeDriver) Owned(ctx context.Context, id string, l *vmflowv1.Lease) error {
	return d.w.ownGroup(ctx, id, l)
}

// Nodes is the VFIO node of the lease's group, read live (the kernel may
// renumber groups across a reboot); none when its card is gone.
func (d wholeDriver) Nodes(_ context.Context, l *vmflowv1.Lease) ([]string, error) {
	node, err := d.w.nodeOf(l)
	return []string{node}, err
}

// Release resets and returns every function of the group to its recorded
// driver, then runs the operator's scrub (scrubbed); a function that no longer holds the lease's card (removed, or
// another card there since a reboot) counts as returned; an unbind still
// in flight is ErrReleaseInProgress (Busy).
func (d wholeDriver) Release(ctx context.Context, id string, l *vmflowv1.Lease) error {
	if err := d.w.drv.Return(ctx, bindingOf(l), d.w.quarantineOnReset(ctx, id, store.PassthroughGPUs(l), leaseCards(l))...); err != nil {
		return err
	}
	if node, err := d.w.nodeOf(l); err == nil && node == "" {
		d.w.log.Info("whole GPU released: its card is no longer at its address (removed, or another card there since a reboot)",
			zap.String("instance_id", id), zap.Strings("device_ids", store.PassthroughDevices(l)))
		return nil
	}
	return d.w.scrubbed(ctx, id, l)
}

func (d wholeDriver) Devices(l *vmflowv1.Lease) []string { return store.PassthroughGPUs(l) }

// cards: a reboot may put another card at a GPU's address, whose
// failures are its own.
func (d wholeDriver) cards(l *vmflowv1.Lease) []string { return leaseCards(l) }

func (d wholeDriver) Points() ReleasePoints {
	return ReleasePoints{Releasing: crashpoint.PassthroughReleasing, Done: crashpoint.PassthroughReturned, Recorded: crashpoint.PassthroughReleased}
}
