package gpu

// ReleaseWaiters is how many callers wait on the release write in flight
// for dev (0 when none is in flight): a test sees a second caller join the
// write rather than guess when its goroutine got there.
func ReleaseWaiters(drv Driver, dev Device) int {
	var r *releases
	switch d := drv.(type) {
	case *MdevDriver:
		r = d.releases
	case *VendorDriver:
		r = d.releases
	default:
		return 0
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if op := r.inflight[releaseKey(dev)]; op != nil {
		return op.waiters
	}
	return 0
}
