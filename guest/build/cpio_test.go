package build

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// entry is one parsed newc record.
type entry struct {
	name               string
	ino, mode, nlink   uint32
	rmajor, rminor     uint32
	data               []byte
	uid, gid, mtime    uint32
	devmajor, devminor uint32
}

// readNewc is an independent newc reader for the tests: it checks the
// magic, field syntax and 4-byte alignment the kernel's unpacker relies on.
func readNewc(t *testing.T, b []byte) []entry {
	t.Helper()
	var out []entry
	off := 0
	align := func(n int) int { return (n + 3) &^ 3 }
	for {
		require.LessOrEqual(t, off+110, len(b), "truncated header at %d", off)
		h := string(b[off : off+110])
		require.Equal(t, newcMagic, h[:6], "magic at %d", off)
		field := func(i int) uint32 {
			v, err := strconv.ParseUint(h[6+8*i:14+8*i], 16, 32)
			require.NoError(t, err)
			return uint32(v)
		}
		e := entry{ino: field(0), mode: field(1), uid: field(2), gid: field(3), nlink: field(4), mtime: field(5),
			devmajor: field(7), devminor: field(8), rmajor: field(9), rminor: field(10)}
		size, namesize := int(field(6)), int(field(11))
		require.Zero(t, field(12), "check field")
		nameEnd := off + 110 + namesize
		require.LessOrEqual(t, nameEnd, len(b))
		require.Equal(t, byte(0), b[nameEnd-1], "name NUL")
		e.name = string(b[off+110 : nameEnd-1])
		dataOff := align(nameEnd)
		require.LessOrEqual(t, dataOff+size, len(b))
		e.data = b[dataOff : dataOff+size]
		off = align(dataOff + size)
		if e.name == newcTrailer {
			require.Equal(t, len(b), off, "bytes after the trailer")
			return out
		}
		out = append(out, e)
	}
}

func TestCPIOWriterRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	w := newCPIOWriter(&buf)
	require.NoError(t, w.Dir("dev", 0o755))
	require.NoError(t, w.CharDev("/dev/console", 0o600, 5, 1))
	require.NoError(t, w.Dir("lib/", 0o755))
	require.NoError(t, w.File("lib/a", 0o644, []byte("x")))       // 1 byte: 3 bytes of padding
	require.NoError(t, w.File("init", 0o755, []byte("abcdefgh"))) // already aligned
	require.NoError(t, w.File("empty", 0o600, nil))
	require.NoError(t, w.Close())

	got := readNewc(t, buf.Bytes())
	require.Len(t, got, 6)
	want := []struct {
		name  string
		mode  uint32
		data  string
		rdev  [2]uint32
		nlink uint32
	}{
		{"dev", 0o040755, "", [2]uint32{}, 2},
		{"dev/console", 0o020600, "", [2]uint32{5, 1}, 1},
		{"lib", 0o040755, "", [2]uint32{}, 2},
		{"lib/a", 0o100644, "x", [2]uint32{}, 1},
		{"init", 0o100755, "abcdefgh", [2]uint32{}, 1},
		{"empty", 0o100600, "", [2]uint32{}, 1},
	}
	inos := map[uint32]bool{}
	for i, w := range want {
		e := got[i]
		assert.Equal(t, w.name, e.name)
		assert.Equal(t, w.mode, e.mode, "%s mode %o", e.name, e.mode)
		assert.Equal(t, w.data, string(e.data), e.name)
		assert.Equal(t, w.rdev, [2]uint32{e.rmajor, e.rminor}, e.name)
		assert.Equal(t, w.nlink, e.nlink, e.name)
		assert.Zero(t, e.mtime+e.uid+e.gid, "%s: mtime, uid, gid are 0 for reproducible archives", e.name)
		assert.False(t, inos[e.ino], "%s: inode %d reused", e.name, e.ino)
		inos[e.ino] = true
	}
}

func TestCPIOWriterRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		add  func(w *cpioWriter) error
	}{
		{"empty name", func(w *cpioWriter) error { return w.File("", 0o644, nil) }},
		{"root", func(w *cpioWriter) error { return w.Dir("/", 0o755) }},
		{"dot dot", func(w *cpioWriter) error { return w.File("../etc/passwd", 0o644, nil) }},
		{"NUL", func(w *cpioWriter) error { return w.File("a\x00b", 0o644, nil) }},
		{"trailer name", func(w *cpioWriter) error { return w.File(newcTrailer, 0o644, nil) }},
		{"missing parent", func(w *cpioWriter) error { return w.File("lib/modules/x.ko", 0o644, nil) }},
		{"duplicate", func(w *cpioWriter) error {
			if err := w.File("a", 0o644, nil); err != nil {
				return err
			}
			return w.File("/a", 0o644, nil)
		}},
		{"after close", func(w *cpioWriter) error {
			if err := w.Close(); err != nil {
				return err
			}
			return w.File("a", 0o644, nil)
		}},
		{"double close", func(w *cpioWriter) error {
			if err := w.Close(); err != nil {
				return err
			}
			return w.Close()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Error(t, tc.add(newCPIOWriter(&bytes.Buffer{})))
		})
	}
}

type failWriter struct{ n int }

func (f *failWriter) Write(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("disk full")
	}
	f.n--
	return len(p), nil
}

func TestCPIOWriterStickyError(t *testing.T) {
	w := newCPIOWriter(&failWriter{n: 1})
	err := w.File("a", 0o644, []byte("data"))
	require.Error(t, err)
	assert.ErrorContains(t, w.Close(), "disk full")
}

// TestCPIOWriterAgainstGNUCpio cross-checks the archive with GNU cpio
// (Debian does not install it by default; `make tools` does, so CI runs it).
func TestCPIOWriterAgainstGNUCpio(t *testing.T) {
	if _, err := exec.LookPath("cpio"); err != nil {
		t.Skipf("GNU cpio not installed (%v): `make qemu` installs Debian's cpio", err)
	}
	var buf bytes.Buffer
	w := newCPIOWriter(&buf)
	require.NoError(t, w.Dir("lib", 0o755))
	require.NoError(t, w.File("lib/a", 0o640, []byte("hello")))
	require.NoError(t, w.File("init", 0o755, []byte("#!/bin/true\n")))
	require.NoError(t, w.Close())

	dir := t.TempDir()
	cmd := exec.Command("cpio", "-id", "--quiet", "-H", "newc")
	cmd.Dir = dir
	cmd.Stdin = &buf
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
	data, err := os.ReadFile(filepath.Join(dir, "lib", "a"))
	require.NoError(t, err)
	assert.Equal(t, "hello", string(data))
	st, err := os.Stat(filepath.Join(dir, "init"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o755), st.Mode().Perm())
}

func FuzzCPIOWriter(f *testing.F) {
	f.Add("a", []byte("x"))
	f.Add("../x", []byte{})
	f.Add("lib/x", []byte("abc"))
	f.Fuzz(func(t *testing.T, name string, data []byte) {
		var buf bytes.Buffer
		w := newCPIOWriter(&buf)
		if err := w.File(name, 0o644, data); err != nil {
			return
		}
		require.NoError(t, w.Close())
		got := readNewc(t, buf.Bytes())
		require.Len(t, got, 1)
		assert.Equal(t, strings.TrimLeft(got[0].name, "/"), got[0].name)
		assert.True(t, bytes.Equal(data, got[0].data), "data of %q", name)
	})
}
