package store

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/internal/fsx"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// openIndex opens s's index with inUse as the seed's process scan.
func openIndex(t *testing.T, s *Store, inUse func(context.Context) (map[uint32]bool, error)) {
	t.Helper()
	require.NoError(t, s.OpenIndex(context.Background(), inUse))
	t.Cleanup(func() { _ = s.Close() })
}

// assertIndexAgrees: the index is what a fresh seed from disk reads.
func assertIndexAgrees(t *testing.T, s *Store) {
	t.Helper()
	diff, err := s.IndexDiff(context.Background(), noneInUse)
	require.NoError(t, err)
	assert.Empty(t, diff, "the index disagrees with the disk")
}

// cutRecord cuts id's record in half on disk, as a torn write or a hand
// would, and returns its paths and the bytes it held.
func cutRecord(t *testing.T, s *Store, id string) (Paths, []byte) {
	t.Helper()
	p, err := s.Paths(id)
	require.NoError(t, err)
	good, err := os.ReadFile(p.Record)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, good[:len(good)/2], 0o600))
	return p, good
}

// recordIDs are the ids Records answers, and those it names unreadable.
func recordIDs(t *testing.T, s *Store) (readable, unreadable []string) {
	t.Helper()
	recs, err := s.Records()
	bad, listed := Unreadable(err)
	require.True(t, listed, "%v", err)
	for _, r := range recs {
		readable = append(readable, r.GetId())
	}
	for _, u := range bad {
		unreadable = append(unreadable, u.ID)
	}
	return readable, unreadable
}

// The seed keeps "can't tell is taken": a record unreadable at the start
// keeps its uid (its ledger entry) and is named unreadable by Records; a
// uid owning a file of an instance's directory, a ledger entry naming no
// id, and a uid a process held at the seed are taken. Through the index a
// repaired record keeps its uid, a deleted one's is free again, and the
// process's uid stays taken until the next seed.
func TestIndexSeedCannotTellIsTaken(t *testing.T) {
	s := newStore(t)
	r := UIDRange{First: 300000, Last: 300009}
	for _, id := range []string{"a", "b", "c"} {
		mustCreate(t, s, id)
	}
	ua, err := assign(t, s, "a", r, noneInUse)
	require.NoError(t, err)
	require.Equal(t, uint32(300000), ua)
	p, good := cutRecord(t, s, "a")
	pc, err := s.Paths("c")
	require.NoError(t, err)
	f := filepath.Join(pc.Dir, "left-by-qemu")
	require.NoError(t, os.WriteFile(f, nil, 0o600))
	require.NoError(t, os.Lchown(f, 300001, 300001))
	require.NoError(t, os.WriteFile(filepath.Join(s.StateDir(), uidsDir, "300002"), []byte("../not-an-id\n"), 0o600))

	// The agent starts: a process holds 300003 (no record names it).
	openIndex(t, s, func(context.Context) (map[uint32]bool, error) { return map[uint32]bool{300003: true}, nil })
	readable, unreadable := recordIDs(t, s)
	assert.ElementsMatch(t, []string{"b", "c"}, readable)
	assert.Equal(t, []string{"a"}, unreadable, "an unreadable record is named, not skipped")
	ub, err := assign(t, s, "b", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, uint32(300004), ub, "300000 a quarantined record's, 300001 owns c's file, 300002 a ledger entry of no id, 300003 a process's")
	assertIndexAgrees(t, s)

	// Repaired, a keeps its uid; deleted, its uid is the next one's.
	require.NoError(t, os.WriteFile(p.Record, good, 0o600))
	again, err := assign(t, s, "a", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, ua, again)
	moveTo(t, s, "a", deleting)
	require.NoError(t, s.Delete(context.Background(), "a"))
	mustCreate(t, s, "d")
	ud, err := assign(t, s, "d", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, ua, ud, "a deleted record's uid is free again")
	mustCreate(t, s, "e")
	ue, err := assign(t, s, "e", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, uint32(300005), ue, "the seed's process keeps 300003 until the next seed")
	assertIndexAgrees(t, s)

	// The next start seeds again: no process holds 300003 any more.
	require.NoError(t, s.Close())
	openIndex(t, s, noneInUse)
	mustCreate(t, s, "g")
	ug, err := assign(t, s, "g", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, uint32(300003), ug)
}

// An instance keeps holding the uid it had after it gets another (its
// files may still be the old uid's) until its record is deleted.
func TestIndexOldUIDHeldUntilDelete(t *testing.T) {
	s := newStore(t)
	openIndex(t, s, noneInUse)
	for _, id := range []string{"a", "b", "c"} {
		mustCreate(t, s, id)
	}
	r := UIDRange{First: 300000, Last: 300001}
	ua, err := assign(t, s, "a", r, noneInUse)
	require.NoError(t, err)
	require.Equal(t, uint32(300000), ua)
	moved, err := assign(t, s, "a", UIDRange{First: 400000, Last: 400000}, noneInUse)
	require.NoError(t, err)
	require.Equal(t, uint32(400000), moved)
	ub, err := assign(t, s, "b", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, uint32(300001), ub, "a's old uid is still a's")
	_, err = assign(t, s, "c", r, noneInUse)
	assert.ErrorIs(t, err, ErrNoFreeUID)

	moveTo(t, s, "a", deleting)
	require.NoError(t, s.Delete(context.Background(), "a"))
	uc, err := assign(t, s, "c", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, ua, uc, "free once a's record is deleted")
	assertIndexAgrees(t, s)
}

// A process holding an instance's own uid at the seed (its QEMU then, or
// a stranger) is looked for again before the instance keeps the uid: held
// by a process still, the uid is given up; no longer, it is kept.
func TestIndexRechecksAUIDAProcessHeldAtTheSeed(t *testing.T) {
	s := newStore(t)
	r := UIDRange{First: 300000, Last: 300009}
	mustCreate(t, s, "a")
	ua, err := assign(t, s, "a", r, noneInUse)
	require.NoError(t, err)
	busy := func(context.Context) (map[uint32]bool, error) { return map[uint32]bool{ua: true}, nil }
	openIndex(t, s, busy)
	kept, err := assign(t, s, "a", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, ua, kept, "no process holds it now")

	require.NoError(t, s.Close())
	openIndex(t, s, busy)
	moved, err := assign(t, s, "a", r, busy)
	require.NoError(t, err)
	assert.NotEqual(t, ua, moved, "a stranger holds it: given up")
}

// Records answers from the index: what was created, updated and deleted,
// as written, without reading a readable record again.
func TestIndexWritesThrough(t *testing.T) {
	s := newStore(t)
	openIndex(t, s, noneInUse)
	mustCreate(t, s, "a")
	mustCreate(t, s, "b")
	moveTo(t, s, "a", running)
	readable, _ := recordIDs(t, s)
	assert.ElementsMatch(t, []string{"a", "b"}, readable)
	recs, err := s.Records()
	require.NoError(t, err)
	for _, r := range recs {
		if r.GetId() == "a" {
			assert.Equal(t, running, r.GetState())
		}
	}
	moveTo(t, s, "b", deleting)
	require.NoError(t, s.Delete(context.Background(), "b"))
	readable, _ = recordIDs(t, s)
	assert.Equal(t, []string{"a"}, readable)
	assertIndexAgrees(t, s)
}

// A record cut by hand after the seed is seen at the agent's next read of
// it (here a Get; the agent lists the records every 15 s for its metrics): from
// then on Records names it unreadable, as without the index, until it is
// repaired. Before that read the index answers what the record last held.
func TestIndexSeesARecordCorruptedAfterTheSeed(t *testing.T) {
	s := newStore(t)
	openIndex(t, s, noneInUse)
	mustCreate(t, s, "a")
	p, good := cutRecord(t, s, "a")
	readable, _ := recordIDs(t, s)
	assert.Equal(t, []string{"a"}, readable, "not read since: what it last held")

	_, err := s.Get("a")
	require.ErrorIs(t, err, ErrInvalidRecord)
	readable, unreadable := recordIDs(t, s)
	assert.Empty(t, readable)
	assert.Equal(t, []string{"a"}, unreadable, "seen: unreadable, taken")
	assertIndexAgrees(t, s)

	require.NoError(t, os.WriteFile(p.Record, good, 0o600))
	readable, unreadable = recordIDs(t, s)
	assert.Equal(t, []string{"a"}, readable, "repaired: read from disk")
	assert.Empty(t, unreadable)
}

// A write that failed may have reached the disk (here the new record is
// in place and the rename fails): the index does not claim the old record,
// it reads the disk for it until the next write.
func TestIndexFailedWriteReadsTheDisk(t *testing.T) {
	dir, err := os.MkdirTemp("", "vst")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	fail := false
	s, err := New(dir, withAfterTemp(func(tmp string) {
		if !fail {
			return
		}
		b, err := os.ReadFile(tmp)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(filepath.Dir(tmp), RecordFile), b, 0o600))
		require.NoError(t, os.Remove(tmp))
	}))
	require.NoError(t, err)
	openIndex(t, s, noneInUse)
	mustCreate(t, s, "a")
	fail = true
	_, err = s.Update(context.Background(), "a", func(r *vmflowv1.InstanceRecord) error {
		r.LastError = "on disk, though the write failed"
		return nil
	})
	require.Error(t, err)
	fail = false
	recs, err := s.Records()
	require.NoError(t, err)
	require.Len(t, recs, 1)
	assert.Equal(t, "on disk, though the write failed", recs[0].GetLastError())
	assertIndexAgrees(t, s)
}

// Records hands out the index's copies: what the caller got back from a
// write is not them (changing it changes no later answer).
func TestIndexKeepsItsOwnCopies(t *testing.T) {
	s := newStore(t)
	openIndex(t, s, noneInUse)
	rec := mustCreate(t, s, "a")
	rec.LastError = "changed by a caller"
	recs, err := s.Records()
	require.NoError(t, err)
	require.Len(t, recs, 1)
	assert.Empty(t, recs[0].GetLastError())
}

// One agent owns a state dir: while a store holds its index, a second one
// cannot open its own, and a store without one writes no record, uid or
// delete behind it (refused, nothing written); once the owner closes, or
// its process is killed -9, the others may.
func TestIndexOwnsTheStateDir(t *testing.T) {
	s := newStore(t)
	mustCreate(t, s, "a")
	openIndex(t, s, noneInUse)
	other, err := New(s.StateDir())
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, other.OpenIndex(ctx, noneInUse), ErrStateDirOwned)

	_, err = other.Create(context.Background(), wantRecord("b"))
	assert.ErrorIs(t, err, ErrStateDirOwned)
	_, err = other.Update(context.Background(), "a", func(r *vmflowv1.InstanceRecord) error { r.LastError = "behind"; return nil })
	assert.ErrorIs(t, err, ErrStateDirOwned)
	_, err = assign(t, other, "a", UIDRange{First: 300000, Last: 300000}, noneInUse)
	assert.ErrorIs(t, err, ErrStateDirOwned)
	moveTo(t, s, "a", deleting)
	assert.ErrorIs(t, other.Delete(context.Background(), "a"), ErrStateDirOwned)
	ids, err := s.IDs()
	require.NoError(t, err)
	assert.Equal(t, []string{"a"}, ids, "no directory left by the refused create")
	assertIndexAgrees(t, s)

	require.NoError(t, s.Close())
	mustCreate(t, other, "b")

	// An agent in another process, killed -9: the kernel lets its lock go.
	h := startHelper(t, "indexer", s.StateDir(), "")
	h.expectLine(t, "INDEXED")
	_, err = other.Create(context.Background(), wantRecord("c"))
	assert.ErrorIs(t, err, ErrStateDirOwned)
	require.NoError(t, h.cmd.Process.Signal(syscall.SIGKILL))
	require.Error(t, h.wait(t))
	mustCreate(t, other, "c")
}

// The agent lock is a lock file like the others: held, it excludes fsx's
// exclusive lockers too (the second agent's OpenIndex polls it).
func TestIndexLockIsTheAgentLock(t *testing.T) {
	s := newStore(t)
	openIndex(t, s, noneInUse)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := fsx.LockFile(ctx, filepath.Join(s.StateDir(), agentLockFile))
	assert.ErrorIs(t, err, fsx.ErrLockHeld)
}
