package supervise

import (
	"context"
	"errors"
	"fmt"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Bounds of Existing: it answers "what is there" for a caller that must
// not wait on somebody else's operation, so it never waits long.
const (
	// existingWait bounds the wait for the instance's slot and lock.
	existingWait = 500 * time.Millisecond
	// existingQMPTimeout bounds the query-status round trip.
	existingQMPTimeout = 2 * time.Second
)

// Existing reports, touching nothing, whether instance id runs as a spawn asks
// (a re-sent spawn, invariant 9): AlreadyRunning only when Running, alive by
// identity and QMP says "running"; otherwise ErrNotRunningAsAsked saying what
// is there (never waiting on a held lock), or store.ErrNotFound.
func (s *Supervisor) Existing(ctx context.Context, id string) (LaunchResult, error) {
	start := time.Now()
	in, err := s.instance(id)
	if err != nil {
		return LaunchResult{}, fmt.Errorf("existing: %w", err)
	}
	notAsAsked := func(format string, a ...any) (LaunchResult, error) {
		return LaunchResult{}, fmt.Errorf("instance %s: %w: %s", id, ErrNotRunningAsAsked, fmt.Sprintf(format, a...))
	}
	if err := ctx.Err(); err != nil {
		return LaunchResult{}, fmt.Errorf("existing: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, existingWait)
	defer cancel()
	if err := in.acquire(wctx); err != nil {
		return notAsAsked("launch in progress (another operation on the instance is running)")
	}
	defer in.release()
	l, err := s.st.Lock(wctx, id)
	if errors.Is(err, store.ErrBusy) {
		return notAsAsked("launch in progress (the instance is locked by another operation)")
	}
	if err != nil {
		return LaunchResult{}, fmt.Errorf("existing: %w", err)
	}
	defer unlock(l, in.log)

	rec, err := l.Get()
	if errors.Is(err, store.ErrNotFound) {
		return LaunchResult{}, fmt.Errorf("existing: %w", err)
	}
	if err != nil {
		return LaunchResult{}, fmt.Errorf("instance %s: %w: record unreadable: %w", id, ErrNotRunningAsAsked, err)
	}
	state := rec.GetState()
	switch {
	case rec.GetLaunchStartedAt() != nil:
		return notAsAsked("launch in progress (started at %s)", rec.GetLaunchStartedAt().AsTime().Format(time.RFC3339))
	case store.IsDeleting(rec):
		return notAsAsked("being deleted (state %s)", store.StateName(state))
	case rec.GetProcess() == nil && state == vmflowv1.InstanceState_INSTANCE_STATE_EXITED:
		return notAsAsked("exited (last exit: %s)", lastExit(rec))
	case rec.GetProcess() == nil:
		return notAsAsked("no process (state %s)", store.StateName(state))
	}

	pid := store.IdentityOf(rec.GetProcess())
	vm := in.current(pid)
	if vm == nil {
		// Not watched here (Start has not run, or the watch ended): look
		// through a temporary handle that Close gives back.
		vm, err = vmm.Attach(pid, vmmPaths(l.Paths()))
		switch {
		case errors.Is(err, proc.ErrNotFound), errors.Is(err, proc.ErrIdentityMismatch):
			return notAsAsked("exited (%v is gone; last exit: %s)", pid, lastExit(rec))
		case err != nil:
			return notAsAsked("can't tell whether %v lives: %v", pid, err)
		}
		defer vm.Close()
	}
	if gone, err := vm.Exited(); err != nil {
		return notAsAsked("can't tell whether %v lives: %v", pid, err)
	} else if gone {
		return notAsAsked("exited (%v is gone; last exit: %s)", pid, lastExit(rec))
	}
	qctx, qcancel := context.WithTimeout(ctx, existingQMPTimeout)
	defer qcancel()
	st, err := vm.Status(qctx)
	if err != nil {
		return notAsAsked("QMP did not answer (monitor busy or hung): %v is alive: %v", pid, err)
	}
	if !st.Running {
		return notAsAsked("%s (%v is alive, QMP status %q)", st.Status, pid, st.Status)
	}
	if state != vmflowv1.InstanceState_INSTANCE_STATE_RUNNING {
		return notAsAsked("launch in progress (state %s, %v answers running)", store.StateName(state), pid)
	}
	return LaunchResult{Identity: pid, AlreadyRunning: true, Duration: time.Since(start)}, nil
}

// lastExit is the record's last exit in words.
func lastExit(rec *vmflowv1.InstanceRecord) string {
	if rec.GetLastExit() == nil {
		return "none recorded"
	}
	return fmt.Sprintf("%s at %s", rec.GetLastExitStatus(), rec.GetLastExit().AsTime().Format(time.RFC3339))
}
