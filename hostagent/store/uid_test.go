package store

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

func noneInUse(context.Context) (map[uint32]bool, error) { return nil, nil }

func assign(t *testing.T, s *Store, id string, r UIDRange, inUse func(context.Context) (map[uint32]bool, error)) (uint32, error) {
	t.Helper()
	l, err := s.Lock(context.Background(), id)
	require.NoError(t, err)
	defer func() { require.NoError(t, l.Unlock()) }()
	rec, err := l.AssignQEMUUID(context.Background(), r, inUse)
	if err != nil {
		return 0, err
	}
	return rec.GetQemuUid(), nil
}

func TestParseUIDRange(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want UIDRange
		ok   bool
	}{
		{"200000-265535", UIDRange{200000, 265535}, true},
		{"7-7", UIDRange{7, 7}, true},
		{"0-10", UIDRange{}, false},
		{"10-9", UIDRange{}, false},
		{"10", UIDRange{}, false},
		{"a-b", UIDRange{}, false},
		{"60000-70000", UIDRange{}, false}, // nobody
		{"4294967000-4294967295", UIDRange{}, false},
		{"1-4294967296", UIDRange{}, false},
	} {
		got, err := ParseUIDRange(tc.in)
		if !tc.ok {
			assert.Error(t, err, tc.in)
			continue
		}
		require.NoError(t, err, tc.in)
		assert.Equal(t, tc.want, got)
		assert.Equal(t, tc.in, got.String())
	}
}

// Two instances get different uids, each keeps its own on a second
// assignment (a restart), and a uid no record names but a process holds
// is skipped.
func TestAssignQEMUUIDUniqueAndKept(t *testing.T) {
	s := newStore(t)
	r := UIDRange{First: 300000, Last: 300009}
	for _, id := range []string{"a", "b", "c"} {
		mustCreate(t, s, id)
	}
	busy := func(context.Context) (map[uint32]bool, error) { return map[uint32]bool{300001: true}, nil }
	ua, err := assign(t, s, "a", r, busy)
	require.NoError(t, err)
	ub, err := assign(t, s, "b", r, busy)
	require.NoError(t, err)
	assert.Equal(t, uint32(300000), ua)
	assert.Equal(t, uint32(300002), ub, "300001 is held by a process: not reused")

	again, err := assign(t, s, "a", r, busy)
	require.NoError(t, err)
	assert.Equal(t, ua, again, "a restart keeps the instance's uid")

	// a's uid is now held by a stranger (no QEMU of a runs at a launch):
	// a moves to a free one, never to b's.
	stranger := func(context.Context) (map[uint32]bool, error) { return map[uint32]bool{ua: true, 300001: true}, nil }
	moved, err := assign(t, s, "a", r, stranger)
	require.NoError(t, err)
	assert.Equal(t, uint32(300003), moved)

	// A range that no longer holds b's uid gives b one of the new range.
	ub2, err := assign(t, s, "b", UIDRange{First: 400000, Last: 400000}, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, uint32(400000), ub2)
	_, err = assign(t, s, "c", UIDRange{First: 400000, Last: 400000}, noneInUse)
	assert.ErrorIs(t, err, ErrNoFreeUID)
	rec, err := s.Get("c")
	require.NoError(t, err)
	assert.Zero(t, rec.GetQemuUid(), "a failed assignment writes nothing")
}

// Concurrent assignments (each instance under its own lock, as launches
// run) never hand one uid to two records: the host-wide lock orders them,
// whether each reads the disk or the store's index (which then still
// agrees with the disk).
func TestAssignQEMUUIDConcurrent(t *testing.T) {
	for _, indexed := range []bool{false, true} {
		t.Run(fmt.Sprintf("indexed=%v", indexed), func(t *testing.T) {
			s := newStore(t)
			if indexed {
				openIndex(t, s, noneInUse)
			}
			const n = 12
			for i := range n {
				mustCreate(t, s, fmt.Sprintf("vm%d", i))
			}
			r := UIDRange{First: 500000, Last: 500000 + n - 1}
			var wg sync.WaitGroup
			errs := make([]error, n)
			for i := range n {
				wg.Go(func() {
					l, err := s.Lock(context.Background(), fmt.Sprintf("vm%d", i))
					if err != nil {
						errs[i] = err
						return
					}
					defer l.Unlock()
					_, errs[i] = l.AssignQEMUUID(context.Background(), r, noneInUse)
				})
			}
			wg.Wait()
			seen := map[uint32]string{}
			for i := range n {
				require.NoError(t, errs[i])
				rec, err := s.Get(fmt.Sprintf("vm%d", i))
				require.NoError(t, err)
				u := rec.GetQemuUid()
				require.True(t, r.Contains(u), "uid %d", u)
				require.NotContains(t, seen, u, "uid %d in %s and %s", u, seen[u], rec.GetId())
				seen[u] = rec.GetId()
			}
			assertIndexAgrees(t, s)
		})
	}
}

// qemu_uid changes only through AssignQEMUUID: an Update that sets it (by
// mistake, or to copy another record's) is refused.
func TestUpdateCannotSetQEMUUID(t *testing.T) {
	s := newStore(t)
	mustCreate(t, s, "a")
	_, err := s.Update(context.Background(), "a", func(r *vmflowv1.InstanceRecord) error { r.QemuUid = 300000; return nil })
	assert.ErrorIs(t, err, ErrInvalidRecord)
}

// "Can't tell" is "taken": the uid of a record that became unreadable
// (quarantined: its QEMU gone, its /dev/vfio node perhaps still its uid's)
// is never handed to another instance, whatever is left of the record; nor
// is a uid that owns a file in another instance's directory. Once the
// quarantined record is repaired or deleted, its uid is free again.
func TestAssignQEMUUIDCannotTellIsTaken(t *testing.T) {
	s := newStore(t)
	r := UIDRange{First: 300000, Last: 300009}
	for _, id := range []string{"a", "b", "c", "d"} {
		mustCreate(t, s, id)
	}
	ua, err := assign(t, s, "a", r, noneInUse)
	require.NoError(t, err)
	require.Equal(t, uint32(300000), ua)

	// a's record is cut in half: nothing in it names its uid any more.
	p, good := cutRecord(t, s, "a")
	_, err = s.Get("a")
	require.ErrorIs(t, err, ErrInvalidRecord)

	ub, err := assign(t, s, "b", r, noneInUse)
	require.NoError(t, err)
	assert.NotEqual(t, ua, ub, "the quarantined record's uid is not reused")

	// A file in c's directory owned by a uid no record names: c's QEMU (or
	// a jail for it) may still use it.
	pc, err := s.Paths("c")
	require.NoError(t, err)
	f := filepath.Join(pc.Dir, "left-by-qemu")
	require.NoError(t, os.WriteFile(f, nil, 0o600))
	require.NoError(t, os.Lchown(f, 300001, 300001))
	ud, err := assign(t, s, "d", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, uint32(300002), ud, "300000 quarantined, 300001 owns a file in c's directory")

	// Repaired, a keeps its own uid; b's and d's stay theirs.
	require.NoError(t, os.WriteFile(p.Record, good, 0o600))
	again, err := assign(t, s, "a", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, ua, again)

	// Deleted, a's uid is free for the next instance.
	moveTo(t, s, "a", deleting)
	require.NoError(t, s.Delete(context.Background(), "a"))
	require.NoError(t, os.Remove(f))
	mustCreate(t, s, "e")
	ue, err := assign(t, s, "e", r, noneInUse)
	require.NoError(t, err)
	assert.Equal(t, ua, ue, "a deleted record's uid is free again")
}

// The default range lies outside every subordinate range Debian's useradd
// can hand out (SUB_UID_MIN 100000, SUB_UID_COUNT 65536, SUB_UID_MAX
// 600100000) and outside systemd's container and foreign ranges. The old
// default (200000-265535) overlapped the second and third users' ranges.
func TestDefaultQEMUUIDRangeOutsideHandedOutRanges(t *testing.T) {
	d := DefaultQEMUUIDRange
	for first := uint64(100000); first <= 600100000; first += 65536 {
		last := first + 65535
		require.False(t, first <= uint64(d.Last) && last >= uint64(d.First),
			"default %s overlaps useradd's subordinate range %d-%d", d, first, last)
	}
	assert.Greater(t, d.First, uint32(1879048191), "above systemd-nspawn's container ranges")
	assert.Less(t, d.Last, uint32(2147352576), "below systemd's foreign range")
	_, err := ParseUIDRange(d.String())
	require.NoError(t, err)
	assert.NoError(t, CheckUIDRange(d, writeEtc(t, debianEtc)))
}

// debianEtc is what useradd leaves on a Debian host with three users.
var debianEtc = map[string]string{
	"passwd": "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n" +
		"alice:x:1000:1000::/home/alice:/bin/bash\nbob:x:1001:1001::/home/bob:/bin/bash\ncarol:x:1002:1002::/home/carol:/bin/bash\n",
	"group":  "root:x:0:\nalice:x:1000:\nbob:x:1001:\ncarol:x:1002:\nbig:x:300500:\n",
	"subuid": "alice:100000:65536\nbob:165536:65536\ncarol:231072:65536\n",
	"subgid": "alice:100000:65536\nbob:165536:65536\n# a comment\n\ncarol:231072:65536\n",
}

func writeEtc(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, body := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
	return dir
}

// A range that a subordinate range, an account or a group also hands out
// is refused with every overlap named, file and line; a missing file hands
// out nothing.
func TestCheckUIDRange(t *testing.T) {
	etc := writeEtc(t, debianEtc)
	err := CheckUIDRange(UIDRange{First: 200000, Last: 265535}, etc)
	require.ErrorIs(t, err, ErrUIDRangeTaken)
	for _, want := range []string{
		filepath.Join(etc, "subuid") + " line 2 (bob:165536:65536)",
		filepath.Join(etc, "subuid") + " line 3 (carol:231072:65536)",
		filepath.Join(etc, "subgid") + " line 5 (carol:231072:65536)",
	} {
		assert.Contains(t, err.Error(), want)
	}
	assert.NotContains(t, err.Error(), "alice")

	err = CheckUIDRange(UIDRange{First: 300400, Last: 300600}, etc)
	require.ErrorIs(t, err, ErrUIDRangeTaken)
	assert.Contains(t, err.Error(), "group line 5 (big:x:300500:)")
	err = CheckUIDRange(UIDRange{First: 1001, Last: 1001}, etc)
	require.ErrorIs(t, err, ErrUIDRangeTaken)
	assert.Contains(t, err.Error(), "passwd line 4 (bob:x:1001:1001::/home/bob:/bin/bash)")

	assert.NoError(t, CheckUIDRange(UIDRange{First: 296608, Last: 300000}, etc))
	assert.NoError(t, CheckUIDRange(UIDRange{First: 200000, Last: 265535}, t.TempDir()), "no files: nothing handed out")
}
