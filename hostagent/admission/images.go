package admission

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Why an image file is refused. Each is wrapped in a FieldError naming the
// field, so errors.Is(err, ErrInvalid) holds as well.
var (
	// ErrOutsideRoots: the path lies under none of the agent's --image-root.
	ErrOutsideRoots = errdefs.InvalidInput.New("outside the image roots")
	// ErrEscapesRoot: following the path (a symlink in it) leads out of its
	// image root.
	ErrEscapesRoot = errdefs.InvalidInput.New("leaves its image root")
	// ErrUnsafeImage: the root, a folder on the way or the file itself is
	// not owned by root, or is group- or other-writable: someone other than
	// root could change what VMs boot.
	ErrUnsafeImage = errdefs.InvalidInput.New("not owned by root or writable by group or others")
	// ErrNotWorldReadable: a kernel or initrd QEMU could not re-open. QEMU
	// opens /proc/self/fd/N again with a permission check on the file's own
	// mode, as the unprivileged user it runs as.
	ErrNotWorldReadable = errdefs.InvalidInput.New("not world-readable")
)

// openRetries bounds openat2's EAGAIN: with RESOLVE_BENEATH the kernel
// refuses a walk a concurrent rename may have raced, and asks to retry.
const openRetries = 8

// ImageRoots are the agent's --image-root folders, each opened once when the
// agent starts (an O_PATH descriptor, held for its life) so that every image
// is opened beneath the folder that was configured, never by a path resolved
// again: a symlink swapped after admission cannot make a launch open a file
// outside the root, and QEMU is handed the descriptors the agent opened.
//
// Every image is opened with openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
// from its root: a relative symlink that stays inside the root is followed,
// one that leaves it (or an absolute one) fails. The root, every folder on
// the way to the image and the image itself must be owned by root and not
// group- or other-writable; the root's parents are not checked (/tmp is
// 1777). That is checked at every open, not at start: an agent with a bad
// root keeps running and refuses only the spawns that use it.
//
// A nil *ImageRoots has no roots. Safe for concurrent use.
type ImageRoots struct {
	roots []imageRoot
}

type imageRoot struct {
	path string   // absolute and clean, as configured
	real string   // path with its symlinks resolved when it was opened
	dir  *os.File // O_PATH | O_DIRECTORY
}

// OpenImageRoots opens each folder of paths (made absolute); a missing or
// non-directory one is an error, its ownership checked at each use.
func OpenImageRoots(paths []string) (*ImageRoots, error) {
	r := &ImageRoots{}
	for _, p := range paths {
		abs, err := filepath.Abs(p)
		if err != nil {
			r.Close()
			return nil, fmt.Errorf("image root %q: %w", p, err)
		}
		fd, err := unix.Open(abs, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			r.Close()
			return nil, fmt.Errorf("image root %s: %w", abs, &fs.PathError{Op: "open", Path: abs, Err: err})
		}
		dir := os.NewFile(uintptr(fd), abs)
		real, err := fdPath(dir)
		if err != nil {
			dir.Close()
			r.Close()
			return nil, fmt.Errorf("image root %s: %w", abs, err)
		}
		r.roots = append(r.roots, imageRoot{path: abs, real: real, dir: dir})
	}
	return r, nil
}

// Close releases the roots' descriptors.
func (r *ImageRoots) Close() error {
	if r == nil {
		return nil
	}
	var errs []error
	for _, root := range r.roots {
		if err := root.dir.Close(); err != nil && !errors.Is(err, fs.ErrClosed) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Paths are the roots as configured (absolute).
func (r *ImageRoots) Paths() []string {
	if r == nil {
		return nil
	}
	out := make([]string, len(r.roots))
	for i, root := range r.roots {
		out[i] = root.path
	}
	return out
}

// Locate maps an absolute, clean path to the innermost root it lies under (as
// configured or resolved) and its relative path, reading nothing.
func (r *ImageRoots) Locate(p string) (*vmflowv1.ImageRef, error) {
	if !filepath.IsAbs(p) {
		return nil, fmt.Errorf("%q is not an absolute path", p)
	}
	if filepath.Clean(p) != p || strings.ContainsRune(p, 0) {
		return nil, fmt.Errorf("%q is not a clean path (no .., //, or trailing /)", p)
	}
	if r == nil || len(r.roots) == 0 {
		return nil, fmt.Errorf("%q: this host has no --image-root: %w", p, ErrOutsideRoots)
	}
	var best *vmflowv1.ImageRef
	for _, root := range r.roots {
		for _, base := range []string{root.path, root.real} {
			rel, ok := beneath(base, p)
			if ok && (best == nil || len(rel) < len(best.GetPath())) {
				best = &vmflowv1.ImageRef{Root: root.path, Path: rel}
			}
		}
	}
	if best == nil {
		return nil, fmt.Errorf("%q is not under any image root (%s): %w", p, strings.Join(r.Paths(), ", "), ErrOutsideRoots)
	}
	return best, nil
}

// beneath returns p relative to dir when p lies strictly inside it.
func beneath(dir, p string) (string, bool) {
	rel, err := filepath.Rel(dir, p)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", false
	}
	return rel, true
}

// Open opens ref's image read-only beneath its root, checking it is a regular
// file reached only through root-owned, not group/other-writable folders (boot
// files world-readable). The caller owns the file, named root/path.
func (r *ImageRoots) Open(ref *vmflowv1.ImageRef, boot bool) (*os.File, error) {
	root, err := r.root(ref.GetRoot())
	if err != nil {
		return nil, err
	}
	rel := ref.GetPath()
	name := filepath.Join(root.path, rel)
	if err := checkRel(rel); err != nil {
		return nil, fmt.Errorf("%q in image root %s: %w", rel, root.path, err)
	}
	if err := checkOwner(root.dir, root.path); err != nil {
		return nil, err
	}
	// O_NONBLOCK: a FIFO in the root must not block the agent; cleared
	// once the file is known to be regular.
	fd, err := openBeneath(root.dir, rel, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY|unix.O_NONBLOCK)
	if err != nil {
		return nil, openError(name, root.path, err)
	}
	if err := checkImageFD(fd, name, boot); err != nil {
		unix.Close(fd)
		return nil, err
	}
	f := os.NewFile(uintptr(fd), name)
	if err := checkFolders(root, rel, f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// checkImageFD checks the opened image: a regular file, owned by root, not
// group- or other-writable, world-readable when boot; and leaves it blocking.
func checkImageFD(fd int, name string, boot bool) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("%s: %w", name, &fs.PathError{Op: "fstat", Path: name, Err: err})
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("%s is not a regular file", name)
	}
	if err := checkStat(&st, name); err != nil {
		return err
	}
	if boot && st.Mode&0o004 == 0 {
		return fmt.Errorf("%s (mode %04o): %w: QEMU re-opens a kernel or initrd by its own mode (chmod o+r it)",
			name, st.Mode&0o7777, ErrNotWorldReadable)
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		return fmt.Errorf("%s: clear O_NONBLOCK: %w", name, err)
	}
	return nil
}

func (r *ImageRoots) root(path string) (imageRoot, error) {
	if r != nil {
		for _, root := range r.roots {
			if root.path == path {
				return root, nil
			}
		}
	}
	return imageRoot{}, fmt.Errorf("image root %q is not one of this agent's (%s): %w",
		path, strings.Join(r.Paths(), ", "), ErrOutsideRoots)
}

// checkRel accepts a relative, clean path with no ".." component.
func checkRel(rel string) error {
	switch {
	case rel == "" || rel == ".":
		return errors.New("empty path")
	case filepath.IsAbs(rel):
		return errors.New("not relative")
	case filepath.Clean(rel) != rel || strings.ContainsRune(rel, 0):
		return errors.New("not a clean path")
	case rel == ".." || strings.HasPrefix(rel, "../"):
		return ErrEscapesRoot
	}
	return nil
}

// openBeneath is openat2(dir, rel, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS).
func openBeneath(dir *os.File, rel string, flags int) (int, error) {
	how := &unix.OpenHow{
		Flags:   uint64(flags),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS,
	}
	var err error
	for range openRetries {
		var fd int
		fd, err = unix.Openat2(int(dir.Fd()), rel, how)
		if err == nil {
			return fd, nil
		}
		if !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EINTR) {
			return -1, err
		}
	}
	return -1, err
}

// openError says why openat2 refused, in the terms of the policy.
func openError(name, root string, err error) error {
	switch {
	case errors.Is(err, unix.EXDEV):
		return fmt.Errorf("%s: %w %s (a symlink in it points outside it, or is absolute)", name, ErrEscapesRoot, root)
	case errors.Is(err, unix.ELOOP):
		return fmt.Errorf("%s: too many symlinks, or a /proc magic link: %w", name, err)
	case errors.Is(err, unix.ENOSYS):
		return fmt.Errorf("%s: openat2 is not available (Linux 5.6 or later): %w", name, err)
	}
	return fmt.Errorf("%s: %w", name, &fs.PathError{Op: "open", Path: name, Err: err})
}

// checkOwner checks an open file's (or O_PATH directory's) owner and mode.
func checkOwner(f *os.File, name string) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("%s: %w", name, &fs.PathError{Op: "fstat", Path: name, Err: err})
	}
	return checkStat(&st, name)
}

func checkStat(st *unix.Stat_t, name string) error {
	if st.Uid != 0 || st.Mode&0o022 != 0 {
		return fmt.Errorf("%s (owner uid %d, mode %04o): %w", name, st.Uid, st.Mode&0o7777, ErrUnsafeImage)
	}
	return nil
}

// checkFolders checks every folder on the way to the image, as its path names
// them and where it actually lies: one someone else may write is where they
// could swap what the next launch opens.
func checkFolders(root imageRoot, rel string, f *os.File) error {
	var dirs []string
	for d := filepath.Dir(rel); d != "."; d = filepath.Dir(d) {
		dirs = append(dirs, d)
	}
	real, err := fdPath(f)
	if err != nil {
		return err
	}
	realRel, ok := beneath(root.real, real)
	if !ok {
		return fmt.Errorf("%s: lies at %s, not beneath %s: %w", f.Name(), real, root.real, ErrEscapesRoot)
	}
	for d := filepath.Dir(realRel); d != "."; d = filepath.Dir(d) {
		dirs = append(dirs, d)
	}
	for _, d := range dirs {
		fd, err := openBeneath(root.dir, d, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC)
		name := filepath.Join(root.path, d)
		if err != nil {
			return openError(name, root.path, err)
		}
		dir := os.NewFile(uintptr(fd), name)
		err = checkOwner(dir, name)
		dir.Close()
		if err != nil {
			return err
		}
	}
	return nil
}

// fdPath is the path the kernel gives an open file (its /proc/self/fd link).
func fdPath(f *os.File) (string, error) {
	p, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(int(f.Fd())))
	if err != nil {
		return "", fmt.Errorf("path of %s: %w", f.Name(), err)
	}
	if !filepath.IsAbs(p) {
		return "", fmt.Errorf("path of %s: %q is not a path", f.Name(), p)
	}
	return p, nil
}
