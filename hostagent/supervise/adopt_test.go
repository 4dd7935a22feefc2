package supervise

import (
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// impostor starts a real QEMU (-machine none) whose command line carries
// instance id's own "-qmp unix:<socket>,server=on,wait=off", in a session
// of its own (proc.Start), with env as its environment; wrap, when given,
// runs in front of it (`timeout 600 qemu ...`). It is killed (its whole
// process group) and reaped at cleanup.
func impostor(t *testing.T, e *env, id string, env []string, wrap ...string) proc.Identity {
	t.Helper()
	qemu := vmmtest.RequiresQEMU(t)
	p, err := e.st.Paths(id)
	require.NoError(t, err)
	argv := append(wrap, qemu, "-machine", "none", "-accel", testAccel(), "-nodefaults", "-no-user-config",
		"-display", "none", "-qmp", "unix:"+p.Socket+",server=on,wait=off")
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = env
	c, err := proc.Start(cmd)
	require.NoError(t, err)
	proctest.KillGroupOnCleanup(t, c)
	require.Eventually(t, func() bool {
		_, err := os.Stat(p.Socket)
		return err == nil
	}, 20*time.Second, 5*time.Millisecond, "the impostor's QEMU listens on %s", p.Socket)
	return c.Identity()
}

// setMarker gives instance id a launch marker with a nonce, as agents
// before the per-VM uid wrote it before the fork.
func setMarker(t *testing.T, e *env, id string) string {
	t.Helper()
	nonce := "5b1e0c2a9d7f4e3a8c6b0d1e2f3a4b5c"
	_, err := e.st.Update(ctxT(t, 5*time.Second), id, func(r *vmflowv1.InstanceRecord) error {
		r.LaunchStartedAt, r.LaunchNonce = timestamppb.Now(), nonce
		return nil
	})
	require.NoError(t, err)
	return nonce
}

// setUIDMarker gives instance id a launch marker and a uid of its own, as
// launchLocked writes them before the fork.
func setUIDMarker(t *testing.T, e *env, id string) uint32 {
	t.Helper()
	l, err := e.st.Lock(ctxT(t, 5*time.Second), id)
	require.NoError(t, err)
	defer l.Unlock()
	rec, err := l.AssignQEMUUID(ctxT(t, 5*time.Second), e.uids, proc.UIDsInUse, store.BeginLaunch(time.Now(), nil))
	require.NoError(t, err)
	return rec.GetQemuUid()
}

// A marker with the instance's uid adopts only a QEMU running as
// that uid with its name. A copy of its command line (-name guest=vm1, the
// QEMU binary, a session of its own) run as root is neither adopted nor
// signalled, and the marker is cleared.
func TestUIDMarkerImpostorNotAdopted(t *testing.T) {
	requiresRoot(t)
	e := newEnv(t)
	e.create("vm1", "", 0)
	setUIDMarker(t, e, "vm1")
	imp := impostor(t, e, "vm1", []string{"PATH=" + os.Getenv("PATH")})

	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Zero(t, rep.Adopted, "another uid is not the instance's")
	rec := e.get("vm1")
	assert.Nil(t, rec.GetProcess())
	assert.Nil(t, rec.GetLaunchStartedAt(), "no QEMU of the launch runs: marker cleared")
	assert.True(t, proc.Inspect(imp).Alive, "not signalled")
}

// A legacy marker (with a nonce, from an agent before the per-VM uid)
// still adopts the QEMU that carries its nonce in its environment: the
// nonce path is kept for reading.
func TestLegacyNonceMarkerAdopts(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "", 0)
	nonce := setMarker(t, e, "vm1")
	old := impostor(t, e, "vm1", []string{"PATH=" + os.Getenv("PATH"), vmm.LaunchNonceEnv + "=" + nonce})

	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Adopted)
	rec := e.get("vm1")
	assert.Equal(t, old, store.IdentityOf(rec.GetProcess()))
	assert.Nil(t, rec.GetLaunchStartedAt())
	assert.Empty(t, rec.GetLaunchNonce())
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	_, err = sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Millisecond)
	require.NoError(t, err)
}

// A process that copies the instance's QEMU
// command line, runs the QEMU binary and leads its own session, but was not
// given the launch's nonce, is neither adopted nor signalled: the marker
// is resolved as "no QEMU of mine". Fails if whatever carries the -qmp
// argument is adopted (rep.Adopted == 1).
func TestMarkerImpostorNotAdopted(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "", 0)
	setMarker(t, e, "vm1")
	imp := impostor(t, e, "vm1", []string{"PATH=" + os.Getenv("PATH"), vmm.LaunchNonceEnv + "=" + "0123456789abcdef0123456789abcdef"})

	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Zero(t, rep.Adopted, "a copied command line is not an identity")
	assert.Zero(t, rep.Failed)
	rec := e.get("vm1")
	assert.Nil(t, rec.GetProcess(), "the impostor's identity is not written into the record")
	assert.Nil(t, rec.GetLaunchStartedAt(), "no QEMU of the launch runs: marker cleared")
	assert.Empty(t, rec.GetLaunchNonce(), "cleared with the marker")
	assert.True(t, proc.Inspect(imp).Alive, "not signalled")
}

// Legacy records (no marker, from an agent older than it): a
// debugging wrapper `timeout 600 qemu <the instance's -qmp>` is two
// processes with the socket argument. Neither is the instance's QEMU (the
// wrapper is not the QEMU binary; its QEMU does not lead a session), so
// Stop adopts and signals nothing and finishes; TearDown still refuses to
// remove a socket something listens on. Fails if both match by command
// line: Stop then returns the retryable ErrStillRunning forever.
func TestLegacyStopIgnoresWrappedCopy(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "", 0)
	imp := impostor(t, e, "vm1", []string{"PATH=" + os.Getenv("PATH")}, "timeout", "600")
	sup := e.newSupervisor(nil)
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))

	res, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Millisecond)
	require.NoError(t, err)
	assert.True(t, res.AlreadyGone)
	rec := e.get("vm1")
	assert.Nil(t, rec.GetProcess())
	assert.Equal(t, vmflowv1.StopStep_STOP_STEP_GONE, rec.GetStopStep())
	assert.True(t, proc.Inspect(imp).Alive, "the wrapper was not signalled")
	err = sup.TearDown(ctxT(t, 10*time.Second), "vm1")
	require.ErrorIs(t, err, ErrStillRunning, "a live listener's socket is never removed")
	p, _ := e.st.Paths("vm1")
	assert.FileExists(t, p.Socket)
}

// A record with neither a uid nor a launch nonce of its own is never
// matched by its command line: a decoy that runs the QEMU binary in a
// session of its own with the instance's -qmp argument would pass a
// command-line match, and be adopted and then SIGKILLed by the Stop.
// Without a launch marker nothing is looked for and Stop finishes; with one
// the instance needs attention and every caller gets the non-retryable
// ErrUnrecordedAmbiguous; the decoy is never recorded or signalled.
func TestNoIdentityRecordNeverAdoptsByArgv(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "", 0)
	e.create("vm2", "", 0)
	env := []string{"PATH=" + os.Getenv("PATH")}
	decoy1 := impostor(t, e, "vm1", env)
	decoy2 := impostor(t, e, "vm2", env)
	_, err := e.st.Update(ctxT(t, 5*time.Second), "vm2", func(r *vmflowv1.InstanceRecord) error {
		r.LaunchStartedAt = timestamppb.Now() // as an agent older than the nonce wrote it
		return nil
	})
	require.NoError(t, err)
	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Zero(t, rep.Adopted)

	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	res, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Millisecond)
	require.NoError(t, err)
	assert.True(t, res.AlreadyGone, "no marker: nothing of the record runs")
	assert.Nil(t, e.get("vm1").GetProcess(), "the decoy is not adopted")
	assert.Empty(t, e.get("vm1").GetNeedsAttention())

	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm2"))
	_, err = sup.Stop(ctxT(t, 30*time.Second), "vm2", time.Millisecond)
	require.ErrorIs(t, err, ErrUnrecordedAmbiguous)
	assert.ErrorIs(t, err, vmm.ErrNoLaunchIdentity)
	assert.NotErrorIs(t, err, ErrStillRunning, "retrying finds the same nothing to go on: not retryable")
	rec := e.get("vm2")
	assert.Nil(t, rec.GetProcess(), "the decoy is not adopted")
	assert.NotNil(t, rec.GetLaunchStartedAt(), "the marker stays for the operator")
	assert.Contains(t, rec.GetNeedsAttention(), "neither a qemu uid nor a launch nonce")
	assert.NotEqual(t, vmflowv1.StopStep_STOP_STEP_GONE, rec.GetStopStep(), "not said to be gone")
	assert.True(t, proc.Inspect(decoy1).Alive && proc.Inspect(decoy2).Alive, "no decoy was signalled")
}

// The look for an unrecorded QEMU reads its environ, which blocks
// while the target's mmap lock is held (VFIO teardown, a hung mount). A
// record whose look blocks fails its re-attach within its bound, Start
// re-attaches the other instances, and the blocked one is adopted in the
// background once the read can finish. The reader is stood in (a real
// held mmap lock needs a FUSE-backed argument area).
func TestStartBoundsBlockedAdoption(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "", 0)
	e.create("vm2", "", 0)
	// vm1: a real agent killed between the fork and the pid's write.
	a, pid := startAgent(t, e.dir, "vm1", "before-recorded", "forked")
	qemu1, err := proc.ReadIdentity(pid)
	require.NoError(t, err)
	adoptOnCleanup(t, qemu1)
	a.kill9(t)
	require.NotZero(t, e.get("vm1").GetQemuUid(), "the marker's write carries the uid")
	require.Empty(t, e.get("vm1").GetLaunchNonce(), "no nonce: QEMU's environment has none")
	// vm2: running, recorded.
	launcher := e.newSupervisor(nil)
	res2, err := launcher.Launch(ctxT(t, 30*time.Second), "vm2")
	require.NoError(t, err)
	require.NoError(t, launcher.Close())

	unblock := make(chan struct{})
	var unblockOnce bool
	t.Cleanup(func() {
		if !unblockOnce {
			close(unblock)
		}
	})
	sup := e.newSupervisor(func(c *Config) {
		c.LockTimeout = 300 * time.Millisecond // each record's bound in Start
	})
	sup.hooks.readProcMem = func(path string) ([]byte, error) {
		<-unblock // as the kernel's read while the mmap lock is held
		return os.ReadFile(path)
	}
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Equal(t, 2, rep.Records, "each record counted once, failed or not")
	assert.Equal(t, 1, rep.Attached, "vm2 re-attached although vm1's look blocks")
	assert.Equal(t, 1, rep.Failed)
	require.Len(t, rep.Failures, 1)
	assert.Equal(t, "vm1", rep.Failures[0].ID)
	assert.Contains(t, rep.Failures[0].Err, proc.ErrCannotTell.Error(), "can't tell, never none")
	st, err := sup.Status("vm2")
	require.NoError(t, err)
	assert.True(t, st.Watched)
	assert.Equal(t, res2.Identity, st.Process)
	rec := e.get("vm1")
	assert.Nil(t, rec.GetProcess())
	assert.NotNil(t, rec.GetLaunchStartedAt(), "can't tell keeps the marker")
	assert.True(t, proc.Inspect(qemu1).Alive)

	close(unblock)
	unblockOnce = true
	require.Eventually(t, func() bool {
		rec := e.get("vm1")
		return rec.GetProcess() != nil && store.IdentityOf(rec.GetProcess()) == qemu1
	}, 20*time.Second, 10*time.Millisecond, "vm1's QEMU adopted by the background re-attach")
	require.Eventually(t, func() bool {
		st, err := sup.Status("vm1")
		return err == nil && st.Watched
	}, 10*time.Second, 10*time.Millisecond)
	assert.Nil(t, e.get("vm1").GetLaunchStartedAt())

	// And it is stopped by identity like any other.
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	sres, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Millisecond)
	require.NoError(t, err)
	assert.Equal(t, qemu1, sres.Identity)
	reapAdopted(t, qemu1)
}
