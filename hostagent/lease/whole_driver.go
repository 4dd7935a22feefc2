package lease

import (
	"context"

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

func (d wholeDriver) Nodes(_ context.Context, l *vmflowv1.Lease) ([]string, error) {
	return []string{d.w.drv.VFIONode(l.GetGpuPassthrough().GetIommuGroup())}, nil
}

// Release resets and returns every function of the group to its recorded
// driver; an unbind still in flight is ErrReleaseInProgress (Busy).
func (d wholeDriver) Release(ctx context.Context, _ string, l *vmflowv1.Lease) error {
	return d.w.drv.Return(ctx, bindingOf(l))
}

func (d wholeDriver) Devices(l *vmflowv1.Lease) []string { return wholeGPUs(l) }

func (d wholeDriver) Points() ReleasePoints {
	return ReleasePoints{Releasing: crashpoint.PassthroughReleasing, Done: crashpoint.PassthroughReturned, Recorded: crashpoint.PassthroughReleased}
}
