package supervise

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
)

// instance is this process's view of one instance. The record on disk is
// the truth; this holds what cannot be on disk (the open VM, the timer).
//
// Work on one instance is serialised by two layers, and only these two:
//
//   - The store's lock file (store.Lock, a flock) guards the record and the
//     instance's files: every check-then-act on them runs under it, against
//     every other goroutine and every other agent process on the state dir.
//     Store-only work (create, claim, begin delete, release, delete record)
//     takes it alone.
//   - This struct's op slot and stopping flag are the one in-process layer,
//     for the work that also touches in-memory state (vm, timer): Launch,
//     Stop, TearDown, Existing, the re-attach, the exit watcher and a
//     restart take op first, then the store lock, so they run one at a time
//     and always in that lock order, and the watcher sees a VM a Stop or
//     Launch already handled as no longer current. stopping makes a second
//     Stop fail fast instead of queueing a second ladder.
//
// Either layer failing within the caller's context is the same error,
// store.ErrBusy, which the activities report as a retryable Busy.
type instance struct {
	id  string
	log *zap.Logger
	// op is a one-slot semaphore (see above).
	op chan struct{}
	// stopping is set while a Stop runs (see above).
	stopping atomic.Bool

	mu          sync.Mutex
	vm          *vmm.VM     // the live VM this process watches, nil if none
	timer       *time.Timer // a pending restart
	restartGen  uint64      // bumped to cancel a pending restart
	nextRestart time.Time
}

// instance returns the in-memory state of id, creating it on first use.
func (s *Supervisor) instance(id string) (*instance, error) {
	if err := store.ValidateID(id); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	in, ok := s.insts[id]
	if !ok {
		in = &instance{id: id, log: s.log.With(zap.String("instance_id", id)), op: make(chan struct{}, 1)}
		s.insts[id] = in
	}
	return in, nil
}

func (s *Supervisor) lookup(id string) *instance {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.insts[id]
}

// acquire takes the instance's operation slot, or store.ErrBusy when ctx ends
// first: to a caller a held slot and a held store lock are the same "busy".
func (in *instance) acquire(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("instance %s: %w: %w", in.id, store.ErrBusy, err)
	}
	select {
	case in.op <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("instance %s: %w: %w", in.id, store.ErrBusy, ctx.Err())
	}
}

func (in *instance) release() { <-in.op }

// current returns the watched VM if it is the process id names.
func (in *instance) current(id proc.Identity) *vmm.VM {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.vm != nil && in.vm.Identity() == id {
		return in.vm
	}
	return nil
}

func (in *instance) isCurrent(vm *vmm.VM) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.vm == vm
}

// setVM makes vm the watched VM.
func (in *instance) setVM(vm *vmm.VM) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.vm = vm
}

// clearVM forgets vm (if it is still the watched one). Its watcher closes it.
func (in *instance) clearVM(vm *vmm.VM) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.vm == vm {
		in.vm = nil
	}
}

func (in *instance) cancelRestart() {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.restartGen++
	if in.timer != nil {
		in.timer.Stop()
		in.timer = nil
	}
	in.nextRestart = time.Time{}
}

func unlock(l *store.Locked, log *zap.Logger) {
	if err := l.Unlock(); err != nil {
		log.Warn("unlock instance", zap.Error(err))
	}
}
