package supervise

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// ErrUnrecordedAmbiguous: the agent cannot tell which process is the
// instance's unrecorded QEMU: more than one passes, or the launch marker is
// on a record with neither a uid nor a launch nonce (an agent older than
// both wrote it), so nothing can prove one. Nothing is signalled,
// recorded or removed, and the instance needs an operator. Not retryable:
// retrying sees the same processes and the same record.
var ErrUnrecordedAmbiguous = errdefs.Ambiguous.New("several processes pass as the instance's unrecorded qemu")

// unprovableLaunch is the needs-attention reason of a launch marker on a
// record with neither a uid nor a nonce of its own (vmm.ErrNoLaunchIdentity).
const unprovableLaunch = "launch marker on a record with neither a qemu uid nor a launch nonce of its own (an agent older than both wrote it): " +
	"a QEMU it started cannot be told from a decoy with the same command line, so none is adopted or signalled; " +
	"find it by hand (ps -o pid,uid,sid,args), kill it, then clear launch_started_at"

// findTimeout bounds one look for an unrecorded QEMU. Reading a healthy
// process's environ or cmdline takes microseconds; one that blocks (its
// mmap lock held) does so for as long as the lock is held, and the answer
// is then "can't tell", whatever the wait.
const findTimeout = 5 * time.Second

// resolveLaunchLocked makes the locked record name every QEMU of the instance
// (invariant 11): vmm.FindUnrecorded resolves a launch marker (with scan, any
// record) and a match is adopted; can't tell wraps ErrStillRunning, several
// ErrUnrecordedAmbiguous. The lock held closes FindUnrecorded's pre-exec window.
func (s *Supervisor) resolveLaunchLocked(ctx context.Context, l *store.Locked, in *instance, rec *vmflowv1.InstanceRecord, scan bool) (*vmflowv1.InstanceRecord, bool, error) {
	marked := rec.GetLaunchStartedAt() != nil
	if rec.GetProcess() != nil {
		if !marked && rec.GetLaunchNonce() == "" {
			return rec, false, nil
		}
		// OnStarted writes the pid and clears the marker in one write, so
		// this is a hand-edited record; the recorded process rules.
		rec, err := l.Apply(store.ClearLaunchMarker())
		return rec, false, err
	}
	if !marked && (!scan || rec.GetStopStep() == vmflowv1.StopStep_STOP_STEP_GONE) {
		// Stop step gone: a Stop already looked (it writes gone only after
		// resolving, or after the recorded process was confirmed gone),
		// under the manual-stop marker, after which nothing is launched.
		return rec, false, nil
	}
	fc := vmm.FindConfig{Binary: s.cfg.QEMU, Paths: vmmPaths(l.Paths()), JailSetup: s.cfg.JailSetup, ReadMem: s.hooks.readProcMem}
	switch {
	case marked && rec.GetLaunchNonce() != "":
		// A marker an agent older than the per-VM uid wrote: its QEMU
		// carries the nonce in its environment. Read only: no marker gets
		// a nonce any more.
		fc.Nonce = rec.GetLaunchNonce()
	case rec.GetQemuUid() != 0:
		fc.UID, fc.Name = rec.GetQemuUid(), in.id
	case !marked:
		// No uid, no nonce, no marker: the agent that launched it recorded
		// every process it forked, and a command line is no identity.
		return rec, false, nil
	default:
		return nil, false, s.unprovableLaunchLocked(l, in)
	}
	nonce := fc.Nonce
	fctx, cancel := context.WithTimeout(ctx, findTimeout)
	defer cancel()
	found, err := vmm.FindUnrecorded(fctx, fc)
	if err != nil {
		// Can't tell counts as "may run": never as "none".
		return nil, false, fmt.Errorf("instance %s: %w: look for an unrecorded qemu: %w", in.id, ErrStillRunning, err)
	}
	switch len(found) {
	case 0:
		if !marked {
			return rec, false, nil
		}
		in.log.Info("launch marker: no qemu of the instance runs; clearing the marker", zap.Bool("nonce", nonce != ""))
		rec, err := l.Apply(store.ClearLaunchMarker())
		return rec, false, err
	case 1:
		pid := found[0]
		in.log.Warn("adopting a qemu its record did not name (its agent died between fork and recording it)",
			zap.Int("pid", pid.PID), zap.Uint64("start_time", pid.StartTime), zap.Bool("launch_marker", marked),
			zap.Bool("nonce", nonce != ""), zap.Uint32("qemu_uid", fc.UID))
		rec, err := l.Apply(store.Adopted(pid))
		if err != nil {
			return nil, false, fmt.Errorf("instance %s: adopt %v: %w", in.id, pid, err)
		}
		return rec, true, nil
	default:
		// With a uid or a nonce this cannot happen (one process was
		// given it; QEMU's sandbox lets it spawn nothing);
		// without one, a command line is all there is to go on, and one
		// record cannot own them all. Nothing is signalled or removed,
		// the marker stays, and every caller sees the error until an
		// operator looks.
		in.log.Error("several processes pass as the instance's unrecorded qemu; left alone, needs an operator",
			zap.Int("count", len(found)), zap.String("socket", l.Paths().Socket), zap.Bool("nonce", nonce != ""),
			zap.Stringers("processes", found))
		return nil, false, fmt.Errorf("instance %s: %w: %d processes run %s with its socket %s: %v",
			in.id, ErrUnrecordedAmbiguous, len(found), s.cfg.QEMU, l.Paths().Socket, found)
	}
}

// unprovableLaunchLocked marks a marker with no launch identity to go on
// (vmm.ErrNoLaunchIdentity) needing attention; not retryable, like ambiguity.
func (s *Supervisor) unprovableLaunchLocked(l *store.Locked, in *instance) error {
	cause := fmt.Errorf("instance %s: %w: %w", in.id, ErrUnrecordedAmbiguous, vmm.ErrNoLaunchIdentity)
	in.log.Error("launch marker without a uid or nonce: no qemu adopted by its command line; needs an operator", zap.Error(cause))
	if _, err := l.Apply(store.NeedsAttention(unprovableLaunch, s.cfg.Now(), false)); err != nil {
		return fmt.Errorf("%w (and recording it: %w)", cause, err)
	}
	return cause
}

// resolve resolves instance id's launch marker under its slot and lock, for
// callers that otherwise work without the lock (WaitExit).
func (s *Supervisor) resolve(ctx context.Context, id string) (*vmflowv1.InstanceRecord, error) {
	in, err := s.instance(id)
	if err != nil {
		return nil, err
	}
	if err := in.acquire(ctx); err != nil {
		return nil, err
	}
	defer in.release()
	l, err := s.st.Lock(ctx, id)
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

// TearDown removes instance id's qemu.sock and qemu.pid only once no QEMU of it
// can be alive (marker resolved, process gone, socket dead); otherwise
// ErrStillRunning (retryable) or ErrUnrecordedAmbiguous. No record is nil.
func (s *Supervisor) TearDown(ctx context.Context, id string) error {
	in, err := s.instance(id)
	if err != nil {
		return fmt.Errorf("tear down: %w", err)
	}
	if err := in.acquire(ctx); err != nil {
		return fmt.Errorf("tear down: %w", err)
	}
	defer in.release()
	l, err := s.st.Lock(ctx, id)
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
	if uid := rec.GetQemuUid(); s.cfg.Cgroups != nil && uid != 0 {
		if err := s.cfg.Cgroups.Remove(ctx, vmm.CgroupName(id, uid)); err != nil {
			return fmt.Errorf("tear down instance %s: %w: %w", id, ErrStillRunning, err)
		}
	}
	crashpoint.Hit(crashpoint.TearDownSocketRemoved)
	in.log.Info("runtime files removed")
	return nil
}
