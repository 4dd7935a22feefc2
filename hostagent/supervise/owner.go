package supervise

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"go.uber.org/zap"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// resolveLaunchLocked makes the locked record name every QEMU of the
// instance (invariant 11). A record with the launch marker and no process
// was left by an agent killed between writing the marker and recording the
// fork's pid: QEMU may run, or may never have started. The process table
// decides: a QEMU whose -qmp argument is this instance's socket is adopted
// (its identity recorded, the marker cleared), and the caller's normal path
// then re-attaches or stops it by that identity; none found clears the
// marker. With scan set the table is consulted even without the marker,
// for callers about to conclude "nothing runs" (Stop, TearDown): that also
// covers a record an agent older than the marker left behind.
//
// The scan runs under the instance lock, which also closes the pre-exec
// window (see vmm.FindBySocket): a child forked but not yet exec'd holds the
// lock's open file, so nobody gets here until it is QEMU or gone.
//
// It returns the record as it now is and whether a QEMU was adopted.
func (s *Supervisor) resolveLaunchLocked(ctx context.Context, l *store.Locked, in *instance, rec *vmflowv1.InstanceRecord, scan bool) (*vmflowv1.InstanceRecord, bool, error) {
	marked := rec.GetLaunchStartedAt() != nil
	if rec.GetProcess() != nil {
		if !marked {
			return rec, false, nil
		}
		// OnStarted writes the pid and clears the marker in one write, so
		// this is a hand-edited record; the recorded process rules.
		rec, err := l.Update(func(r *vmflowv1.InstanceRecord) error { r.LaunchStartedAt = nil; return nil })
		return rec, false, err
	}
	if !marked && !scan {
		return rec, false, nil
	}
	found, err := vmm.FindBySocket(ctx, l.Paths().Socket)
	if err != nil {
		return nil, false, fmt.Errorf("instance %s: look for an unrecorded qemu: %w", in.id, err)
	}
	switch len(found) {
	case 0:
		if !marked {
			return rec, false, nil
		}
		in.log.Info("launch marker: no qemu of the instance runs; clearing the marker")
		rec, err := l.Update(func(r *vmflowv1.InstanceRecord) error { r.LaunchStartedAt = nil; return nil })
		return rec, false, err
	case 1:
		pid := found[0]
		in.log.Warn("adopting a qemu its record did not name (its agent died between fork and recording it)",
			zap.Int("pid", pid.PID), zap.Uint64("start_time", pid.StartTime), zap.Bool("launch_marker", marked))
		rec, err := l.Update(func(r *vmflowv1.InstanceRecord) error {
			r.Process = store.ProcessRecord(pid)
			if r.GetLaunchStartedAt() != nil {
				r.LastStart = r.GetLaunchStartedAt()
			}
			r.LaunchStartedAt = nil
			r.StopStep, r.StopStepAt = vmflowv1.StopStep_STOP_STEP_NONE, nil
			return nil
		})
		if err != nil {
			return nil, false, fmt.Errorf("instance %s: adopt %v: %w", in.id, pid, err)
		}
		return rec, true, nil
	default:
		// QEMU's lock on its pidfile and the launch's busy-socket check keep
		// this from happening; if it does, one record cannot own them all.
		// Nothing is signalled or removed, the marker stays, and every
		// caller sees the error until an operator looks.
		return nil, false, fmt.Errorf("instance %s: %w: %d unrecorded qemus use its socket %s: %v",
			in.id, ErrStillRunning, len(found), l.Paths().Socket, found)
	}
}

// resolve takes instance id's slot and lock and resolves its launch marker
// (resolveLaunchLocked without scan), for callers that work without the
// lock (WaitExit).
func (s *Supervisor) resolve(ctx context.Context, id string) (*vmflowv1.InstanceRecord, error) {
	in, err := s.instance(id)
	if err != nil {
		return nil, err
	}
	if err := in.acquire(ctx); err != nil {
		return nil, err
	}
	defer in.release()
	l, err := s.lock(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock(l, in.log)
	rec, err := l.Get()
	if err != nil {
		return nil, err
	}
	rec, adopted, err := s.resolveLaunchLocked(ctx, l, in, rec, false)
	if err != nil {
		return nil, err
	}
	if adopted {
		// Watch it like any re-attached VM, so its exit is recorded.
		if _, _, err := s.liveVMLocked(ctx, l, in, store.IdentityOf(rec.GetProcess())); err != nil {
			return nil, err
		}
		if rec, err = l.Get(); err != nil {
			return nil, err
		}
	}
	return rec, nil
}

// TearDown removes instance id's qemu.sock and qemu.pid, and only once no
// QEMU of the instance can be alive: the launch marker resolved (an
// unrecorded QEMU found by its socket path is adopted, so TearDown refuses
// and a Stop can end it), the recorded process confirmed gone (then recorded
// as gone), and the socket not accepting connections. Otherwise it returns
// an error wrapping ErrStillRunning (retryable) and removes nothing. A
// missing record is nil (already torn down); an unreadable one is an error
// wrapping store.ErrInvalidRecord.
func (s *Supervisor) TearDown(ctx context.Context, id string) error {
	in, err := s.instance(id)
	if err != nil {
		return fmt.Errorf("tear down: %w", err)
	}
	if err := in.acquire(ctx); err != nil {
		return fmt.Errorf("tear down: %w", err)
	}
	defer in.release()
	l, err := s.lock(ctx, id)
	if err != nil {
		return fmt.Errorf("tear down: %w", err)
	}
	defer unlock(l, in.log)
	rec, err := l.Get()
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("tear down: %w", err)
	}
	rec, _, err = s.resolveLaunchLocked(ctx, l, in, rec, true)
	if err != nil {
		return fmt.Errorf("tear down: %w", err)
	}
	if p := rec.GetProcess(); p != nil {
		// Alive: watched from here on (an adopted QEMU too), for the Stop
		// that must come first. Gone: recorded as gone. Can't tell: alive.
		pid := store.IdentityOf(p)
		_, alive, err := s.liveVMLocked(ctx, l, in, pid)
		if err != nil {
			return fmt.Errorf("tear down instance %s: %w: %w", id, ErrStillRunning, err)
		}
		if alive {
			st := proc.Inspect(pid)
			return fmt.Errorf("tear down instance %s: %w: %v is %s (%d tasks)", id, ErrStillRunning, pid, st.State, st.Tasks)
		}
	}
	p := l.Paths()
	// RemoveStaleSocket removes the socket only when nothing accepts on it:
	// a QEMU the record does not know still refuses the tear down.
	if err := vmm.RemoveStaleSocket(ctx, p.Socket); err != nil {
		if errors.Is(err, vmm.ErrSocketInUse) {
			return fmt.Errorf("tear down instance %s: %w: %w", id, ErrStillRunning, err)
		}
		return fmt.Errorf("tear down instance %s: %w", id, err)
	}
	if err := os.Remove(p.PID); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("tear down instance %s: %w", id, err)
	}
	crashpoint.Hit(crashpoint.TearDownSocketRemoved)
	in.log.Info("runtime files removed")
	return nil
}
