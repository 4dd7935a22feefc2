package powercut_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/testsupport/powercut"
)

func write(t *testing.T, path, data string, sync bool) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	require.NoError(t, err)
	_, err = f.WriteString(data)
	require.NoError(t, err)
	if sync {
		require.NoError(t, f.Sync())
	}
	require.NoError(t, f.Close())
}

func syncDir(t *testing.T, dir string) {
	t.Helper()
	d, err := os.Open(dir)
	require.NoError(t, err)
	require.NoError(t, d.Sync())
	require.NoError(t, d.Close())
}

func read(t *testing.T, path string) (string, error) {
	t.Helper()
	b, err := os.ReadFile(path)
	return string(b), err
}

// TestRestartKeepsOnlyWhatWasFsynced: file data needs the file's fsync,
// names need the directory's; Restart brings back exactly that.
func TestRestartKeepsOnlyWhatWasFsynced(t *testing.T) {
	pc := powercut.Start(t)
	d := pc.Dir()
	sub := filepath.Join(d, "sub")
	require.NoError(t, os.Mkdir(sub, 0o700))
	syncDir(t, d)

	write(t, filepath.Join(sub, "both"), "both", true)      // data and name synced
	write(t, filepath.Join(sub, "nameonly"), "lost", false) // name synced, data not
	syncDir(t, sub)
	write(t, filepath.Join(sub, "dataonly"), "data", true) // data synced, name not
	write(t, filepath.Join(sub, "both"), "unsynced", false)

	// A rename over a synced file, not followed by the directory's fsync.
	write(t, filepath.Join(d, "target"), "old", true)
	syncDir(t, d)
	write(t, filepath.Join(d, "tmp"), "new", true)
	require.NoError(t, os.Rename(filepath.Join(d, "tmp"), filepath.Join(d, "target")))
	got, err := read(t, filepath.Join(d, "target"))
	require.NoError(t, err)
	require.Equal(t, "new", got, "before the cut the rename is visible")
	require.Positive(t, pc.Fsyncs())

	require.NoError(t, pc.Restart())

	got, err = read(t, filepath.Join(sub, "both"))
	require.NoError(t, err)
	assert.Equal(t, "both", got, "the write after the last fsync is lost")
	got, err = read(t, filepath.Join(sub, "nameonly"))
	require.NoError(t, err)
	assert.Empty(t, got, "a name synced without its data comes back empty")
	_, err = read(t, filepath.Join(sub, "dataonly"))
	assert.ErrorIs(t, err, os.ErrNotExist, "a create without the directory's fsync is lost")
	got, err = read(t, filepath.Join(d, "target"))
	require.NoError(t, err)
	assert.Equal(t, "old", got, "a rename without the directory's fsync is undone")
	_, err = read(t, filepath.Join(d, "tmp"))
	assert.ErrorIs(t, err, os.ErrNotExist)

	// Renamed and synced: durable.
	write(t, filepath.Join(d, "tmp"), "new", true)
	require.NoError(t, os.Rename(filepath.Join(d, "tmp"), filepath.Join(d, "target")))
	syncDir(t, d)
	require.NoError(t, pc.Restart())
	got, err = read(t, filepath.Join(d, "target"))
	require.NoError(t, err)
	assert.Equal(t, "new", got)
}

// TestCutFailsEverything: after Cut every operation fails with EIO, an
// fsync included, so a writer cannot believe a write after the cut durable.
func TestCutFailsEverything(t *testing.T) {
	pc := powercut.Start(t)
	p := filepath.Join(pc.Dir(), "f")
	f, err := os.Create(p)
	require.NoError(t, err)
	defer f.Close()
	pc.Cut()
	_, err = f.WriteString("x")
	assert.ErrorIs(t, err, syscall.EIO)
	assert.ErrorIs(t, f.Sync(), syscall.EIO)
	_, err = os.Create(filepath.Join(pc.Dir(), "g"))
	assert.ErrorIs(t, err, syscall.EIO)
}

// TestRenameRules: a directory replaces only an empty directory, a file
// only a file.
func TestRenameRules(t *testing.T) {
	pc := powercut.Start(t)
	d := pc.Dir()
	for _, n := range []string{"a", "empty", "full"} {
		require.NoError(t, os.Mkdir(filepath.Join(d, n), 0o700))
	}
	write(t, filepath.Join(d, "full", "x"), "x", false)
	write(t, filepath.Join(d, "file"), "f", false)
	// rename(2) itself: os.Rename refuses any existing directory target.
	assert.ErrorIs(t, unix.Rename(filepath.Join(d, "a"), filepath.Join(d, "full")), syscall.ENOTEMPTY)
	assert.ErrorIs(t, unix.Rename(filepath.Join(d, "a"), filepath.Join(d, "file")), syscall.ENOTDIR)
	require.NoError(t, unix.Rename(filepath.Join(d, "a"), filepath.Join(d, "empty")))
	assert.ErrorIs(t, os.Remove(filepath.Join(d, "full")), syscall.ENOTEMPTY)
	require.NoError(t, os.RemoveAll(filepath.Join(d, "full")))
	for name, exists := range map[string]bool{"a": false, "full": false, "empty": true, "file": true} {
		_, err := os.Stat(filepath.Join(d, name))
		assert.Equal(t, exists, err == nil, "%s: %v", name, err)
	}
}
