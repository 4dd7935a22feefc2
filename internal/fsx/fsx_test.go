package fsx

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSameFileAfterUnlink(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.lock")
	f, err := os.Create(path)
	require.NoError(t, err)
	defer f.Close()
	same, err := sameFile(f, path)
	require.NoError(t, err)
	assert.True(t, same)
	require.NoError(t, os.Remove(path))
	same, err = sameFile(f, path)
	require.NoError(t, err)
	assert.False(t, same, "unlinked")
	require.NoError(t, os.WriteFile(path, nil, 0o600))
	same, err = sameFile(f, path)
	require.NoError(t, err)
	assert.False(t, same, "replaced by another inode")
}

// lockTest is a lock path in a fresh directory and a context bounding the test.
func lockTest(t *testing.T) (context.Context, string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx, filepath.Join(t.TempDir(), "a.lock")
}

// TestLockFileExcludesAndGivesUp: a second LockFile on a held lock gives up
// with ErrLockHeld and the context's error when the context ends, and gets
// the lock once the holder releases it.
func TestLockFileExcludesAndGivesUp(t *testing.T) {
	ctx, path := lockTest(t)
	held, err := LockFile(ctx, path)
	require.NoError(t, err)

	short, cancelShort := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancelShort()
	_, err = LockFile(short, path)
	require.ErrorIs(t, err, ErrLockHeld)
	require.ErrorIs(t, err, context.DeadlineExceeded)

	got := make(chan error, 1)
	go func() {
		l, err := LockFile(ctx, path)
		if err == nil {
			err = l.Release(false)
		}
		got <- err
	}()
	require.NoError(t, held.Release(false))
	select {
	case err := <-got:
		require.NoError(t, err, "the waiter got the lock once it was released")
	case <-ctx.Done():
		require.FailNow(t, "the waiter never got the lock")
	}
	_, err = os.Stat(path)
	require.NoError(t, err, "Release(false) keeps the file")
}

// TestLockFileAfterRemove: a lock released with remove unlinks its file,
// and the next LockFile locks a new file at the same path.
func TestLockFileAfterRemove(t *testing.T) {
	ctx, path := lockTest(t)
	l, err := LockFile(ctx, path)
	require.NoError(t, err)
	require.NoError(t, l.Release(true))
	_, err = os.Stat(path)
	require.ErrorIs(t, err, os.ErrNotExist)
	l, err = LockFile(ctx, path)
	require.NoError(t, err)
	same, err := l.Names(path)
	require.NoError(t, err)
	assert.True(t, same)
	require.NoError(t, l.Release(true))
}

func TestWriteFileReplacesAndLeavesNoTemp(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "rec.json")
	var synced string
	renamed := false
	h := &Hooks{
		Synced: func(tmp string) {
			synced = tmp
			b, err := os.ReadFile(path)
			assert.ErrorIs(t, err, os.ErrNotExist, "nothing renamed yet: %q", b)
		},
		Renamed: func() { renamed = true },
	}
	require.NoError(t, WriteFile(path, []byte("one"), h))
	assert.Equal(t, dir, filepath.Dir(synced), "the temp file lives beside the target")
	assert.True(t, renamed)
	require.NoError(t, WriteFile(path, []byte("two"), nil))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, "two", string(b))
	fi, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Len(t, entries, 1, "only the target: %v", entries)
}

func TestInstallRefusesAnotherDirectory(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	tmp := filepath.Join(a, "x")
	require.NoError(t, os.WriteFile(tmp, []byte("x"), 0o600))
	require.Error(t, Install(tmp, filepath.Join(b, "x"), nil))
	require.NoError(t, Install(tmp, filepath.Join(a, "y"), nil))
	got, err := os.ReadFile(filepath.Join(a, "y"))
	require.NoError(t, err)
	assert.Equal(t, "x", string(got))
}

func TestRemoveStaleTemps(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{TempPrefix + "rec.json-1", "rec.json", "tmp-x"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, n), nil, 0o600))
	}
	require.NoError(t, RemoveStaleTemps(dir))
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	assert.Equal(t, []string{"rec.json", "tmp-x"}, names)
	require.NoError(t, RemoveStaleTemps(filepath.Join(dir, "missing")))
}

func TestPIDFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "qemu.pid")
	assert.Zero(t, ReadPIDFile(""))
	assert.Zero(t, ReadPIDFile(path), "missing")
	for _, bad := range []string{"", "x", "-3", "0"} {
		require.NoError(t, os.WriteFile(path, []byte(bad), 0o600))
		assert.Zero(t, ReadPIDFile(path), "%q", bad)
	}
	require.NoError(t, os.WriteFile(path, []byte(strconv.Itoa(4242)+"\n"), 0o600))
	assert.Equal(t, 4242, ReadPIDFile(path))

	RemovePIDFile(path, 4243)
	_, err := os.Stat(path)
	require.NoError(t, err, "a pidfile naming another pid stays")
	RemovePIDFile(path, 4242)
	_, err = os.Stat(path)
	assert.ErrorIs(t, err, os.ErrNotExist)
}
