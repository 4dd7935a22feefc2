package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The index: what the records hold (each record as last written or read,
// and which instance holds each QEMU uid), in the memory of the one agent
// that owns the state dir, so a launch or a release reads no record but
// its own and scans no process (issue 36: a host's cost flat in its VM
// count).
//
// Coherence: the index is trusted only while its store holds the state
// dir's agent lock (agentLockFile) exclusively, taken by OpenIndex for the
// agent's life (the kernel drops it when the agent dies, kill -9
// included). Every record or uid-ledger write of a store without the
// index holds that lock shared for the write, or is refused
// (ErrStateDirOwned): so while an agent runs, no other process writes
// behind its index. What the lock cannot stop, a hand edit of a record,
// is seen at the next read of that record by the agent (a failed read
// makes its entry stale: read from disk at every use, as an unreadable
// record is) and at the next start, which seeds again.
//
// Ordering: disk first, then the index. A write that fails leaves its
// entry stale (read from disk), never claiming what the disk may not
// hold; a uid stays held from its assignment until its record is deleted,
// also after the record names another one (its files may still be the old
// uid's), so the index may count more uids taken than the disk, never
// fewer.
type index struct {
	lock *fsx.Lock // agentLockFile, exclusive

	mu sync.Mutex
	// recs holds every record as last written or read, private copies no
	// caller sees; stale names those to read from disk at every use
	// (unreadable at the seed, a read or a write of it failed since).
	recs  map[string]*vmflowv1.InstanceRecord
	stale map[string]bool
	// uids: see uidHolders.
	uids uidHolders
	// growth is what each instance's overlay may still grow to, as last
	// measured (at a write of its record, or by Space): a create's room
	// check sums it instead of reading every overlay. An overlay's
	// allocated blocks only grow (QEMU gets no discard), so an older
	// measure counts more, never less; one not measured yet is measured
	// at the check.
	growth map[string]uint64
	// epoch names this index (a new one at every OpenIndex); seq counts
	// its changes, and changes holds the last changeLog of them: which
	// record each was (RecordsChanged).
	epoch   uint64
	seq     uint64
	changes [changeLog]change
}

// changeLog is how many changes of records the index remembers for
// RecordsChanged: a caller further behind reads them all again.
const changeLog = 4096

// change is one change of the index: the seq'th, of record id.
type change struct {
	seq uint64
	id  string
}

// epochs numbers the indexes of this process.
var epochs atomic.Uint64

// changed notes that id's entry changed; under ix.mu.
func (ix *index) changed(id string) {
	ix.seq++
	ix.changes[ix.seq%changeLog] = change{seq: ix.seq, id: id}
}

// IndexEpoch names s's index (0: none): RecordsChanged answers only
// within one.
func (s *Store) IndexEpoch() uint64 {
	if ix := s.ix.Load(); ix != nil {
		return ix.epoch
	}
	return 0
}

// RecordsChanged is for a caller that keeps what the records hold itself:
// the ids whose entry in the index changed (a write, a delete, made stale)
// after its seq'th change, and the seq to ask with next. ok is false when
// the index is not epoch any more (none, or another since a restart) or
// remembers too few changes: read them all (IndexRecords). An id may come
// more than once, and an entry read after may be newer than next: the
// next answer names it again.
func (s *Store) RecordsChanged(epoch, seq uint64) (ids []string, next uint64, ok bool) {
	ix := s.ix.Load()
	if ix == nil || ix.epoch != epoch {
		return nil, 0, false
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if seq > ix.seq || ix.seq-seq > changeLog {
		return nil, 0, false
	}
	for q := seq + 1; q <= ix.seq; q++ {
		ids = append(ids, ix.changes[q%changeLog].id)
	}
	return ids, ix.seq, true
}

// IndexRecords is every entry of the index at one moment: the readable
// records (the index's copies: never change them), the stale ids (read
// them from disk at every use), and its epoch and seq for RecordsChanged.
// ok is false without an index.
func (s *Store) IndexRecords() (recs map[string]*vmflowv1.InstanceRecord, stale []string, epoch, seq uint64, ok bool) {
	ix := s.ix.Load()
	if ix == nil {
		return nil, nil, 0, 0, false
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	recs = make(map[string]*vmflowv1.InstanceRecord, len(ix.recs))
	for id, r := range ix.recs {
		if !ix.stale[id] {
			recs[id] = r
		}
	}
	for id := range ix.stale {
		stale = append(stale, id)
	}
	return recs, stale, ix.epoch, ix.seq, true
}

// IndexRecord is id's entry in the index: its record (the index's copy),
// or stale (read it from disk), or neither: no such record.
func (s *Store) IndexRecord(id string) (rec *vmflowv1.InstanceRecord, stale bool) {
	ix := s.ix.Load()
	if ix == nil {
		return nil, true
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.stale[id] {
		return nil, true
	}
	return ix.recs[id], false
}

// agentLockFile, in the state dir, is held exclusively by the agent whose
// store keeps the index (OpenIndex), and shared by any other store for the
// time of one write.
const agentLockFile = "agent.lock"

// ErrStateDirOwned: a running agent holds the state dir (its agent lock),
// so another process's write would go behind that agent's index.
var ErrStateDirOwned = errdefs.Busy.New("a running agent holds the state dir")

// OpenIndex makes s the state dir's indexed store, for the agent: it takes
// the agent lock (until ctx ends: ErrStateDirOwned while another agent
// holds it), then seeds the index under the uid lock with one read of the
// records, of the uid ledger and of each instance directory's owners, and
// one call of inUse (every uid some process holds: one /proc scan). An
// unreadable record counts as taken, as without the index. Call it once,
// before the store is shared; Close lets the lock go.
func (s *Store) OpenIndex(ctx context.Context, inUse func(context.Context) (map[uint32]bool, error)) error {
	if s.ix.Load() != nil {
		return errdefs.Internal.Errorf("open index of %s: already open", s.root)
	}
	al, err := lockFile(ctx, filepath.Join(s.root, agentLockFile))
	if err != nil {
		return fmt.Errorf("open index of %s: %w: %w", s.root, ErrStateDirOwned, err)
	}
	ix, err := s.seedIndex(ctx, inUse)
	if err != nil {
		return errors.Join(fmt.Errorf("open index of %s: %w", s.root, err), al.Release(false))
	}
	ix.lock = al
	s.ix.Store(ix)
	return nil
}

// Close lets the agent lock go (after OpenIndex); the store then reads
// the disk again, as one without an index. Idempotent.
func (s *Store) Close() error {
	ix := s.ix.Swap(nil)
	if ix == nil {
		return nil
	}
	return ix.lock.Release(false)
}

// Indexed reports whether s keeps the index (OpenIndex).
func (s *Store) Indexed() bool { return s.ix.Load() != nil }

// seedIndex reads what the records hold from disk, under the uid lock.
func (s *Store) seedIndex(ctx context.Context, inUse func(context.Context) (map[uint32]bool, error)) (*index, error) {
	hl, err := lockFile(ctx, filepath.Join(s.root, uidLockFile))
	if err != nil {
		return nil, err
	}
	defer hl.Release(false)
	ix := &index{recs: map[string]*vmflowv1.InstanceRecord{}, stale: map[string]bool{}, growth: map[string]uint64{},
		epoch: epochs.Add(1)}
	recs, holders, bad, err := s.readHolders(ctx, inUse)
	if err != nil {
		return nil, err
	}
	for _, r := range recs {
		ix.recs[r.GetId()] = r
	}
	for _, u := range bad {
		ix.stale[u.ID] = true
	}
	ix.uids = holders
	return ix, nil
}

// readHolders reads the records and the uid holders from disk (under the
// uid lock): the index's seed, and every assignment's without an index.
// Stale ledger entries are dropped on the way.
func (s *Store) readHolders(ctx context.Context, inUse func(context.Context) (map[uint32]bool, error)) (
	[]*vmflowv1.InstanceRecord, uidHolders, []UnreadableRecord, error) {
	recs, err := s.List()
	bad, listed := Unreadable(err)
	if !listed {
		return nil, uidHolders{}, nil, err
	}
	h := uidHolders{by: map[uint32]string{}, recheck: map[uint32]bool{}}
	uidOf := map[string]uint32{}
	for _, rec := range recs {
		uidOf[rec.GetId()] = rec.GetQemuUid()
		if u := rec.GetQemuUid(); u != 0 {
			h.add(u, rec.GetId())
		}
	}
	quarantined := map[string]bool{}
	for _, u := range bad {
		quarantined[u.ID] = true
		// A record written before the ledger existed: whatever of it
		// still parses may name its uid.
		if uid := lenientUID(u.Path); uid != 0 {
			h.add(uid, u.ID)
		}
	}
	// The ledger, written before a record names its uid, keeps a quarantined
	// record's uid taken: its QEMU may be gone while its /dev/vfio node is
	// still that uid's.
	ledger, err := s.readUIDLedger()
	if err != nil {
		return nil, uidHolders{}, nil, err
	}
	for u, id := range ledger {
		owner, readable := uidOf[id]
		switch {
		case id == "":
			h.add(u, anyInstance)
		case quarantined[id]:
			h.add(u, id)
		case readable && owner == u:
		default:
			// The record names another uid or is gone (a delete or an
			// assignment that crashed before its ledger clean-up).
			s.dropUID(u, id)
		}
	}
	ids, err := s.IDs()
	if err != nil {
		return nil, uidHolders{}, nil, err
	}
	for _, id := range ids {
		p, _ := s.Paths(id)
		owners, err := OwnersIn(p.Dir)
		if err != nil {
			return nil, uidHolders{}, nil, fmt.Errorf("instance %s: %w", id, err)
		}
		for u := range owners {
			h.add(u, id)
		}
	}
	busy, err := inUse(ctx)
	if err != nil {
		return nil, uidHolders{}, nil, err
	}
	for u := range busy {
		if _, named := h.by[u]; named {
			// Its instance's QEMU, or a stranger: the instance may keep
			// it only once no process holds it (recheck).
			h.recheck[u] = true
		} else {
			h.add(u, anyInstance)
		}
	}
	return recs, h, bad, nil
}

// anyInstance holds a uid for every instance: no record names it (a
// process, an entry of the ledger that names no id) or several do.
const anyInstance = "\x00"

// uidHolders says which instance holds each QEMU uid: the record naming
// it, a quarantined record's ledger entry or lenient read, files of its
// instance directory owned by it (or its group), or anyInstance. A uid is
// free for an instance when no one else holds it and, when a process held
// it at the seed (recheck), no process holds it now.
type uidHolders struct {
	by      map[uint32]string
	recheck map[uint32]bool
}

func (h uidHolders) add(u uint32, id string) {
	if have, ok := h.by[u]; ok && have != id {
		id = anyInstance
	}
	h.by[u] = id
}

// freeFor reports whether u is free for instance id; busyNow, called at
// most once, is every uid some process holds now.
func (h uidHolders) freeFor(u uint32, id string, busyNow func() (map[uint32]bool, error)) (bool, error) {
	holder, held := h.by[u]
	if held && holder != id {
		return false, nil
	}
	if !h.recheck[u] {
		return true, nil
	}
	busy, err := busyNow()
	if err != nil {
		return false, err
	}
	return !busy[u], nil
}

// assigned records that id holds u, and that no process held u when
// checked (the assignment's free answer).
func (h uidHolders) assigned(u uint32, id string) {
	h.add(u, id)
	delete(h.recheck, u)
}

// released lets every uid id holds go: its record is deleted.
func (h uidHolders) released(id string) {
	for u, holder := range h.by {
		if holder == id {
			delete(h.by, u)
			delete(h.recheck, u)
		}
	}
}

// count is how many uids are held.
func (h uidHolders) count() int { return len(h.by) }

// put records rec, as just written, for the indexed store, and measures
// its overlay again (a launch makes it before it writes the record).
func (ix *index) put(s *Store, rec *vmflowv1.InstanceRecord) {
	c := proto.CloneOf(rec)
	g, gerr := s.growthOf(c.GetId(), c)
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.recs[c.GetId()] = c
	delete(ix.stale, c.GetId())
	ix.changed(c.GetId())
	if gerr != nil {
		delete(ix.growth, c.GetId()) // measured again at the next check
	} else {
		ix.growth[c.GetId()] = g
	}
}

// measured records id's overlay growth as just measured.
func (ix *index) measured(id string, g uint64) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if _, ok := ix.recs[id]; ok || ix.stale[id] {
		ix.growth[id] = g
	}
}

// growthSum is overlayGrowth from the index: each instance's last measure,
// those not measured yet (or stale: read from disk) measured now.
func (ix *index) growthSum(s *Store) (uint64, error) {
	ix.mu.Lock()
	var sum uint64
	var measure []string
	for id := range ix.recs {
		if g, ok := ix.growth[id]; ok && !ix.stale[id] {
			sum += g
		} else {
			measure = append(measure, id)
		}
	}
	for id := range ix.stale {
		if _, ok := ix.recs[id]; !ok {
			measure = append(measure, id)
		}
	}
	ix.mu.Unlock()
	for _, id := range measure {
		g, err := s.growthOf(id, nil)
		if err != nil {
			return 0, err
		}
		sum += g
	}
	return sum, nil
}

// has reports whether the index knows id.
func (ix *index) has(id string) bool {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	_, ok := ix.recs[id]
	return ok || ix.stale[id]
}

// unsure makes id's entry stale: a read or a write of it failed, so the
// disk may hold anything; it is read from disk at every use from now on.
func (ix *index) unsure(id string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.stale[id] = true
	ix.changed(id)
}

// removed forgets id, whose record was deleted, and lets its uids go.
func (ix *index) removed(id string) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	delete(ix.recs, id)
	delete(ix.stale, id)
	delete(ix.growth, id)
	ix.uids.released(id)
	ix.changed(id)
}

// Records is every record (List's answer, in no order): from the index
// when s keeps one, each a shared copy the caller must not change, else
// List's. A stale entry is read from disk as List reads it: an unreadable
// record is in the *ListError.
func (s *Store) Records() ([]*vmflowv1.InstanceRecord, error) {
	ix := s.ix.Load()
	if ix == nil {
		return s.List()
	}
	ix.mu.Lock()
	recs := make([]*vmflowv1.InstanceRecord, 0, len(ix.recs))
	var stale []string
	for id, r := range ix.recs {
		if ix.stale[id] {
			continue
		}
		recs = append(recs, r)
	}
	for id := range ix.stale {
		stale = append(stale, id)
	}
	ix.mu.Unlock()
	var bad []UnreadableRecord
	for _, id := range stale {
		p, _ := s.Paths(id)
		rec, err := readRecord(p, id)
		switch {
		case errors.Is(err, ErrNotFound):
		case err != nil:
			bad = append(bad, UnreadableRecord{ID: id, Path: p.Record, Err: err})
		default:
			recs = append(recs, rec)
		}
	}
	if len(bad) > 0 {
		return recs, &ListError{Unreadable: bad}
	}
	return recs, nil
}

// IndexDiff compares s's index with a fresh seed from disk (for the host
// model and tests): each record's content and staleness must match, and
// every uid the disk holds must be held by the same instance in the index
// (which may hold more: a uid stays held until its record's delete). inUse
// is the seed's process scan. Empty: they agree; without an index, nil.
func (s *Store) IndexDiff(ctx context.Context, inUse func(context.Context) (map[uint32]bool, error)) ([]string, error) {
	ix := s.ix.Load()
	if ix == nil {
		return nil, nil
	}
	fresh, err := s.seedIndex(ctx, inUse)
	if err != nil {
		return nil, err
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	var diff []string
	for id, r := range fresh.recs {
		have, ok := ix.recs[id]
		switch {
		case ix.stale[id]: // read from disk at every use
		case !ok:
			diff = append(diff, fmt.Sprintf("record %s on disk, not in the index", id))
		case !proto.Equal(have, r):
			diff = append(diff, fmt.Sprintf("record %s differs: index %v, disk %v", id, have, r))
		}
	}
	for id := range ix.recs {
		if _, ok := fresh.recs[id]; !ok && !ix.stale[id] && !fresh.stale[id] {
			diff = append(diff, fmt.Sprintf("record %s in the index, not on disk", id))
		}
	}
	for id := range fresh.stale {
		if !ix.stale[id] {
			diff = append(diff, fmt.Sprintf("record %s unreadable on disk, not stale in the index", id))
		}
	}
	for u, id := range fresh.uids.by {
		have, ok := ix.uids.by[u]
		if !ok || (have != id && have != anyInstance) {
			diff = append(diff, fmt.Sprintf("uid %d held by %q on disk, by %q in the index", u, id, have))
		}
	}
	return diff, nil
}

// guardWrite runs a write of a store without the index holding the agent
// lock shared, so no agent holds it meanwhile: ErrStateDirOwned while one
// does. The indexed store writes through its index and runs write as is.
func (s *Store) guardWrite(write func() error) error {
	if s.ix.Load() != nil {
		return write()
	}
	f, err := os.OpenFile(filepath.Join(s.root, agentLockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("agent lock: %w", err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("%w (%s): stop the agent before writing its records", ErrStateDirOwned, f.Name())
		}
		return fmt.Errorf("agent lock %s: %w", f.Name(), err)
	}
	return write()
}
