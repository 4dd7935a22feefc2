package store

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc/proctest"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// smallFS mounts a tmpfs of size bytes for the test (root only) and returns
// its path.
func smallFS(t *testing.T, size int) string {
	t.Helper()
	proctest.RequiresRoot(t, "mounting a small file system")
	dir, err := os.MkdirTemp("", "vfull")
	require.NoError(t, err)
	require.NoError(t, unix.Mount("tmpfs", dir, "tmpfs", 0, "size="+strconv.Itoa(size)))
	t.Cleanup(func() {
		_ = unix.Unmount(dir, unix.MNT_DETACH)
		_ = os.Remove(dir)
	})
	return dir
}

// fill writes path until the file system says ENOSPC.
func fill(t *testing.T, path string) {
	t.Helper()
	f, err := os.Create(path)
	require.NoError(t, err)
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			require.ErrorIs(t, err, syscall.ENOSPC)
			return
		}
	}
}

// A delete finishes on a full state file system: the manual-stop marker,
// the move to deleting, the stop ladder's record writes and the removal
// itself get through by giving up the reserve. A spawn on the full file
// system is refused before it creates anything, saying how much is free.
// Fails if the marker's write can fail with ENOSPC: the delete could then
// never begin.
func TestDeleteOnFullStateFS(t *testing.T) {
	ctx := context.Background()
	root := smallFS(t, 16<<20)
	s, err := New(filepath.Join(root, "state"), WithReserve(1<<20))
	require.NoError(t, err)
	require.True(t, s.Space().Held, "the reserve is laid down at open")
	mustCreate(t, s, "vm1")
	_, err = s.Transition(ctx, "vm1", running)
	require.NoError(t, err)
	fill(t, filepath.Join(root, "filler"))

	_, err = s.Create(ctx, wantRecord("vm2"))
	require.ErrorIs(t, err, ErrDiskFull)
	assert.Contains(t, err.Error(), "bytes free")
	_, err = os.Lstat(filepath.Join(root, "state", "instances", "vm2"))
	assert.ErrorIs(t, err, os.ErrNotExist, "a refused spawn leaves nothing")

	require.NoError(t, s.MarkManualStop(ctx, "vm1"))
	_, err = s.Transition(ctx, "vm1", deleting)
	require.NoError(t, err)
	for _, step := range []vmflowv1.StopStep{vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT, vmflowv1.StopStep_STOP_STEP_GONE} {
		_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error { r.StopStep = step; return nil })
		require.NoError(t, err)
	}
	require.NoError(t, s.Delete(ctx, "vm1"))
	_, err = s.Get("vm1")
	require.ErrorIs(t, err, ErrNotFound)
	assert.False(t, s.Space().Held, "given up to let the delete through")

	// Space comes back: the next spawn lays the reserve down again first.
	require.NoError(t, os.Remove(filepath.Join(root, "filler")))
	mustCreate(t, s, "vm3")
	assert.True(t, s.Space().Held)
}

// Writes that are not a delete's never take the reserve: an update of a
// running instance on a full file system fails, and the reserve stays.
func TestReserveOnlyForDeletes(t *testing.T) {
	ctx := context.Background()
	root := smallFS(t, 8<<20)
	s, err := New(filepath.Join(root, "state"), WithReserve(1<<20))
	require.NoError(t, err)
	mustCreate(t, s, "vm1")
	fill(t, filepath.Join(root, "filler"))
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error { r.LastError = "x"; return nil })
	require.True(t, errors.Is(err, syscall.ENOSPC), "%v", err)
	assert.True(t, s.Space().Held)
}

// What running overlays may still grow to counts against the free space:
// a spawn that fits the free bytes but not beside the overlays' virtual
// size is refused.
func TestAdmissionCountsOverlayGrowth(t *testing.T) {
	// Through the index, a create sums each overlay as measured at its
	// record's last write (a launch makes the overlay, then writes).
	for _, indexed := range []bool{false, true} {
		t.Run(fmt.Sprintf("indexed=%v", indexed), func(t *testing.T) {
			root := smallFS(t, 16<<20)
			s, err := New(filepath.Join(root, "state"), WithReserve(1<<20))
			require.NoError(t, err)
			if indexed {
				openIndex(t, s, noneInUse)
			}
			mustCreate(t, s, "vm1")
			launched := func() {
				if indexed {
					_, err := s.Update(context.Background(), "vm1", func(r *vmflowv1.InstanceRecord) error {
						r.RestartCount++
						return nil
					})
					require.NoError(t, err)
				}
			}
			p, err := s.Paths("vm1")
			require.NoError(t, err)
			// A qcow2 header saying 64 MiB virtual, almost nothing allocated.
			hdr := make([]byte, 512)
			copy(hdr, "QFI\xfb")
			binary.BigEndian.PutUint32(hdr[4:], 3)
			binary.BigEndian.PutUint64(hdr[24:], 64<<20)
			require.NoError(t, os.WriteFile(p.Overlay, hdr, 0o600))
			launched()
			_, err = s.Create(context.Background(), wantRecord("vm2"))
			require.ErrorIs(t, err, ErrDiskFull)
			assert.Contains(t, err.Error(), "overlays")
			sp := s.Space()
			assert.GreaterOrEqual(t, sp.OverlayGrowth, uint64(63<<20))
			require.NoError(t, os.Remove(p.Overlay))
			launched()
			mustCreate(t, s, "vm2")

			// The new instance's own overlay may grow to its disk's size.
			disk := filepath.Join(t.TempDir(), "disk.raw")
			require.NoError(t, os.WriteFile(disk, nil, 0o600))
			require.NoError(t, os.Truncate(disk, 64<<20))
			big := wantRecord("vm3")
			big.Spec.Disk = disk
			_, err = s.Create(context.Background(), big)
			require.ErrorIs(t, err, ErrDiskFull)
			assert.Contains(t, err.Error(), "its disk may grow to 67108864")
		})
	}
}

// The room a created instance's disk may take counts from its record on,
// not only once its overlay exists: two spawns whose disks fit the state
// file system one at a time but not together get one yes and one
// ErrDiskFull, also when they race. Fails if Create counts only existing
// overlays (the second sees the first's record but no overlay yet), or if
// two creates can check room at the same time.
func TestAdmissionCountsCreatedDisks(t *testing.T) {
	disk := filepath.Join(t.TempDir(), "disk.raw")
	require.NoError(t, os.WriteFile(disk, nil, 0o600))
	require.NoError(t, os.Truncate(disk, 20<<20))
	want := func(id string) *vmflowv1.InstanceRecord {
		w := wantRecord(id)
		w.Spec.Disk = disk
		return w
	}

	for _, indexed := range []bool{false, true} {
		root := smallFS(t, 32<<20)
		s, err := New(filepath.Join(root, "state"), WithReserve(1<<20))
		require.NoError(t, err)
		if indexed {
			openIndex(t, s, noneInUse)
		}
		mustCreate(t, s, "vm1") // no disk
		_, err = s.Create(context.Background(), want("vm2"))
		require.NoError(t, err)
		_, err = s.Create(context.Background(), want("vm3"))
		require.ErrorIs(t, err, ErrDiskFull, "vm2's disk is not launched yet, but may grow to 20 MiB (indexed=%v)", indexed)
	}

	// The race: the first create is held between its record's temp file
	// and the rename while the second one runs. Unserialised, the second
	// finds no record of the first and both are admitted.
	root := smallFS(t, 32<<20)
	var second chan error
	var s *Store
	s, err := New(filepath.Join(root, "state"), WithReserve(1<<20), withAfterTemp(func(string) {
		if second != nil {
			return
		}
		second = make(chan error, 1)
		go func() {
			_, err := s.Create(context.Background(), want("race2"))
			second <- err
		}()
		select {
		case err := <-second:
			second <- err
		case <-time.After(time.Second): // serialised: it waits for this create
		}
	}))
	require.NoError(t, err)
	_, err = s.Create(context.Background(), want("race1"))
	require.NoError(t, err)
	created := 1
	if err := <-second; err == nil {
		created++
	} else {
		require.ErrorIs(t, err, ErrDiskFull)
	}
	assert.Equal(t, 1, created, "room for one 20 MiB disk on a 32 MiB file system")
}
