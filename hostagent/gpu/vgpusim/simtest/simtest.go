// Package simtest mounts a vgpusim file system for a test and unmounts it
// when the test ends, pass or fail.
package simtest

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/proc/proctest"
)

// Sim is a mounted simulator.
type Sim struct {
	Root    string // the sysfs root (mount point)
	Control string // the fault-injection directory
	DevRoot string // the device nodes (nvidia<N>, vfio/<group>)
	Server  *vgpusim.Server
}

// Start mounts a simulator in a fresh temporary directory. opts.Control and
// opts.DevRoot are replaced by fresh directories too.
func Start(t testing.TB, opts vgpusim.Options) *Sim {
	t.Helper()
	proctest.RequiresFUSE(t)
	dir := t.TempDir()
	s := &Sim{Root: filepath.Join(dir, "sys"), Control: filepath.Join(dir, "ctl"), DevRoot: filepath.Join(dir, "dev")}
	for _, d := range []string{s.Root, s.Control, s.DevRoot} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatalf("simtest: %v", err)
		}
	}
	opts.Control = s.Control
	opts.DevRoot = s.DevRoot
	srv, err := vgpusim.Mount(s.Root, opts)
	if err != nil {
		t.Fatalf("simtest: %v", err)
	}
	s.Server = srv
	// Registered after TempDir's cleanup, so it runs before the removal.
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("simtest: %v", err)
		}
	})
	return s
}

// Path joins elements under the sysfs root.
func (s *Sim) Path(elem ...string) string {
	return filepath.Join(append([]string{s.Root}, elem...)...)
}

// Set creates control file name (vgpusim.CtlFailRelease, ...) holding content.
func (s *Sim) Set(t testing.TB, name, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(s.Control, name), []byte(content+"\n"), 0o644); err != nil {
		t.Fatalf("simtest: %v", err)
	}
}

// Clear removes control file name.
func (s *Sim) Clear(t testing.TB, name string) {
	t.Helper()
	if err := os.Remove(filepath.Join(s.Control, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("simtest: %v", err)
	}
}

// Write does one write(2) of val to a sysfs path and returns its errno, as
// a driver or a shell makes the write. Raw syscalls, not os.File: os.File
// puts pollable files (FUSE, sysfs) in the netpoller and would wait
// forever on an EAGAIN instead of returning it.
func Write(path, val string) error {
	fd, err := syscall.Open(path, syscall.O_WRONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	_, err = syscall.Write(fd, []byte(val))
	return err
}
