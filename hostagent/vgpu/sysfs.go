package vgpu

import (
	"os"
	"strings"
	"syscall"
)

// readAttr reads a sysfs attribute, trimmed of its newline.
func readAttr(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

// writeAttr writes val in one write(2), as sysfs expects, and returns the
// kernel's errno wrapped in an *os.PathError.
//
// It bypasses os.File on purpose: sysfs (kernfs) and FUSE files support
// poll, so os.File registers them with Go's netpoller and treats an EAGAIN
// from write(2) as "would block", waiting for writability that never comes.
// mdev remove answers EAGAIN for "removal in progress", and that must reach
// the caller as an error, not hang it.
func writeAttr(path, val string) error {
	fd, err := syscall.Open(path, syscall.O_WRONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: path, Err: err}
	}
	n, werr := writeRetryEINTR(fd, []byte(val))
	cerr := syscall.Close(fd)
	switch {
	case werr != nil:
		return &os.PathError{Op: "write", Path: path, Err: werr}
	case n != len(val):
		return &os.PathError{Op: "write", Path: path, Err: syscall.EIO}
	case cerr != nil:
		return &os.PathError{Op: "close", Path: path, Err: cerr}
	}
	return nil
}

func writeRetryEINTR(fd int, b []byte) (int, error) {
	for {
		n, err := syscall.Write(fd, b)
		if err != syscall.EINTR {
			return n, err
		}
	}
}
