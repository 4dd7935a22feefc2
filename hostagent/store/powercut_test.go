package store

import (
	"context"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/powercut"
)

// A SIGKILL keeps the page cache: only a power cut proves the fsyncs of
// invariant 7. These tests run the store on powercut, a FUSE file system
// that forgets every write not yet fsynced when told to lose power.

// seqOf is the write number a power-cut writer put in the record.
func seqOf(t *testing.T, r *vmflowv1.InstanceRecord) int {
	t.Helper()
	if r.GetLastError() == "" {
		return 0 // as created
	}
	n, err := strconv.Atoi(r.GetLastError())
	require.NoError(t, err, "a record no writer wrote: %q", r.GetLastError())
	return n
}

func setSeq(ctx context.Context, s *Store, id string, n int) error {
	_, err := s.Update(ctx, id, func(r *vmflowv1.InstanceRecord) error {
		r.LastError = strconv.Itoa(n)
		return nil
	})
	return err
}

// TestPowerCutAfterWriteReturned: a create or an update that returned is
// there after a power cut, whole. Fails without the file's fsync (the
// record comes back empty) and without the directory's (the created record
// is missing, the updated one is the old one).
func TestPowerCutAfterWriteReturned(t *testing.T) {
	pc := powercut.Start(t)
	ctx := context.Background()
	state := filepath.Join(pc.Dir(), "state")
	s, err := New(state)
	require.NoError(t, err)
	created := mustCreate(t, s, "vm1")

	require.NoError(t, pc.Restart())
	s, err = New(state)
	require.NoError(t, err)
	got, err := s.Get("vm1")
	require.NoError(t, err, "the created record survives the power cut")
	assert.True(t, proto.Equal(created, got), "as created: %v", got)

	require.NoError(t, setSeq(ctx, s, "vm1", 1))
	require.NoError(t, pc.Restart())
	s, err = New(state)
	require.NoError(t, err)
	got, err = s.Get("vm1")
	require.NoError(t, err, "the updated record survives the power cut")
	assert.Equal(t, 1, seqOf(t, got), "the update that returned is durable")
}

// TestPowerCutDuringWrites: a writer updates a record in a loop and the
// power goes at an arbitrary instant of a write, then exactly between the
// temp file's fsync and its rename. After each restart the record is the
// last write that returned or the one in flight: never older, never empty,
// torn or missing.
func TestPowerCutDuringWrites(t *testing.T) {
	pc := powercut.Start(t)
	state := filepath.Join(pc.Dir(), "state")
	s, err := New(state)
	require.NoError(t, err)
	mustCreate(t, s, "vm1")

	var acked, attempted int // the last write that returned nil; the last begun
	check := func(round int, what string) *Store {
		t.Helper()
		require.NoError(t, pc.Restart())
		s, err := New(state)
		require.NoError(t, err, "round %d (%s)", round, what)
		got, err := s.Get("vm1")
		require.NoError(t, err, "round %d (%s): the record after the power cut", round, what)
		n := seqOf(t, got)
		require.GreaterOrEqual(t, n, acked, "round %d (%s): a write that returned was lost", round, what)
		require.LessOrEqual(t, n, attempted, "round %d (%s)", round, what)
		acked, attempted = n, n
		return s
	}

	const rounds = 12
	for round := range rounds {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		var done atomic.Int64
		done.Store(int64(acked))
		finished := make(chan int, 1) // the last write begun
		go func() {
			i := acked
			for {
				i++
				if err := setSeq(ctx, s, "vm1", i); err != nil {
					finished <- i
					return
				}
				done.Store(int64(i))
			}
		}()
		// Cut once the writer is a few writes in: wherever it is then.
		target := int64(acked + 1 + round%4)
		require.Eventually(t, func() bool { return done.Load() >= target }, 20*time.Second, time.Millisecond)
		pc.Cut()
		select {
		case attempted = <-finished:
		case <-ctx.Done():
			require.FailNow(t, "the writer did not stop after the power cut")
		}
		acked = int(done.Load())
		cancel()
		s = check(round, "anywhere")
	}

	// Exactly between the temp file's fsync and the rename.
	s, err = New(state, withAfterTemp(func(string) { pc.Cut() }))
	require.NoError(t, err)
	attempted = acked + 1
	require.Error(t, setSeq(context.Background(), s, "vm1", attempted), "the rename after the cut fails")
	check(rounds, "after the temp's fsync")
}
