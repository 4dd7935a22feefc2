package store

import (
	"context"
	"fmt"
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
	rec, err := l.AssignQEMUUID(context.Background(), r, inUse, nil)
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
// run) never hand one uid to two records: the host-wide lock orders them.
func TestAssignQEMUUIDConcurrent(t *testing.T) {
	s := newStore(t)
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
			_, errs[i] = l.AssignQEMUUID(context.Background(), r, noneInUse, nil)
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
}

// qemu_uid changes only through AssignQEMUUID: an Update that sets it (by
// mistake, or to copy another record's) is refused.
func TestUpdateCannotSetQEMUUID(t *testing.T) {
	s := newStore(t)
	mustCreate(t, s, "a")
	_, err := s.Update(context.Background(), "a", func(r *vmflowv1.InstanceRecord) error { r.QemuUid = 300000; return nil })
	assert.ErrorIs(t, err, ErrInvalidRecord)
}
