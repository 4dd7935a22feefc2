package gpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// DevicePath is dev's sysfs directory by dev.Kind (mdev when empty): what
// QEMU's vfio-pci opens and where its iommu_group link is, whatever the driver.
func DevicePath(sysfsRoot string, dev Device) string {
	if dev.Kind == KindVendor {
		return vfPath(sysfsRoot, dev.ID)
	}
	return mdevPath(sysfsRoot, dev.ID)
}

// mdevPath is an mdev's directory: bus/mdev/devices/<uuid>.
func mdevPath(root, id string) string { return filepath.Join(root, "bus", "mdev", "devices", id) }

// vfPath is a PCI function's directory: bus/pci/devices/<address>.
func vfPath(root, vf string) string { return filepath.Join(root, "bus", "pci", "devices", vf) }

// readAttr reads a sysfs attribute, trimmed of its newline.
func readAttr(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

// writeAttr writes val in one write(2), as sysfs expects, returning the errno
// in an *os.PathError. Not os.File: the netpoller would turn mdev remove's
// EAGAIN ("removal in progress") into a wait that never ends.
func writeAttr(path, val string) error {
	// sysfs (kernfs) and FUSE files support poll, so os.File would register
	// them with the netpoller and wait on EAGAIN for writability.
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

// readEntries reads every entry of sysfs folder dir with read; a missing
// folder is empty, an entry vanishing meanwhile is skipped.
func readEntries[T any](ctx context.Context, dir, what string, read func(name string) (T, error)) ([]T, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("vgpu: list %s: %w", what, err)
	}
	var out []T
	for _, e := range ents {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("vgpu: list %s: %w", what, err)
		}
		v, err := read(e.Name())
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}
