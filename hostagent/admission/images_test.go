package admission

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// imageTree is an image root with a kernel, a disk, folders and symlinks,
// and a folder outside it; all root-owned and not group/other-writable.
type imageTree struct {
	root, outside string
	roots         *ImageRoots
}

func newImageTree(t *testing.T) imageTree {
	t.Helper()
	base := t.TempDir()
	tr := imageTree{root: filepath.Join(base, "images"), outside: filepath.Join(base, "outside")}
	for _, d := range []string{tr.root, tr.outside, filepath.Join(tr.root, "kernels"), filepath.Join(tr.root, "links")} {
		require.NoError(t, os.MkdirAll(d, 0o755))
		require.NoError(t, os.Chmod(d, 0o755))
	}
	write := func(p string, mode os.FileMode) {
		require.NoError(t, os.WriteFile(p, []byte("image"), mode))
		require.NoError(t, os.Chmod(p, mode))
	}
	write(filepath.Join(tr.root, "kernels", "vmlinuz"), 0o644)
	write(filepath.Join(tr.root, "disk.raw"), 0o600)
	write(filepath.Join(tr.outside, "secret"), 0o644)
	sym := func(target, link string) { require.NoError(t, os.Symlink(target, filepath.Join(tr.root, link))) }
	sym("kernels/vmlinuz", "vmlinuz")              // relative, inside
	sym("../kernels/vmlinuz", "links/up-and-back") // relative through .., still inside
	sym("../outside/secret", "escape-relative")    // relative, leaves the root
	sym(filepath.Join(tr.outside, "secret"), "escape-absolute")
	sym(filepath.Join(tr.root, "kernels", "vmlinuz"), "absolute-inside") // absolute: refused even pointing inside
	sym("/proc/self/root/etc/passwd", "magic")
	var err error
	tr.roots, err = OpenImageRoots([]string{tr.root})
	require.NoError(t, err)
	t.Cleanup(func() { tr.roots.Close() })
	return tr
}

func (tr imageTree) open(t *testing.T, rel string, boot bool) (*os.File, error) {
	t.Helper()
	ref, err := tr.roots.Locate(filepath.Join(tr.root, rel))
	require.NoError(t, err)
	assert.Equal(t, &vmflowv1.ImageRef{Root: tr.root, Path: rel}, ref)
	f, err := tr.roots.Open(ref, boot)
	if f != nil {
		t.Cleanup(func() { f.Close() })
	}
	return f, err
}

// TestImageRootsSymlinks: a relative symlink that stays in the root is
// followed; one that leaves it (relatively or absolutely), an absolute one
// and a /proc magic link are refused, saying the image leaves its root.
func TestImageRootsSymlinks(t *testing.T) {
	tr := newImageTree(t)
	for _, rel := range []string{"kernels/vmlinuz", "vmlinuz", "links/up-and-back"} {
		f, err := tr.open(t, rel, true)
		require.NoError(t, err, rel)
		fi, err := f.Stat()
		require.NoError(t, err)
		want, err := os.Stat(filepath.Join(tr.root, "kernels", "vmlinuz"))
		require.NoError(t, err)
		assert.True(t, os.SameFile(want, fi), "%s opens the kernel", rel)
		assert.Equal(t, filepath.Join(tr.root, rel), f.Name())
	}
	for _, rel := range []string{"escape-relative", "escape-absolute", "absolute-inside", "magic"} {
		_, err := tr.open(t, rel, true)
		require.Error(t, err, rel)
		if rel != "magic" {
			assert.ErrorIs(t, err, ErrEscapesRoot, rel)
			assert.Contains(t, err.Error(), "leaves its image root "+tr.root, rel)
		}
		t.Logf("%s: %v", rel, err)
	}
}

// TestImageRootsOwnership: the root, a folder on the way (named, or reached
// through a symlink) and the image itself must be root's and not group- or
// other-writable, else the open is refused; the root's parents are not
// checked. A kernel must be world-readable, a disk need not be.
func TestImageRootsOwnership(t *testing.T) {
	tests := []struct {
		name  string
		setup func(tr imageTree)
		rel   string
		boot  bool
		want  error
	}{
		{"group-writable root", func(tr imageTree) { chmod(t, tr.root, 0o775) }, "disk.raw", false, ErrUnsafeImage},
		{"other-writable root", func(tr imageTree) { chmod(t, tr.root, 0o757) }, "disk.raw", false, ErrUnsafeImage},
		{"group-writable file", func(tr imageTree) { chmod(t, filepath.Join(tr.root, "disk.raw"), 0o620) }, "disk.raw", false, ErrUnsafeImage},
		{"other-writable kernel", func(tr imageTree) { chmod(t, filepath.Join(tr.root, "kernels/vmlinuz"), 0o646) }, "kernels/vmlinuz", true, ErrUnsafeImage},
		{"group-writable folder", func(tr imageTree) { chmod(t, filepath.Join(tr.root, "kernels"), 0o775) }, "kernels/vmlinuz", true, ErrUnsafeImage},
		{"group-writable folder behind a symlink", func(tr imageTree) { chmod(t, filepath.Join(tr.root, "kernels"), 0o775) }, "vmlinuz", true, ErrUnsafeImage},
		{"file not root's", func(tr imageTree) { chown(t, filepath.Join(tr.root, "disk.raw"), 1000) }, "disk.raw", false, ErrUnsafeImage},
		{"folder not root's", func(tr imageTree) { chown(t, filepath.Join(tr.root, "kernels"), 1000) }, "kernels/vmlinuz", true, ErrUnsafeImage},
		{"root not root's", func(tr imageTree) { chown(t, tr.root, 1000) }, "disk.raw", false, ErrUnsafeImage},
		{"kernel not world-readable", func(tr imageTree) { chmod(t, filepath.Join(tr.root, "kernels/vmlinuz"), 0o640) }, "kernels/vmlinuz", true, ErrNotWorldReadable},
		{"disk need not be world-readable", func(imageTree) {}, "disk.raw", false, nil},
		{"parents of the root are not checked", func(tr imageTree) { chmod(t, filepath.Dir(tr.root), 0o1777) }, "disk.raw", false, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := newImageTree(t)
			tt.setup(tr)
			_, err := tr.open(t, tt.rel, tt.boot)
			if tt.want == nil {
				assert.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, tt.want)
			t.Logf("%v", err)
		})
	}
}

func chmod(t *testing.T, p string, mode os.FileMode) {
	t.Helper()
	require.NoError(t, unix.Chmod(p, uint32(mode)))
}

func chown(t *testing.T, p string, uid int) {
	t.Helper()
	require.NoError(t, os.Lchown(p, uid, 0))
}

// TestImageRootsFIFO: a FIFO in the root is refused at once, not waited on.
func TestImageRootsFIFO(t *testing.T) {
	tr := newImageTree(t)
	require.NoError(t, unix.Mkfifo(filepath.Join(tr.root, "fifo"), 0o644))
	done := make(chan error, 1)
	go func() {
		_, err := tr.roots.Open(&vmflowv1.ImageRef{Root: tr.root, Path: "fifo"}, false)
		done <- err
	}()
	select {
	case err := <-done:
		require.Error(t, err)
		assert.Contains(t, err.Error(), "not a regular file")
	case <-time.After(10 * time.Second):
		t.Fatal("opening a FIFO blocked")
	}
}

// TestImageRootsLocateAndRefs: paths map to root + relative path (the
// innermost root wins), under the root as configured or as it resolves; a
// ref naming a root the agent does not have, or climbing out, is refused.
func TestImageRootsLocateAndRefs(t *testing.T) {
	tr := newImageTree(t)
	link := filepath.Join(t.TempDir(), "roots-link")
	require.NoError(t, os.Symlink(tr.root, link))
	roots, err := OpenImageRoots([]string{link, filepath.Join(tr.root, "kernels")})
	require.NoError(t, err)
	defer roots.Close()

	ref, err := roots.Locate(filepath.Join(link, "disk.raw"))
	require.NoError(t, err)
	assert.Equal(t, &vmflowv1.ImageRef{Root: link, Path: "disk.raw"}, ref)
	ref, err = roots.Locate(filepath.Join(tr.root, "disk.raw")) // the resolved form
	require.NoError(t, err)
	assert.Equal(t, &vmflowv1.ImageRef{Root: link, Path: "disk.raw"}, ref)
	ref, err = roots.Locate(filepath.Join(tr.root, "kernels", "vmlinuz"))
	require.NoError(t, err)
	assert.Equal(t, &vmflowv1.ImageRef{Root: filepath.Join(tr.root, "kernels"), Path: "vmlinuz"}, ref, "innermost root")

	for _, p := range []string{"/etc/passwd", "relative", tr.root + "/../x", link, link + "/"} {
		_, err := roots.Locate(p)
		assert.Error(t, err, p)
	}
	_, err = roots.Open(&vmflowv1.ImageRef{Root: tr.outside, Path: "secret"}, false)
	assert.ErrorIs(t, err, ErrOutsideRoots)
	for _, rel := range []string{"../outside/secret", "/etc/passwd", "", "a//b"} {
		_, err = roots.Open(&vmflowv1.ImageRef{Root: link, Path: rel}, false)
		assert.Error(t, err, rel)
	}
}

// TestValidateImagePolicy: admission applies the same policy, each refusal
// a field error naming its field.
func TestValidateImagePolicy(t *testing.T) {
	h, root := testHost(t)
	require.NoError(t, os.Chmod(filepath.Join(root, "initrd.img"), 0o600))
	require.NoError(t, os.Chmod(filepath.Join(root, "disk.raw"), 0o660))
	err := h.Validate(context.Background(), good(root))
	require.ErrorIs(t, err, ErrInvalid)
	assert.ErrorContains(t, err, "initrd: "+filepath.Join(root, "initrd.img")+" (mode 0600): not world-readable")
	assert.ErrorContains(t, err, "disk: "+filepath.Join(root, "disk.raw")+" (owner uid 0, mode 0660): not owned by root or writable by group or others")

	r := good(root)
	r.Initrd, r.Disk = "", ""
	r.Kernel = filepath.Join(root, "escape")
	err = h.Validate(context.Background(), r)
	require.ErrorIs(t, err, ErrInvalid)
	assert.ErrorContains(t, err, "kernel: "+filepath.Join(root, "escape")+": leaves its image root")
}

// TestHostRecordSpec: the record keeps each image's root and its path
// relative to it.
func TestHostRecordSpec(t *testing.T) {
	h, root := testHost(t)
	s, err := h.RecordSpec(good(root))
	require.NoError(t, err)
	assert.Equal(t, &vmflowv1.ImageRef{Root: root, Path: "vmlinuz"}, s.GetKernelImage())
	assert.Equal(t, &vmflowv1.ImageRef{Root: root, Path: "initrd.img"}, s.GetInitrdImage())
	assert.Equal(t, &vmflowv1.ImageRef{Root: root, Path: "disk.raw"}, s.GetDiskImage())
	assert.Equal(t, filepath.Join(root, "vmlinuz"), s.GetKernel(), "the path as requested stays, for ls and show")
	r := good(root)
	r.Disk = "/etc/passwd"
	_, err = h.RecordSpec(r)
	assert.ErrorIs(t, err, ErrInvalid)
}
