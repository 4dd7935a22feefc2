package store

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/internal/crashpoint"
	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Locked is one instance held under its lock: everything done through it is
// one check-then-act no other goroutine or agent can interleave with. A
// restart, for example, checks the marker, launches QEMU and records its pid
// through one Locked. A Locked is for one goroutine; Unlock releases it.
type Locked struct {
	s     *Store
	id    string
	paths Paths
	lock  *fsx.Lock
}

// ID is the locked instance's id.
func (l *Locked) ID() string { return l.id }

// Paths are the locked instance's files.
func (l *Locked) Paths() Paths { return l.paths }

// Unlock releases the lock, removing the lock file when the instance has no
// directory so locks/ does not grow with every id; waiters relock the new
// file. Idempotent.
func (l *Locked) Unlock() error {
	if l.lock == nil {
		return nil
	}
	_, err := os.Lstat(l.paths.Dir)
	gone := errors.Is(err, fs.ErrNotExist)
	rerr := l.lock.Release(gone)
	l.lock = nil
	if rerr != nil {
		return fmt.Errorf("instance %s: %w", l.id, rerr)
	}
	return nil
}

func (l *Locked) held() error {
	if l.lock == nil {
		return fmt.Errorf("instance %s: %w", l.id, ErrUnlocked)
	}
	return nil
}

// Get reads the record under the lock.
func (l *Locked) Get() (*vmflowv1.InstanceRecord, error) {
	if err := l.held(); err != nil {
		return nil, err
	}
	return l.s.read(l.paths, l.id)
}

// ManualStop reports whether the manual-stop marker is on disk; under the
// lock the answer holds until Unlock.
func (l *Locked) ManualStop() (bool, error) {
	if err := l.held(); err != nil {
		return false, err
	}
	ok, err := markerExists(l.paths)
	if err != nil {
		return false, fmt.Errorf("instance %s: %w", l.id, err)
	}
	return ok, nil
}

// Create: see Store.Create, without a reservation. The caller holds the
// admission lock when the room check must count concurrent creates.
func (l *Locked) Create(want *vmflowv1.InstanceRecord) (*vmflowv1.InstanceRecord, error) {
	return l.create(context.Background(), want, nil)
}

func (l *Locked) create(ctx context.Context, want *vmflowv1.InstanceRecord, reserve Reserve) (rec *vmflowv1.InstanceRecord, err error) {
	if err := l.held(); err != nil {
		return nil, err
	}
	// Refused whole while an agent owns the state dir: no directory is
	// left behind a record that could not be written.
	err = l.s.guardWrite(func() error {
		rec, err = l.createGuarded(ctx, want, reserve)
		return err
	})
	return rec, err
}

func (l *Locked) createGuarded(ctx context.Context, want *vmflowv1.InstanceRecord, reserve Reserve) (*vmflowv1.InstanceRecord, error) {
	if want.GetId() != l.id {
		return nil, fmt.Errorf("create instance %s: %w: record says id %s", l.id, ErrInvalidRecord, quoteID(want.GetId()))
	}
	if want.GetSpec() == nil {
		return nil, fmt.Errorf("create instance %s: %w: no spec", l.id, ErrInvalidRecord)
	}
	have, err := l.s.read(l.paths, l.id)
	switch {
	case err == nil:
		if isDeleting(have.GetState()) {
			return nil, fmt.Errorf("create instance %s: %w (state %s); wait for the delete to finish",
				l.id, ErrDeleting, StateName(have.GetState()))
		}
		if diff := desiredDiff(have, want); len(diff) > 0 {
			return nil, fmt.Errorf("create instance %s: %w: %s", l.id, ErrConflict, joinDiff(diff))
		}
		return have, nil
	case !errors.Is(err, ErrNotFound):
		return nil, fmt.Errorf("create instance %s: %w", l.id, err)
	}

	now := timestamppb.Now()
	rec := &vmflowv1.InstanceRecord{
		Id:                        l.id,
		Spec:                      proto.CloneOf(want.GetSpec()),
		RestartPolicy:             want.GetRestartPolicy(),
		RestartMaxAttempts:        want.GetRestartMaxAttempts(),
		RestartStableAfterSeconds: want.GetRestartStableAfterSeconds(),
		CreatedByWorkflowId:       want.GetCreatedByWorkflowId(),
		CreatedByRunId:            want.GetCreatedByRunId(),
		State:                     creating,
		CreatedAt:                 now,
		UpdatedAt:                 now,
	}
	// A record too large to read back, or one the state file system has no
	// room for, is refused before its directory exists: nothing is left
	// behind.
	if _, err := encodeForWrite(rec); err != nil {
		return nil, fmt.Errorf("create instance %s: %w", l.id, err)
	}
	if err := l.s.checkRoom(diskSize(want.GetSpec().GetDisk())); err != nil {
		return nil, fmt.Errorf("create instance %s: %w", l.id, err)
	}
	if reserve != nil {
		lease, err := reserve(ctx)
		if err != nil {
			return nil, fmt.Errorf("create instance %s: %w", l.id, err)
		}
		lease = proto.CloneOf(lease)
		lease.Phase, lease.ClaimedAt = vmflowv1.ClaimPhase_CLAIM_PHASE_INTENT, now
		rec.Leases = append(rec.Leases, lease)
	}
	if err := os.Mkdir(l.paths.Dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("create instance %s: %w", l.id, err)
	}
	// The new directory entry must be durable before a record in it counts.
	if err := fsx.SyncDir(l.s.instances); err != nil {
		return nil, fmt.Errorf("create instance %s: %w", l.id, err)
	}
	crashpoint.Hit(crashpoint.StoreCreateDir)
	if err := l.write(rec); err != nil {
		return nil, fmt.Errorf("create instance %s: %w", l.id, err)
	}
	return rec, nil
}

func joinDiff(diff []string) string {
	out := diff[0]
	for _, d := range diff[1:] {
		out += ", " + d
	}
	return out
}

// Update writes fn's change to a copy of the record atomically, if any. It
// refuses, writing nothing, fn's error, an id change, an illegal transition
// and Deleting without the manual-stop marker; the store sets updated_at.
func (l *Locked) Update(fn func(*vmflowv1.InstanceRecord) error) (*vmflowv1.InstanceRecord, error) {
	return l.update(fn, false)
}

// update is Update; setUID lets qemu_uid change, for AssignQEMUUID only (under
// the host-wide uid lock, so no two records name one uid).
func (l *Locked) update(fn func(*vmflowv1.InstanceRecord) error, setUID bool) (*vmflowv1.InstanceRecord, error) {
	if err := l.held(); err != nil {
		return nil, err
	}
	if fn == nil {
		return nil, errdefs.Internal.Errorf("update instance %s: nil update function", l.id)
	}
	old, err := l.s.read(l.paths, l.id)
	if err != nil {
		return nil, fmt.Errorf("update: %w", err)
	}
	rec := cloneRecord(old)
	if err := fn(rec); err != nil {
		return nil, fmt.Errorf("update instance %s: %w", l.id, err)
	}
	if proto.Equal(old, rec) {
		return rec, nil
	}
	if rec.GetId() != l.id {
		return nil, fmt.Errorf("update instance %s: %w: the id cannot change (to %s)", l.id, ErrInvalidRecord, quoteID(rec.GetId()))
	}
	if !setUID && old.GetQemuUid() != rec.GetQemuUid() {
		return nil, fmt.Errorf("update instance %s: %w: qemu_uid is assigned by AssignQEMUUID only (%d to %d)",
			l.id, ErrInvalidRecord, old.GetQemuUid(), rec.GetQemuUid())
	}
	if from, to := old.GetState(), rec.GetState(); from != to {
		if err := CheckTransition(from, to); err != nil {
			return nil, fmt.Errorf("update instance %s: %w", l.id, err)
		}
		if to == deleting {
			// Invariant 6: the marker comes first, so the restart policy can
			// never bring back a VM whose delete has begun.
			marked, err := markerExists(l.paths)
			if err != nil {
				return nil, fmt.Errorf("update instance %s: %w", l.id, err)
			}
			if !marked {
				return nil, fmt.Errorf("update instance %s: %w: write it before moving to deleting", l.id, ErrManualStopMissing)
			}
		}
	}
	if err := ValidateRecord(rec); err != nil {
		return nil, fmt.Errorf("update instance %s: %w", l.id, err)
	}
	rec.UpdatedAt = timestamppb.Now()
	if err := l.write(rec); err != nil {
		return nil, fmt.Errorf("update instance %s: %w", l.id, err)
	}
	return rec, nil
}

// Transition: see Store.Transition.
func (l *Locked) Transition(to vmflowv1.InstanceState) (*vmflowv1.InstanceRecord, error) {
	return l.Update(func(r *vmflowv1.InstanceRecord) error {
		r.State = to
		return nil
	})
}

// write stores rec atomically, first removing a crashed writer's temp files
// (no other is in flight under the lock); refuses a record too large to read
// back. The index learns rec once it is on disk; a write that failed leaves
// the disk unknown, and the record stale in the index (read from disk).
func (l *Locked) write(rec *vmflowv1.InstanceRecord) error {
	err := l.s.guardWrite(func() error { return l.writeDisk(rec) })
	if ix := l.s.ix.Load(); ix != nil {
		if err != nil {
			ix.unsure(l.id)
		} else {
			ix.put(l.s, rec)
		}
	}
	return err
}

func (l *Locked) writeDisk(rec *vmflowv1.InstanceRecord) error {
	b, err := encodeForWrite(rec)
	if err != nil {
		return err
	}
	if err := fsx.RemoveStaleTemps(l.paths.Dir); err != nil {
		return err
	}
	put := func() error { return writeFileAtomic(l.paths.Dir, RecordFile, b, l.s.afterTemp) }
	// A delete's writes (once the marker is down) may use the reserve: a
	// full disk never blocks a delete (invariant 14).
	if marked, _ := markerExists(l.paths); marked {
		return l.s.withReserve(put)
	}
	return put()
}

// MarkManualStop: see Store.MarkManualStop. An existing marker is kept as is.
func (l *Locked) MarkManualStop() error {
	if err := l.held(); err != nil {
		return err
	}
	// The record must exist (no directories for ids never created), but it
	// need not be valid: a delete must be able to block restarts even of an
	// instance whose record an operator has mangled.
	if _, err := os.Lstat(l.paths.Record); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("mark manual stop: instance %s: %w", l.id, ErrNotFound)
		}
		return fmt.Errorf("mark manual stop of instance %s: %w", l.id, err)
	}
	marked, err := markerExists(l.paths)
	if err != nil {
		return fmt.Errorf("mark manual stop of instance %s: %w", l.id, err)
	}
	if marked {
		return nil
	}
	body := []byte("manual stop requested at " + time.Now().UTC().Format(time.RFC3339Nano) + "\n")
	if err := l.s.withReserve(func() error { return writeFileAtomic(l.paths.Dir, ManualStopFile, body, nil) }); err != nil {
		return fmt.Errorf("mark manual stop of instance %s: %w", l.id, err)
	}
	crashpoint.Hit(crashpoint.MarkerWritten)
	return nil
}

// Delete: see Store.Delete. The directory is renamed away before removal, so a
// crash leaves all of the instance or none (New finishes the removal).
func (l *Locked) Delete() error {
	if err := l.held(); err != nil {
		return err
	}
	return l.s.guardWrite(l.delete)
}

func (l *Locked) delete() error {
	rec, err := l.s.read(l.paths, l.id)
	if err != nil {
		return fmt.Errorf("delete: %w", err)
	}
	if err := MayRemove(rec); err != nil {
		return fmt.Errorf("delete instance %s: %w", l.id, err)
	}
	var trash string
	err = l.s.withReserve(func() (err error) {
		trash, err = os.MkdirTemp(l.s.instances, trashPrefix+l.id+"-")
		return err
	})
	if err != nil {
		return fmt.Errorf("delete instance %s: %w", l.id, err)
	}
	// rename(2) replaces the empty directory MkdirTemp made, which reserves a
	// unique name; os.Rename refuses any existing target, hence unix.Rename.
	if err := unix.Rename(l.paths.Dir, trash); err != nil {
		_ = os.Remove(trash) // best effort; New removes trash anyway
		return fmt.Errorf("delete instance %s: %w", l.id, err)
	}
	crashpoint.Hit(crashpoint.RecordTrashed)
	// Gone for readers, on disk: the index forgets it and lets its uids go
	// (its thread group was gone before: MayRemove).
	if ix := l.s.ix.Load(); ix != nil {
		ix.removed(l.id)
	}
	l.s.dropUID(rec.GetQemuUid(), l.id)
	// From here the instance is gone for readers; finish removing its files
	// even if the fsync failed (New removes whatever a crash leaves).
	var errs []error
	if err := fsx.SyncDir(l.s.instances); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(trash); err != nil {
		errs = append(errs, fmt.Errorf("remove its files: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("delete instance %s: %w", l.id, err)
	}
	return nil
}
