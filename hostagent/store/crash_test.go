package store

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"vmflow/internal/fsx"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestCrashBetweenTempAndRename kills a writer process (SIGKILL, no chance to
// clean up) after it wrote and fsynced the temp file but before the rename:
// the old record must be intact, the new content must not be visible, and the
// next writer must carry on and clear the leftover (invariant 7).
func TestCrashBetweenTempAndRename(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	mustCreate(t, s, "vm1")
	old, err := s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.State = running
		r.Process = &vmflowv1.ProcessIdentity{Pid: 4242, StartTime: 99, BootId: "boot"}
		return nil
	})
	require.NoError(t, err)

	h := startHelper(t, "crash-writer", s.StateDir(), "vm1")
	tmp := h.expectLine(t, "TEMP ")
	p, err := s.Paths("vm1")
	require.NoError(t, err)
	require.Equal(t, p.Dir, filepath.Dir(tmp), "the temp file lives beside the record")
	b, err := os.ReadFile(tmp)
	require.NoError(t, err)
	require.Contains(t, string(b), "written by the crashing writer", "the new content was fully written")

	require.NoError(t, h.cmd.Process.Signal(syscall.SIGKILL))
	err = h.wait(t)
	require.Error(t, err)
	ws, ok := h.cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "the writer died by SIGKILL: %v", err)

	got, err := s.Get("vm1")
	require.NoError(t, err, "the old record is intact and readable")
	assert.True(t, proto.Equal(old, got))
	_, err = os.Stat(tmp)
	require.NoError(t, err, "the crash left its temp file")

	recs, err := s.List()
	require.NoError(t, err, "a leftover temp file does not disturb List")
	require.Len(t, recs, 1)

	// The lock died with the writer (flock is released on process exit), so
	// the next write goes through and clears the leftover.
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	rec, err := s.Update(lctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.LastError = "after the crash"
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, "after the crash", rec.GetLastError())
	assert.Equal(t, uint32(0), rec.GetRestartCount())
	_, err = os.Stat(tmp)
	assert.ErrorIs(t, err, os.ErrNotExist, "the stale temp file was removed")
}

// TestLockExcludesOtherProcess: while another process holds an instance's
// lock, this one cannot take it (and gives up with its context); once the
// holder lets go, it can.
func TestLockExcludesOtherProcess(t *testing.T) {
	s := newStore(t)
	mustCreate(t, s, "vm1")
	h := startHelper(t, "lock-holder", s.StateDir(), "vm1")
	h.expectLine(t, "LOCKED")

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.LastError = "must not land"
		return nil
	})
	require.ErrorIs(t, err, ErrBusy)
	rec, err := s.Get("vm1")
	require.NoError(t, err)
	assert.Empty(t, rec.GetLastError())

	require.NoError(t, h.stdin.Close()) // tell the holder to unlock and exit
	wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer wcancel()
	l, err := s.Lock(wctx, "vm1")
	require.NoError(t, err, "the lock is free once the holder lets go")
	require.NoError(t, l.Unlock())
	require.NoError(t, h.wait(t))
}

// TestConcurrentUpdatesProcesses: two agent processes incrementing one
// record's counter under the lock lose no update.
func TestConcurrentUpdatesProcesses(t *testing.T) {
	s := newStore(t)
	mustCreate(t, s, "vm1")
	const each = 100
	env := helperCount + "=" + strconv.Itoa(each)
	a := startHelper(t, "incrementer", s.StateDir(), "vm1", env)
	b := startHelper(t, "incrementer", s.StateDir(), "vm1", env)
	a.expectLine(t, "READY")
	b.expectLine(t, "READY")
	// Release both at once; this process joins in too.
	require.NoError(t, a.stdin.Close())
	require.NoError(t, b.stdin.Close())
	require.NoError(t, increment(context.Background(), s, "vm1", each))
	require.NoError(t, a.wait(t))
	require.NoError(t, b.wait(t))

	rec, err := s.Get("vm1")
	require.NoError(t, err)
	assert.Equal(t, uint32(3*each), rec.GetRestartCount())
	entries, err := os.ReadDir(filepath.Join(s.StateDir(), "instances", "vm1"))
	require.NoError(t, err)
	for _, e := range entries {
		assert.False(t, strings.HasPrefix(e.Name(), fsx.TempPrefix), "no temp file left: %s", e.Name())
	}
}

// TestLockFileUnlinkedWhileWaiting: a waiter that opened the lock file before
// the holder unlinked it (the instance was deleted) must not think it holds
// the lock on the dead inode while someone else locks the new file.
func TestLockFileUnlinkedWhileWaiting(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	mustCreate(t, s, "vm1")
	moveTo(t, s, "vm1", deleting)

	holder, err := s.Lock(ctx, "vm1")
	require.NoError(t, err)
	type result struct {
		l   *Locked
		err error
	}
	got := make(chan result, 1)
	go func() {
		l, err := s.Lock(ctx, "vm1")
		got <- result{l, err}
	}()
	// The waiter has the old lock file open by now or will open the new one;
	// either way it must end up holding a lock on the path's current inode.
	require.NoError(t, holder.Delete())
	require.NoError(t, holder.Unlock()) // unlinks the lock file: no instance left

	var w result
	select {
	case w = <-got:
	case <-time.After(30 * time.Second):
		require.FailNow(t, "waiter never got the lock")
	}
	require.NoError(t, w.err)
	defer func() { require.NoError(t, w.l.Unlock()) }()

	// While the waiter holds it, nobody else may get it.
	tctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	_, err = s.Lock(tctx, "vm1")
	require.ErrorIs(t, err, ErrBusy)
	same, err := w.l.lock.Names(filepath.Join(s.StateDir(), "locks", "vm1.lock"))
	require.NoError(t, err)
	assert.True(t, same, "the waiter's lock is on the file the path names")
}
