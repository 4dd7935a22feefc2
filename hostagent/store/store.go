// Package store keeps the host agent's instance records: one directory per
// instance under <state-dir>/instances/<id>/ holding record.json (the
// vmflowv1.InstanceRecord as snake_case protojson), qemu.sock, qemu.log,
// qemu.pid, the manual-stop marker and the disk overlay (disk.qcow2).
//
// The store is where the host-side invariants are enforced rather than
// trusted to callers: every record write is atomic and durable (invariant 7);
// every check-then-act on an instance runs under that instance's lock file,
// so two agents on one state dir cannot both act; the instance's lifecycle
// (the state machine and the named steps that move a record along it,
// lifecycle.go) lives here and nowhere else; a delete can only begin once
// the manual-stop marker is on disk (invariant 6); and a record that still
// holds a lease (invariant 1: a vGPU today, lease.go) or names a QEMU not
// confirmed gone (invariant 11) is never deleted.
//
// The agent's store keeps an index of what the records hold (index.go):
// seeded once at start, written through under the locks, trusted only
// while it holds the state dir's agent lock, which every other store's
// write shares (so none goes behind it); a launch or a release then reads
// no other record and scans no process.
//
// The package never imports Temporal: activities adapt it, supervision uses it
// with the network down.
package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"vmflow/internal/fsx"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// File names inside an instance directory.
const (
	RecordFile     = "record.json"
	SocketFile     = "qemu.sock"
	LogFile        = "qemu.log"
	PIDFile        = "qemu.pid"
	ManualStopFile = "manual-stop"
	// OverlayFile is the instance's writable disk: a qcow2 overlay over its
	// read-only base image, kept across restarts and removed with the
	// instance directory.
	OverlayFile = "disk.qcow2"
)

const (
	instancesDir = "instances"
	// Lock files live outside the instance directories so an instance can be
	// locked before its directory exists (Create) and while it is removed
	// (Delete).
	locksDir = "locks"
	// admissionLock, in the state dir, serialises creates and the capacity
	// ledger's placements (Admitting).
	admissionLock = "admission.lock"
	// trashPrefix names an instance directory being removed: Delete renames
	// the whole directory away in one atomic step, then removes it. It starts
	// with a dot, which no id can, so List never sees it.
	trashPrefix = ".deleted-"
)

// Store is the instance record store of one state directory. It is safe for
// concurrent use; per-instance exclusion comes from lock files, so it also
// holds across processes.
type Store struct {
	root      string // absolute state dir
	instances string
	locks     string
	uids      string           // the uid ledger (uidsDir)
	reserve   uint64           // the reserve's size (WithReserve)
	afterTemp func(tmp string) // test hook: see writeFileAtomic
	// ix is what the records hold, kept by the agent that owns the state
	// dir (OpenIndex, index.go); nil: every reader reads the disk.
	ix atomic.Pointer[index] // the index (OpenIndex); read once per use: Close swaps it out
}

// Option configures a Store.
type Option func(*Store)

// New opens, creating as needed, the store under stateDir: made absolute, as
// QEMU gets socket paths with another working directory; 0700, as records name
// processes root will signal.
func New(stateDir string, opts ...Option) (*Store, error) {
	if stateDir == "" {
		return nil, errors.New("open store: empty state dir")
	}
	root, err := filepath.Abs(stateDir)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", stateDir, err)
	}
	s := &Store{
		root:      root,
		instances: filepath.Join(root, instancesDir),
		locks:     filepath.Join(root, locksDir),
		uids:      filepath.Join(root, uidsDir),
		reserve:   DefaultReserve,
	}
	for _, o := range opts {
		o(s)
	}
	for _, d := range []string{s.instances, s.locks, s.uids} {
		// Durably: a record written into a directory whose own entry a
		// power cut drops is lost with it.
		if err := fsx.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("open store: %w", err)
		}
		// MkdirAll leaves an existing directory's mode alone; tighten it.
		if err := os.Chmod(d, 0o700); err != nil {
			return nil, fmt.Errorf("open store: %w", err)
		}
	}
	if err := s.removeTrash(); err != nil {
		return nil, fmt.Errorf("open store: %w", err)
	}
	// Best effort: an agent must start on a full disk, to serve deletes.
	s.layReserve()
	return s, nil
}

// StateDir is the store's absolute state directory.
func (s *Store) StateDir() string { return s.root }

// Paths are the files of one instance. Only the store writes RecordFile and
// ManualStopFile; the VMM uses the others (and should create qemu.log 0600).
type Paths struct {
	Dir        string // <state-dir>/instances/<id>
	Record     string // record.json
	Socket     string // qemu.sock, QMP
	Log        string // qemu.log, QEMU's stdout and stderr
	PID        string // qemu.pid, QEMU's -pidfile
	ManualStop string // manual-stop marker
	Overlay    string // disk.qcow2, the writable qcow2 overlay over the base image
	// OverlayTemp is the overlay while it is created, renamed to Overlay
	// once complete; a crashed creator's leftover is a stale temp file.
	OverlayTemp string
}

// Paths returns the paths of instance id, after validating the id. Socket
// may be longer than a Unix socket address holds: the VMM binds and dials
// it through its directory.
func (s *Store) Paths(id string) (Paths, error) {
	if err := ValidateID(id); err != nil {
		return Paths{}, err
	}
	dir := filepath.Join(s.instances, id)
	return Paths{
		Dir:         dir,
		Record:      filepath.Join(dir, RecordFile),
		Socket:      filepath.Join(dir, SocketFile),
		Log:         filepath.Join(dir, LogFile),
		PID:         filepath.Join(dir, PIDFile),
		ManualStop:  filepath.Join(dir, ManualStopFile),
		Overlay:     filepath.Join(dir, OverlayFile),
		OverlayTemp: filepath.Join(dir, fsx.TempPrefix+OverlayFile),
	}, nil
}

// Lock takes instance id's lock until ctx ends (ErrBusy); the handle's work is
// one check-then-act, ended by Unlock. No record is needed yet.
func (s *Store) Lock(ctx context.Context, id string) (*Locked, error) {
	p, err := s.Paths(id)
	if err != nil {
		return nil, err
	}
	fl, err := lockFile(ctx, filepath.Join(s.locks, id+".lock"))
	if err != nil {
		return nil, fmt.Errorf("instance %s: %w", id, err)
	}
	return &Locked{s: s, id: id, paths: p, lock: fl}, nil
}

// lockFile takes the lock file at path, or ErrBusy (retryable) a little before
// ctx's deadline, so a caller outwaited by another holder says why rather
// than being cut off by its own deadline.
func lockFile(ctx context.Context, path string) (*fsx.Lock, error) {
	if dl, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, dl.Add(-min(time.Until(dl)/10, lockWaitMargin)))
		defer cancel()
	}
	l, err := fsx.LockFile(ctx, path)
	if errors.Is(err, fsx.ErrLockHeld) {
		return nil, fmt.Errorf("%w: %w", ErrBusy, err)
	}
	return l, err
}

// lockWaitMargin is the most a lock wait leaves of its caller's time.
const lockWaitMargin = time.Second

// withLock runs fn under instance id's lock.
func (s *Store) withLock(ctx context.Context, id string, fn func(*Locked) error) (err error) {
	l, err := s.Lock(ctx, id)
	if err != nil {
		return err
	}
	defer func() {
		if uerr := l.Unlock(); uerr != nil {
			err = errors.Join(err, uerr)
		}
	}()
	return fn(l)
}

// Create records a new instance (Creating) from want's id, spec, restart
// settings and creator. The same configuration again returns the record
// unchanged, creator included; another is ErrConflict, a deleting one ErrDeleting.
// With Reserving, a new record is born holding its share of the host (or is
// not made at all): the reservation and the write happen under the host's
// admission lock, so two creates never take the same room.
func (s *Store) Create(ctx context.Context, want *vmflowv1.InstanceRecord, opts ...CreateOption) (rec *vmflowv1.InstanceRecord, err error) {
	if _, err := s.Paths(want.GetId()); err != nil {
		return nil, err
	}
	var o createOptions
	for _, opt := range opts {
		opt(&o)
	}
	err = s.withLock(ctx, want.GetId(), func(l *Locked) error {
		return s.Admitting(ctx, func() error {
			rec, err = l.create(ctx, want, o.reserve)
			return err
		})
	})
	return rec, err
}

// CreateOption shapes a Create.
type CreateOption func(*createOptions)

type createOptions struct{ reserve Reserve }

// Reserve returns the lease on the share of the host (a capacity lease) a
// new record is created holding, or a refusal, which creates nothing. It
// runs under the admission lock, only for a record that does not exist.
type Reserve func(ctx context.Context) (*vmflowv1.Lease, error)

// Reserving makes Create reserve with r.
func Reserving(r Reserve) CreateOption { return func(o *createOptions) { o.reserve = r } }

// Admitting runs fn under the host's admission lock: one create at a time,
// so each room check (the state disk's, the capacity ledger's) counts the
// records written before it. It is taken under an instance's lock, never
// the other way round (a launch placing its capacity holds its instance's).
func (s *Store) Admitting(ctx context.Context, fn func() error) (err error) {
	adm, err := lockFile(ctx, filepath.Join(s.root, admissionLock))
	if err != nil {
		return fmt.Errorf("admission: %w", err)
	}
	defer func() { err = errors.Join(err, adm.Release(false)) }()
	return fn()
}

// Update is Locked.Update under id's lock, for tests that fabricate a state:
// agent code applies named steps (Apply), as owned_test.go enforces.
func (s *Store) Update(ctx context.Context, id string, fn func(*vmflowv1.InstanceRecord) error) (rec *vmflowv1.InstanceRecord, err error) {
	err = s.withLock(ctx, id, func(l *Locked) error {
		rec, err = l.Update(fn)
		return err
	})
	return rec, err
}

// Transition moves instance id to state to, checked; a no-op when already
// there. Like Update, for tests.
func (s *Store) Transition(ctx context.Context, id string, to vmflowv1.InstanceState) (*vmflowv1.InstanceRecord, error) {
	return s.Update(ctx, id, func(r *vmflowv1.InstanceRecord) error {
		r.State = to
		return nil
	})
}

// Delete removes instance id's record and directory when MayRemove allows
// (ErrClaimHeld, ErrProcessMayLive otherwise); ErrNotFound means already done.
func (s *Store) Delete(ctx context.Context, id string) error {
	return s.withLock(ctx, id, func(l *Locked) error { return l.Delete() })
}

// MarkManualStop durably writes instance id's manual-stop marker so the restart
// policy never brings the VM back; idempotent, the record must exist.
func (s *Store) MarkManualStop(ctx context.Context, id string) error {
	return s.withLock(ctx, id, func(l *Locked) error { return l.MarkManualStop() })
}

// ManualStop reports whether id's manual-stop marker is on disk, without a
// lock: decide under Lock with Locked.ManualStop.
func (s *Store) ManualStop(id string) (bool, error) {
	p, err := s.Paths(id)
	if err != nil {
		return false, err
	}
	return markerExists(p)
}

// Get reads instance id's record without a lock (rename means never a torn
// one); use Lock when the answer decides a write.
func (s *Store) Get(id string) (*vmflowv1.InstanceRecord, error) {
	p, err := s.Paths(id)
	if err != nil {
		return nil, err
	}
	return s.read(p, id)
}

// List reads every record, sorted by id. Unreadable ones do not hide the
// others: it returns those it read with a *ListError naming the rest (see
// Unreadable); any other error means nothing was read.
func (s *Store) List() ([]*vmflowv1.InstanceRecord, error) {
	ids, err := s.IDs()
	if err != nil {
		return nil, err
	}
	var recs []*vmflowv1.InstanceRecord
	var bad []UnreadableRecord
	for _, id := range ids {
		rec, err := s.Get(id)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			p, _ := s.Paths(id)
			bad = append(bad, UnreadableRecord{ID: id, Path: p.Record, Err: err})
			continue
		}
		recs = append(recs, rec)
	}
	slices.SortFunc(recs, func(a, b *vmflowv1.InstanceRecord) int { return strings.Compare(a.GetId(), b.GetId()) })
	if len(bad) > 0 {
		return recs, &ListError{Unreadable: bad}
	}
	return recs, nil
}

// UnreadableRecord is one record List could not read.
type UnreadableRecord struct {
	ID   string
	Path string
	Err  error
}

// ListError is List's error when some records could not be read; the
// records it returns beside it are all the others.
type ListError struct {
	Unreadable []UnreadableRecord
}

func (e *ListError) Error() string {
	msgs := make([]string, len(e.Unreadable))
	for i, u := range e.Unreadable {
		msgs[i] = u.Err.Error()
	}
	return fmt.Sprintf("%d unreadable record(s): %s", len(e.Unreadable), strings.Join(msgs, "; "))
}

// Unwrap makes errors.Is see each record's error (ErrInvalidRecord, ...).
func (e *ListError) Unwrap() []error {
	errs := make([]error, len(e.Unreadable))
	for i, u := range e.Unreadable {
		errs[i] = u.Err
	}
	return errs
}

// Unreadable reads List's error: the unreadable records, and whether the
// listing itself worked.
func Unreadable(err error) (bad []UnreadableRecord, listed bool) {
	if err == nil {
		return nil, true
	}
	var le *ListError
	if errors.As(err, &le) {
		return le.Unreadable, true
	}
	return nil, false
}

// read is readRecord, for the index too: a record it cannot read is stale
// in the index from now on (read from disk at every use), so a record made
// unreadable by hand after the seed counts as taken from then on.
func (s *Store) read(p Paths, id string) (*vmflowv1.InstanceRecord, error) {
	rec, err := readRecord(p, id)
	if ix := s.ix.Load(); err != nil && ix != nil && (!errors.Is(err, ErrNotFound) || ix.has(id)) {
		ix.unsure(id)
	}
	return rec, err
}

// readRecord reads and validates p.Record, which must belong to id.
func readRecord(p Paths, id string) (*vmflowv1.InstanceRecord, error) {
	f, err := os.Open(p.Record)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("instance %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("read record of instance %s: %w", id, err)
	}
	defer f.Close()
	// Read one byte past the cap so DecodeRecord can tell "too big".
	b, err := io.ReadAll(io.LimitReader(f, maxRecordSize+1))
	if err != nil {
		return nil, fmt.Errorf("read record of instance %s: %w", id, err)
	}
	rec, err := DecodeRecord(b)
	if err != nil {
		return nil, fmt.Errorf("record of instance %s (%s): %w", id, p.Record, err)
	}
	if rec.GetId() != id {
		return nil, fmt.Errorf("record of instance %s (%s): %w: it says id %s", id, p.Record, ErrInvalidRecord, quoteID(rec.GetId()))
	}
	return rec, nil
}

func markerExists(p Paths) (bool, error) {
	_, err := os.Lstat(p.ManualStop)
	if err == nil {
		return true, nil
	}
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return false, fmt.Errorf("check manual-stop marker: %w", err)
}

// removeTrash finishes deletes that crashed after renaming an instance
// directory away (Delete had checked claim and state before).
func (s *Store) removeTrash() error {
	entries, err := os.ReadDir(s.instances)
	if err != nil {
		return fmt.Errorf("list instances: %w", err)
	}
	var errs []error
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), trashPrefix) {
			if err := os.RemoveAll(filepath.Join(s.instances, e.Name())); err != nil {
				errs = append(errs, fmt.Errorf("remove deleted instance directory: %w", err))
			}
		}
	}
	return errors.Join(errs...)
}
