package admission_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/guest"
	"vmflow/guest/build"
	"vmflow/hostagent/admission"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/hostagent/supervise"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

const imageSize = 1 << 20

// stack is a store and a supervisor launching through admission.PrepareLaunch on
// an image root holding real.raw (0x22 bytes), disk.raw -> real.raw
// (relative) and other.raw (0x33); outside it, secret.raw (0x11).
type stack struct {
	root, outside string
	host          admission.Host
	st            *store.Store
	sup           *supervise.Supervisor
}

func newStack(t *testing.T) *stack {
	t.Helper()
	vmmtest.RequiresQEMU(t)
	vmmtest.RequiresQEMUImg(t)
	s := &stack{root: proctest.ShortDir(t, "img"), outside: proctest.ShortDir(t, "out")}
	require.NoError(t, os.Chmod(s.root, 0o755))
	for name, b := range map[string]byte{"real.raw": 0x22, "other.raw": 0x33} {
		require.NoError(t, os.WriteFile(filepath.Join(s.root, name), bytes.Repeat([]byte{b}, imageSize), 0o600))
	}
	require.NoError(t, os.WriteFile(filepath.Join(s.outside, "secret.raw"), bytes.Repeat([]byte{0x11}, imageSize), 0o600))
	require.NoError(t, os.Symlink("real.raw", filepath.Join(s.root, "disk.raw")))
	var err error
	s.host, err = admission.SystemHost([]string{s.root}, "", nil)
	require.NoError(t, err)
	t.Cleanup(func() { s.host.Images.Close() })
	s.st, err = store.New(proctest.ShortDir(t, "st"))
	require.NoError(t, err)
	s.sup, err = supervise.New(supervise.Config{Store: s.st, PrepareLaunch: admission.PrepareLaunch(s.host, nil, false),
		GracefulTimeout: time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { s.sup.Close() })
	return s
}

func (s *stack) request(id string) *vmflowv1.SpawnRequest {
	return &vmflowv1.SpawnRequest{InstanceId: id, HostId: "h1", Vcpus: 1, MemoryMib: 64, Machine: "q35",
		Accel: string(vmmtest.Accel()), Disk: filepath.Join(s.root, "disk.raw")}
}

// create admits req as SpawnInstance does (ValidateSpawn, then CreateRecord's
// record spec) and writes the record.
func (s *stack) create(t *testing.T, req *vmflowv1.SpawnRequest) {
	t.Helper()
	ctx := ctxT(t, 10*time.Second)
	require.NoError(t, s.host.Validate(ctx, req))
	rs, err := s.host.RecordSpec(req)
	require.NoError(t, err)
	_, err = s.st.Create(ctx, &vmflowv1.InstanceRecord{Id: req.GetInstanceId(), Spec: rs})
	require.NoError(t, err)
}

func (s *stack) launch(t *testing.T, id string) proc.Identity {
	t.Helper()
	res, err := s.sup.Launch(ctxT(t, 30*time.Second), id)
	require.NoError(t, err)
	t.Cleanup(func() {
		stopInstance(t, s.st, s.sup, id)
	})
	return res.Identity
}

// stopInstance stops a launched instance at the end of a test; a record
// already deleted is fine. Stop needs the manual-stop marker first.
func stopInstance(t *testing.T, st *store.Store, sup *supervise.Supervisor, id string) {
	if err := st.MarkManualStop(context.Background(), id); errors.Is(err, store.ErrNotFound) {
		return
	} else if err != nil {
		t.Errorf("mark manual stop of %s: %v", id, err)
		return
	}
	if _, err := sup.Stop(ctxT(t, 20*time.Second), id, time.Millisecond); err != nil {
		t.Errorf("stop %s: %v", id, err)
	}
}

// crash kills QEMU from outside (no manual stop: the instance may be
// launched again) and waits for its whole thread group to be gone.
func (s *stack) crash(t *testing.T, id string, pid proc.Identity) {
	t.Helper()
	require.NoError(t, proc.Signal(pid, syscall.SIGKILL))
	require.NoError(t, s.sup.WaitExit(ctxT(t, 20*time.Second), id, nil))
}

var ctxT = proctest.Context

// fdsOn lists QEMU's fds whose file is path (same inode), with their flags.
func fdsOn(t *testing.T, pid int, path string) []vmmtest.OpenFile {
	t.Helper()
	want, err := os.Stat(path)
	require.NoError(t, err)
	var out []vmmtest.OpenFile
	for _, f := range vmmtest.OpenFiles(t, pid) {
		fi, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid), "fd", strconv.Itoa(f.FD)))
		if err == nil && os.SameFile(want, fi) {
			out = append(out, f)
		}
	}
	return out
}

func assertBytes(t *testing.T, path string, b byte) {
	t.Helper()
	got, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(bytes.Repeat([]byte{b}, imageSize), got), "%s changed", path)
}

// TestLaunchSymlinkSwappedAfterAdmission: a symlink inside the image root,
// admitted pointing at an image in it, then swapped to a file outside the
// root: the launch is refused naming the escape, and QEMU never opens the
// outside file. Fails if the record keeps the path: QEMU re-resolves it
// and holds secret.raw open read-write (fdinfo flags 02100002).
func TestLaunchSymlinkSwappedAfterAdmission(t *testing.T) {
	s := newStack(t)
	secret := filepath.Join(s.outside, "secret.raw")
	before, err := os.Stat(secret)
	require.NoError(t, err)
	for i, target := range []string{secret, "../" + filepath.Base(s.outside) + "/secret.raw"} {
		id := "swap" + strconv.Itoa(i)
		s.create(t, s.request(id))
		link := filepath.Join(s.root, "disk.raw")
		require.NoError(t, os.Remove(link))
		require.NoError(t, os.Symlink(target, link))

		_, err := s.sup.Launch(ctxT(t, 30*time.Second), id)
		require.Error(t, err, "symlink to %s", target)
		assert.ErrorIs(t, err, admission.ErrEscapesRoot)
		assert.ErrorIs(t, err, admission.ErrInvalid, "a policy refusal, not a retryable failure")
		assert.Contains(t, err.Error(), "disk: "+link+": leaves its image root "+s.root)
		rec, err := s.st.Get(id)
		require.NoError(t, err)
		assert.Nil(t, rec.GetProcess(), "no QEMU was started")
		assert.Contains(t, rec.GetLastError(), "leaves its image root")

		require.NoError(t, os.Remove(link))
		require.NoError(t, os.Symlink("real.raw", link))
	}
	after, err := os.Stat(secret)
	require.NoError(t, err)
	assert.Equal(t, before.ModTime(), after.ModTime())
	assertBytes(t, secret, 0x11)
}

// TestLaunchHoldsWhatItOpened: once the launch has opened the image, a swap
// of the symlink (even to another image inside the root) changes nothing:
// QEMU gets the file the agent opened, not a path.
func TestLaunchHoldsWhatItOpened(t *testing.T) {
	s := newStack(t)
	s.create(t, s.request("held"))
	l, err := s.st.Lock(ctxT(t, 5*time.Second), "held")
	require.NoError(t, err)
	defer l.Unlock()
	rec, err := l.Get()
	require.NoError(t, err)
	v, err := admission.PrepareLaunch(s.host, nil, false)(ctxT(t, 10*time.Second), l, rec)
	require.NoError(t, err)
	link := filepath.Join(s.root, "disk.raw")
	require.NoError(t, os.Remove(link))
	require.NoError(t, os.Symlink("other.raw", link))

	p := l.Paths()
	vm, err := vmm.Launch(ctxT(t, 30*time.Second), vmm.LaunchConfig{Spec: v,
		Paths: vmm.Paths{QMPSocket: p.Socket, PIDFile: p.PID, Log: p.Log}, ReadyTimeout: 20 * time.Second,
		Confine: vmmtest.Confine()})
	require.NoError(t, err)
	defer func() {
		_, _ = vm.Stop(ctxT(t, 10*time.Second), vmm.StopConfig{SkipPowerdown: true, KillTimeout: 5 * time.Second})
		vm.Close()
	}()
	pid := vm.Identity().PID
	assert.NotEmpty(t, fdsOn(t, pid, filepath.Join(s.root, "real.raw")), "QEMU holds the image admitted")
	assert.Empty(t, fdsOn(t, pid, filepath.Join(s.root, "other.raw")), "QEMU never opened the swapped-in one")
}

// TestLaunchDiskOverlay: a disk is the instance's own qcow2 overlay over the
// read-only base. The first launch creates it under the instance directory;
// QEMU's argv names neither the image nor the overlay; QEMU holds the base
// only read-only (two VMs share it at once); the overlay, with what was
// written into it, survives a restart; delete removes it and leaves the
// base as it was.
func TestLaunchDiskOverlay(t *testing.T) {
	s := newStack(t)
	real := filepath.Join(s.root, "real.raw")
	s.create(t, s.request("ov"))
	s.create(t, s.request("ov2"))
	paths, err := s.st.Paths("ov")
	require.NoError(t, err)

	id1 := s.launch(t, "ov")
	id2 := s.launch(t, "ov2") // the same base, at the same time
	pid, pid2 := id1.PID, id2.PID
	cmdline := vmmtest.Cmdline(t, pid)
	for _, p := range []string{s.root, "real.raw", "disk.raw", store.OverlayFile} {
		assert.NotContains(t, cmdline, p, "QEMU's argv names no image")
	}
	for _, p := range []int{pid, pid2} {
		base := fdsOn(t, p, real)
		require.NotEmpty(t, base, "QEMU %d holds the base", p)
		for _, f := range base {
			assert.Equal(t, os.O_RDONLY, f.Flags&0o3, "fd %d of QEMU %d on the base is read-only (flags %o)", f.FD, p, f.Flags)
		}
	}
	ov := fdsOn(t, pid, paths.Overlay)
	require.NotEmpty(t, ov, "QEMU holds the overlay")
	assert.Equal(t, os.O_RDWR, ov[0].Flags&0o3)
	first, err := os.Stat(paths.Overlay)
	require.NoError(t, err)
	s.crash(t, "ov", id1)

	// Write into the overlay between runs, as the guest would have.
	qemuIO(t, paths.Overlay, "write -P 0x7e 0 4096")
	id1 = s.launch(t, "ov") // a restart: PrepareLaunch runs again
	again, err := os.Stat(paths.Overlay)
	require.NoError(t, err)
	assert.True(t, os.SameFile(first, again), "the restart reuses the overlay")
	assert.NotEmpty(t, fdsOn(t, id1.PID, paths.Overlay))
	s.crash(t, "ov", id1)
	qemuIO(t, paths.Overlay, "read -P 0x7e 0 4096") // still there
	qemuIO(t, paths.Overlay, "read -P 0x22 4096 4096")

	ctx := ctxT(t, 20*time.Second)
	require.NoError(t, s.st.MarkManualStop(ctx, "ov"))
	_, err = s.st.Transition(ctx, "ov", vmflowv1.InstanceState_INSTANCE_STATE_DELETING)
	require.NoError(t, err)
	require.NoError(t, s.sup.TearDown(ctx, "ov"))
	require.NoError(t, s.st.Delete(ctx, "ov"))
	assert.NoFileExists(t, paths.Overlay, "delete removes the overlay")
	assertBytes(t, real, 0x22)
}

// qemuIO runs qemu-io on a qcow2 overlay and fails the test on a failed or
// mismatching command.
func qemuIO(t *testing.T, overlay, command string) {
	t.Helper()
	out, err := exec.CommandContext(ctxT(t, 20*time.Second), "qemu-io", "-f", "qcow2", "-c", command, overlay).CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.NotContains(t, string(out), "failed", "%s", out)
}

// TestLaunchOldRecord: a record written before records kept the image root
// (an absolute disk path only) still launches: its path is located under
// the current roots, and it gets its overlay at this launch.
func TestLaunchOldRecord(t *testing.T) {
	s := newStack(t)
	req := s.request("old")
	require.NoError(t, s.host.Validate(ctxT(t, 5*time.Second), req))
	old := admission.RecordSpec(req) // no disk_image: what the old CreateRecord wrote
	require.Nil(t, old.GetDiskImage())
	_, err := s.st.Create(ctxT(t, 5*time.Second), &vmflowv1.InstanceRecord{Id: "old", Spec: old})
	require.NoError(t, err)
	paths, err := s.st.Paths("old")
	require.NoError(t, err)
	require.NoFileExists(t, paths.Overlay)

	pid := s.launch(t, "old").PID
	assert.FileExists(t, paths.Overlay)
	base := fdsOn(t, pid, filepath.Join(s.root, "real.raw"))
	require.NotEmpty(t, base)
	assert.Equal(t, os.O_RDONLY, base[0].Flags&0o3)
	assert.NotEmpty(t, fdsOn(t, pid, paths.Overlay))
}

// TestLaunchKernelByFD: the real guest's kernel and initrd reach QEMU as
// inherited fds (/proc/self/fd/N), and QEMU re-opens them: the guest boots
// to its init. QEMU's argv names neither.
func TestLaunchKernelByFD(t *testing.T) {
	vmmtest.RequiresQEMU(t)
	dir := guestDir(t)
	h, err := admission.SystemHost([]string{dir}, "", nil)
	require.NoError(t, err)
	defer h.Images.Close()
	st, err := store.New(proctest.ShortDir(t, "st"))
	require.NoError(t, err)
	sup, err := supervise.New(supervise.Config{Store: st, PrepareLaunch: admission.PrepareLaunch(h, nil, false)})
	require.NoError(t, err)
	defer sup.Close()
	req := &vmflowv1.SpawnRequest{InstanceId: "boot", HostId: "h1", Vcpus: 1, MemoryMib: 256, Machine: "q35", Accel: "tcg",
		Kernel: filepath.Join(dir, build.KernelFile), Initrd: filepath.Join(dir, build.InitrdFile), Cmdline: guest.KernelCmdline}
	require.NoError(t, h.Validate(ctxT(t, 5*time.Second), req))
	rs, err := h.RecordSpec(req)
	require.NoError(t, err)
	_, err = st.Create(ctxT(t, 5*time.Second), &vmflowv1.InstanceRecord{Id: "boot", Spec: rs})
	require.NoError(t, err)
	res, err := sup.Launch(ctxT(t, 30*time.Second), "boot")
	require.NoError(t, err)
	defer stopInstance(t, st, sup, "boot")
	assert.NotContains(t, vmmtest.Cmdline(t, res.Identity.PID), dir)
	paths, err := st.Paths("boot")
	require.NoError(t, err)
	// The kernel prints its banner on the serial console once QEMU loaded
	// it from the fd.
	deadline := time.Now().Add(60 * time.Second)
	for {
		b, _ := os.ReadFile(paths.Log)
		if bytes.Contains(b, []byte("Linux version")) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no kernel banner in %s within 60s:\n%s", paths.Log, b)
		}
		time.Sleep(50 * time.Millisecond) // polling a file with a deadline
	}
}

// guestDir is the built guest (make guest), or skips.
func guestDir(t *testing.T) string {
	t.Helper()
	dir, err := build.DefaultDir()
	require.NoError(t, err)
	for _, f := range []string{build.KernelFile, build.InitrdFile} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Skipf("guest not built (%v): make guest", err)
		}
	}
	return dir
}

// TestLaunchRefusesChangedDiskBase: the first launch records the base its
// overlay is made on (disk_base); a base replaced at its path afterwards
// (a new file renamed over it, as an image update would do) is refused at
// the next launch as admission refuses, naming both identities, and QEMU
// never starts on an overlay whose blocks belong to another image. The
// base put back launches again. Fails without the check: the restart
// boots the overlay over the new base.
func TestLaunchRefusesChangedDiskBase(t *testing.T) {
	s := newStack(t)
	s.create(t, s.request("based"))
	id := s.launch(t, "based")
	rec, err := s.st.Get("based")
	require.NoError(t, err)
	was := rec.GetDiskBase()
	require.NotNil(t, was, "the first launch records the base")
	real := filepath.Join(s.root, "real.raw")
	fi, err := os.Stat(real)
	require.NoError(t, err)
	assert.EqualValues(t, fi.Sys().(*syscall.Stat_t).Ino, was.GetIno())
	s.crash(t, "based", id)

	// An image update: a new file, renamed over the old one.
	saved := filepath.Join(s.outside, "real.raw.saved")
	require.NoError(t, os.Link(real, saved))
	tmp := filepath.Join(s.root, ".real.raw.new")
	require.NoError(t, os.WriteFile(tmp, bytes.Repeat([]byte{0x44}, imageSize), 0o600))
	require.NoError(t, os.Rename(tmp, real))
	_, err = s.sup.Launch(ctxT(t, 30*time.Second), "based")
	require.ErrorIs(t, err, admission.ErrAdmissionRefused)
	assert.ErrorContains(t, err, "base image changed")
	st, err := s.sup.Status("based")
	require.NoError(t, err)
	assert.False(t, st.Liveness.Alive, "no QEMU on the wrong base")

	// The old base back (same inode, size and mtime): it launches.
	require.NoError(t, os.Rename(saved, real))
	s.launch(t, "based")
}
