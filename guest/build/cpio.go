package build

import (
	"errors"
	"fmt"
	"io"
	"math"
	"path"
	"strings"
)

// File type bits of a cpio mode (the same as stat's S_IF*).
const (
	modeDir     = 0o040000
	modeRegular = 0o100000
	modeCharDev = 0o020000
)

// newcMagic starts every header of the "new ASCII" (SVR4, no checksum)
// format, the one the kernel's initramfs unpacker reads.
const newcMagic = "070701"

const newcTrailer = "TRAILER!!!"

// cpioWriter writes a newc cpio archive: a 110-byte ASCII header per entry
// (13 fields of 8 hex digits after the magic), the NUL-terminated name,
// padding to 4 bytes, the data, padding to 4 bytes; then a trailer entry.
// Parents must come before their children because the kernel creates
// entries in archive order. Modification times are 0 so the same inputs give
// the same bytes.
type cpioWriter struct {
	w      io.Writer
	ino    uint32
	dirs   map[string]bool
	names  map[string]bool
	err    error // sticky: the first write error ends the archive
	closed bool
}

func newCPIOWriter(w io.Writer) *cpioWriter {
	return &cpioWriter{w: w, dirs: map[string]bool{".": true}, names: map[string]bool{}}
}

// Dir adds a directory.
func (c *cpioWriter) Dir(name string, perm uint32) error {
	if err := c.add(name, modeDir|perm&0o7777, 2, nil, 0, 0); err != nil {
		return err
	}
	c.dirs[path.Clean(name)] = true
	return nil
}

// File adds a regular file.
func (c *cpioWriter) File(name string, perm uint32, data []byte) error {
	return c.add(name, modeRegular|perm&0o7777, 1, data, 0, 0)
}

// CharDev adds a character device node.
func (c *cpioWriter) CharDev(name string, perm, major, minor uint32) error {
	return c.add(name, modeCharDev|perm&0o7777, 1, nil, major, minor)
}

// Close writes the trailer. It does not close the underlying writer.
func (c *cpioWriter) Close() error {
	if c.err != nil {
		return c.err
	}
	if c.closed {
		return errors.New("cpio: archive already closed")
	}
	c.closed = true
	c.ino++
	c.writeEntry(newcTrailer, 0, 1, nil, 0, 0, 0)
	return c.err
}

func (c *cpioWriter) add(name string, mode, nlink uint32, data []byte, rmajor, rminor uint32) error {
	if c.err != nil {
		return c.err
	}
	if c.closed {
		return errors.New("cpio: write after close")
	}
	clean, err := checkName(name)
	if err != nil {
		return err
	}
	if c.names[clean] {
		return fmt.Errorf("cpio: duplicate entry %q", clean)
	}
	if parent := path.Dir(clean); !c.dirs[parent] {
		return fmt.Errorf("cpio: %q comes before its directory %q", clean, parent)
	}
	if uint64(len(data)) > math.MaxUint32 {
		return fmt.Errorf("cpio: %q is %d bytes, over newc's 4 GiB limit", clean, len(data))
	}
	c.names[clean] = true
	c.ino++
	c.writeEntry(clean, c.ino, nlink, data, mode, rmajor, rminor)
	return c.err
}

// checkName returns the archive form of a path: relative, clean, no NUL.
func checkName(name string) (string, error) {
	if strings.ContainsRune(name, 0) {
		return "", fmt.Errorf("cpio: name %q contains NUL", name)
	}
	clean := path.Clean(strings.TrimLeft(name, "/"))
	if clean == "." || clean == ".." || strings.HasPrefix(clean, "../") || clean == newcTrailer {
		return "", fmt.Errorf("cpio: bad entry name %q", name)
	}
	return clean, nil
}

func (c *cpioWriter) writeEntry(name string, ino, nlink uint32, data []byte, mode, rmajor, rminor uint32) {
	hdr := fmt.Sprintf("%s%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		newcMagic,
		ino, mode, 0 /* uid */, 0 /* gid */, nlink, 0, /* mtime */
		len(data), 0, 0 /* devmajor, devminor */, rmajor, rminor,
		len(name)+1, 0 /* check */)
	c.write([]byte(hdr))
	c.write([]byte(name))
	c.write([]byte{0})
	c.pad(len(hdr) + len(name) + 1)
	c.write(data)
	c.pad(len(data))
}

func (c *cpioWriter) pad(n int) {
	if r := n % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

func (c *cpioWriter) write(b []byte) {
	if c.err != nil || len(b) == 0 {
		return
	}
	if _, err := c.w.Write(b); err != nil {
		c.err = fmt.Errorf("cpio: write: %w", err)
	}
}
