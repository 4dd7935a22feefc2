package vgpusim_test

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/proc/proctest"
)

const waitFor = 5 * time.Second

func typeDir(s *simtest.Sim, parent int, typeID string) string {
	return s.Path("class", "mdev_bus", vgpusim.MdevParent(parent), "mdev_supported_types", typeID)
}

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}

// write is simtest.Write: one write(2), its errno.
var write = simtest.Write

// assertDir checks path leads to a directory, following symlinks (sysfs
// links such as iommu_group).
func assertDir(t *testing.T, path string) {
	t.Helper()
	st, err := os.Stat(path)
	if assert.NoError(t, err) {
		assert.True(t, st.IsDir(), "%s is not a directory", path)
	}
}

func sh(t *testing.T, script string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command("sh", "-c", script)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

func TestShellDrivesMdev(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{MdevParents: 1})
	td := typeDir(s, 0, "nvidia-471")
	assert.Equal(t, "GRID A100-4C", read(t, filepath.Join(td, "name")))
	assert.Equal(t, "vfio-pci", read(t, filepath.Join(td, "device_api")))
	assert.Equal(t, "10", read(t, filepath.Join(td, "available_instances")))

	u := uuid.NewString()
	out, err := sh(t, "echo "+u+" > "+filepath.Join(td, "create"))
	require.NoError(t, err, out)
	assert.Equal(t, "9", read(t, filepath.Join(td, "available_instances")))
	dev := s.Path("bus", "mdev", "devices", u)
	require.DirExists(t, dev)
	assert.Equal(t, "GRID A100-4C", read(t, filepath.Join(dev, "mdev_type", "name")))
	group, err := filepath.EvalSymlinks(filepath.Join(dev, "iommu_group"))
	require.NoError(t, err)
	assertDir(t, filepath.Join(group, "devices", u))
	assert.FileExists(t, filepath.Join(td, "devices", u, "remove"))

	_, err = sh(t, "echo "+u+" > "+filepath.Join(td, "create"))
	require.Error(t, err, "duplicate create must fail")
	// dash's builtin echo reports every write error as "I/O error";
	// coreutils echo prints the errno the kernel (here: we) returned.
	out, err = sh(t, "/bin/echo "+u+" > "+filepath.Join(td, "create"))
	require.Error(t, err, "duplicate create must fail")
	assert.Contains(t, out, "File exists")

	out, err = sh(t, "echo 1 > "+filepath.Join(dev, "remove"))
	require.NoError(t, err, out)
	assert.NoDirExists(t, dev)
	assert.Equal(t, "10", read(t, filepath.Join(td, "available_instances")))

	_, err = os.Stat(s.Path("bus", "nonexistent"))
	assert.ErrorIs(t, err, syscall.ENOENT)
}

func TestShellDrivesVendor(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{VendorVFs: 2})
	vf := s.Path("bus", "pci", "devices", vgpusim.VendorVF(0))
	list := read(t, filepath.Join(vf, "nvidia", "creatable_vgpu_types"))
	assert.Contains(t, list, "   592 : NVIDIA L40-4Q")
	assert.Equal(t, "0", read(t, filepath.Join(vf, "nvidia", "current_vgpu_type")))

	out, err := sh(t, "echo 592 > "+filepath.Join(vf, "nvidia", "current_vgpu_type"))
	require.NoError(t, err, out)
	assert.Equal(t, "592", read(t, filepath.Join(vf, "nvidia", "current_vgpu_type")))
	lines := strings.Split(read(t, filepath.Join(vf, "nvidia", "creatable_vgpu_types")), "\n")
	assert.Len(t, lines, 1, "only the header while the VF is in use")
	// The GPU is homogeneous now: the other VF offers 592 only.
	other := read(t, s.Path("bus", "pci", "devices", vgpusim.VendorVF(1), "nvidia", "creatable_vgpu_types"))
	assert.Equal(t, []string{"ID    : vGPU Name", "   592 : NVIDIA L40-4Q"}, strings.Split(other, "\n"))
	pf, err := os.Readlink(filepath.Join(vf, "physfn"))
	require.NoError(t, err)
	assert.Equal(t, "../"+vgpusim.VendorPF, pf)
	assertDir(t, filepath.Join(vf, "iommu_group"))

	out, err = sh(t, "echo 0 > "+filepath.Join(vf, "nvidia", "current_vgpu_type"))
	require.NoError(t, err, out)
	assert.Equal(t, "0", read(t, filepath.Join(vf, "nvidia", "current_vgpu_type")))
}

func TestKernelErrnos(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{MdevParents: 1, VendorVFs: 2})
	create := func(typeID string) string { return filepath.Join(typeDir(s, 0, typeID), "create") }

	assert.ErrorIs(t, write(create("nvidia-477"), "not-a-uuid"), syscall.EINVAL)
	assert.ErrorIs(t, write(create("nvidia-477"), strings.Repeat("x", 36)), syscall.EINVAL)

	u := uuid.NewString()
	require.NoError(t, write(create("nvidia-477"), u))
	assert.ErrorIs(t, write(create("nvidia-477"), u+"\n"), syscall.EEXIST, "duplicate")
	// The mdev core answers EUSERS, not ENOSPC, when available_instances is 0.
	assert.ErrorIs(t, write(create("nvidia-477"), uuid.NewString()), syscall.EUSERS)
	// One type per GPU: the other types are full while nvidia-477 is in use.
	assert.Equal(t, "0", read(t, filepath.Join(typeDir(s, 0, "nvidia-471"), "available_instances")))
	assert.ErrorIs(t, write(create("nvidia-471"), uuid.NewString()), syscall.EUSERS)

	remove := s.Path("bus", "mdev", "devices", u, "remove")
	_, err := os.ReadFile(remove)
	assert.ErrorIs(t, err, syscall.EACCES, "remove is write-only")
	assert.ErrorIs(t, write(remove, "yes"), syscall.EINVAL)
	require.NoError(t, write(remove, "0"), "0 is a no-op")
	require.DirExists(t, s.Path("bus", "mdev", "devices", u))

	// A file opened before the device went away answers ENODEV.
	stale, err := syscall.Open(remove, syscall.O_WRONLY|syscall.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer syscall.Close(stale)
	require.NoError(t, write(remove, "1"))
	_, err = syscall.Write(stale, []byte("1"))
	assert.ErrorIs(t, err, syscall.ENODEV)
	assert.ErrorIs(t, write(remove, "1"), syscall.ENOENT)

	cur := s.Path("bus", "pci", "devices", vgpusim.VendorVF(0), "nvidia", "current_vgpu_type")
	assert.ErrorIs(t, write(cur, "12345"), syscall.EINVAL, "type not creatable")
	assert.ErrorIs(t, write(cur, "abc"), syscall.EINVAL)
	require.NoError(t, write(cur, "598"))
	assert.ErrorIs(t, write(cur, "598"), syscall.EBUSY, "VF already has a type")
	cur1 := s.Path("bus", "pci", "devices", vgpusim.VendorVF(1), "nvidia", "current_vgpu_type")
	assert.ErrorIs(t, write(cur1, "598"), syscall.EINVAL, "L40-48Q: one per GPU")
	require.NoError(t, write(cur, "0"))
	require.NoError(t, write(cur, "0"), "releasing a free VF is a no-op")
}

func TestFaultInjection(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{MdevParents: 1, VendorVFs: 1})
	create := filepath.Join(typeDir(s, 0, "nvidia-471"), "create")
	cur := s.Path("bus", "pci", "devices", vgpusim.VendorVF(0), "nvidia", "current_vgpu_type")

	for _, e := range []syscall.Errno{syscall.EBUSY, syscall.EIO, syscall.EAGAIN, syscall.ENODEV} {
		name := vgpusimErrnoName(e)
		t.Run(name, func(t *testing.T) {
			s.Set(t, vgpusim.CtlFailCreate, name)
			assert.ErrorIs(t, write(create, uuid.NewString()), e)
			assert.ErrorIs(t, write(cur, "592"), e)
			s.Clear(t, vgpusim.CtlFailCreate)

			u := uuid.NewString()
			require.NoError(t, write(create, u))
			require.NoError(t, write(cur, "592"))
			remove := s.Path("bus", "mdev", "devices", u, "remove")
			s.Set(t, vgpusim.CtlFailRelease, name)
			assert.ErrorIs(t, write(remove, "1"), e)
			assert.ErrorIs(t, write(cur, "0"), e)
			assert.DirExists(t, s.Path("bus", "mdev", "devices", u))
			s.Clear(t, vgpusim.CtlFailRelease)
			require.NoError(t, write(remove, "1"))
			require.NoError(t, write(cur, "0"))
		})
	}
}

func vgpusimErrnoName(e syscall.Errno) string {
	for _, n := range []string{"EBUSY", "EIO", "EAGAIN", "ENODEV"} {
		if vgpusim.ParseErrno(n) == e {
			return n
		}
	}
	return "EIO"
}

func TestParseErrno(t *testing.T) {
	for in, want := range map[string]syscall.Errno{
		"EBUSY": syscall.EBUSY, "ebusy\n": syscall.EBUSY, "EIO": syscall.EIO, "EAGAIN": syscall.EAGAIN,
		"ENODEV": syscall.ENODEV, "16": syscall.EBUSY, "": syscall.EIO, "bogus": syscall.EIO, "99999": syscall.EIO,
	} {
		assert.Equal(t, want, vgpusim.ParseErrno(in), "%q", in)
	}
}

func TestBlockReleaseThenLift(t *testing.T) {
	s := simtest.Start(t, vgpusim.Options{MdevParents: 1})
	u := uuid.NewString()
	require.NoError(t, write(filepath.Join(typeDir(s, 0, "nvidia-471"), "create"), u))
	s.Set(t, vgpusim.CtlBlockRelease, "")
	s.Set(t, vgpusim.CtlFailRelease, "EIO")

	done := make(chan error, 1)
	go func() { done <- write(s.Path("bus", "mdev", "devices", u, "remove"), "1") }()
	require.Eventually(t, func() bool { return s.Server.Blocked() == 1 }, waitFor, time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("write returned while blocked: %v", err)
	default:
	}
	s.Clear(t, vgpusim.CtlBlockRelease)
	select {
	case err := <-done:
		assert.ErrorIs(t, err, syscall.EIO, "a lifted block then honours fail-release")
	case <-time.After(waitFor):
		t.Fatal("write still blocked after the block was lifted")
	}
}

func TestUnmountCompletesBlockedWriters(t *testing.T) {
	proctest.RequiresFUSE(t)
	root, ctl := filepath.Join(t.TempDir(), "sys"), t.TempDir()
	require.NoError(t, os.Mkdir(root, 0o755))
	srv, err := vgpusim.Mount(root, vgpusim.Options{MdevParents: 1, VendorVFs: 1, Control: ctl})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Unmount() }) // idempotent: a no-op if the test got there

	u := uuid.NewString()
	require.NoError(t, write(filepath.Join(root, "class/mdev_bus", vgpusim.MdevParent(0), "mdev_supported_types/nvidia-471/create"), u))
	cur := filepath.Join(root, "bus/pci/devices", vgpusim.VendorVF(0), "nvidia/current_vgpu_type")
	require.NoError(t, write(cur, "592"))
	require.NoError(t, os.WriteFile(filepath.Join(ctl, vgpusim.CtlBlockRelease), nil, 0o644))

	// One writer in this process, one in a shell.
	done := make(chan error, 1)
	go func() { done <- write(filepath.Join(root, "bus/mdev/devices", u, "remove"), "1") }()
	shell := exec.Command("sh", "-c", "echo 0 > "+cur)
	require.NoError(t, shell.Start())
	shellDone := make(chan error, 1)
	go func() { shellDone <- shell.Wait() }()
	require.Eventually(t, func() bool { return srv.Blocked() == 2 }, waitFor, time.Millisecond)

	unmounted := make(chan error, 1)
	go func() { unmounted <- srv.Unmount() }()
	for name, ch := range map[string]chan error{"unmount": unmounted, "writer": done, "shell": shellDone} {
		select {
		case err := <-ch:
			assert.NoError(t, err, name)
		case <-time.After(waitFor):
			t.Fatalf("%s hangs after unmount", name)
		}
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	assert.NotContains(t, string(mounts), " "+root+" ", "still mounted")
	assert.False(t, errors.Is(srv.Unmount(), os.ErrClosed), "second Unmount is a no-op")
}
