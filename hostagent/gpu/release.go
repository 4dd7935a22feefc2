package gpu

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// ReleaseInProgressError is returned when the caller's context ended while
// a release write was still running. The write cannot be cancelled (a
// blocked write(2) ignores Go contexts: modern kernels block mdev remove
// while a VFIO user holds the device), so it goes on in the background; a
// later Release joins it or receives its outcome. errors.Is(err,
// ErrReleaseInProgress) is true.
type ReleaseInProgressError struct {
	Device Device
	// Since is when the write started.
	Since time.Time
	// Cause is why the caller stopped waiting (its context's error).
	Cause error
}

func (e *ReleaseInProgressError) Error() string {
	return fmt.Sprintf("vgpu: release of %s %s in progress since %s (stopped waiting: %v)",
		e.Device.Kind, e.Device.ID, e.Since.UTC().Format(time.RFC3339), e.Cause)
}

// Is matches ErrReleaseInProgress and its class, but not the context error:
// the caller's deadline is not the release's failure.
func (e *ReleaseInProgressError) Is(target error) bool {
	return errors.Is(ErrReleaseInProgress, target)
}

// releaseOp is one release write in flight.
type releaseOp struct {
	done    chan struct{} // closed when the write returned; err is then set
	err     error
	waiters int // callers currently waiting on done
	since   time.Time
}

// releases is the registry of in-flight release writes, one per device.
type releases struct {
	onDone func(Device, error)

	mu       sync.Mutex
	inflight map[string]*releaseOp
	// unclaimed holds outcomes of writes that returned while nobody
	// waited; the next Release of the device receives it.
	unclaimed map[string]error
}

func newReleases(onDone func(Device, error)) *releases {
	return &releases{onDone: onDone, inflight: map[string]*releaseOp{}, unclaimed: map[string]error{}}
}

// key names a device; the UUID is part of it so that a vendor VF reused by
// a new vGPU never inherits the old one's outcome.
func releaseKey(d Device) string { return string(d.Kind) + "/" + d.ID + "/" + d.UUID }

// forget drops an unclaimed outcome (a new device with the same key exists).
func (r *releases) forget(d Device) {
	r.mu.Lock()
	delete(r.unclaimed, releaseKey(d))
	r.mu.Unlock()
}

// do runs write for dev unless one is already in flight, and waits for it
// while ctx allows.
func (r *releases) do(ctx context.Context, dev Device, write func() error) error {
	key := releaseKey(dev)
	r.mu.Lock()
	if err, ok := r.unclaimed[key]; ok {
		delete(r.unclaimed, key)
		r.mu.Unlock()
		return err
	}
	op := r.inflight[key]
	if op == nil {
		op = &releaseOp{done: make(chan struct{}), since: time.Now()}
		r.inflight[key] = op
		go r.run(key, dev, op, write)
	}
	op.waiters++
	r.mu.Unlock()
	return r.wait(ctx, dev, op)
}

// settle waits, as do does, for a write for dev still in flight, and
// drops an outcome nobody received: afterwards the caller reads the state
// the kernel shows and the next do starts a write of its own.
func (r *releases) settle(ctx context.Context, dev Device) error {
	key := releaseKey(dev)
	r.mu.Lock()
	delete(r.unclaimed, key)
	op := r.inflight[key]
	if op == nil {
		r.mu.Unlock()
		return nil
	}
	op.waiters++
	r.mu.Unlock()
	err := r.wait(ctx, dev, op)
	var inProgress *ReleaseInProgressError
	if errors.As(err, &inProgress) {
		return err
	}
	return nil
}

// wait waits for op, which counts the caller among its waiters.
func (r *releases) wait(ctx context.Context, dev Device, op *releaseOp) error {
	select {
	case <-op.done:
		return op.err
	case <-ctx.Done():
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-op.done:
		// Finished while we were giving up: run saw us waiting and
		// did not keep the outcome, so it is ours to return.
		return op.err
	default:
	}
	op.waiters--
	return &ReleaseInProgressError{Device: dev, Since: op.since, Cause: ctx.Err()}
}

func (r *releases) run(key string, dev Device, op *releaseOp, write func() error) {
	err := write()
	r.mu.Lock()
	op.err = err
	delete(r.inflight, key)
	if op.waiters == 0 {
		r.unclaimed[key] = err
	}
	close(op.done)
	r.mu.Unlock()
	if r.onDone != nil {
		r.onDone(dev, err)
	}
}
