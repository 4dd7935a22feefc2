package supervise

import (
	"context"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Invariant 11: the agent is killed after the fork and before the pid
// reaches the record. The next agent must find that QEMU (by its uid and
// name) and own it, so a delete stops it instead of tearing down its socket.
func TestAgentKilledBeforePidRecorded(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "", 0)
	a, pid := startAgent(t, e.dir, "vm1", "before-recorded", "forked")
	qemu, err := proc.ReadIdentity(pid)
	require.NoError(t, err)
	adoptOnCleanup(t, qemu)
	rec := e.get("vm1")
	require.Nil(t, rec.GetProcess(), "killed before the pid was written")
	require.NotNil(t, rec.GetLaunchStartedAt(), "the launch marker was written before the fork")
	require.NotZero(t, rec.GetQemuUid(), "with the instance's uid")
	assert.Empty(t, rec.GetLaunchNonce())
	require.Eventually(t, func() bool {
		u, err := proc.ReadUIDs(qemu.PID)
		return err == nil && u == [4]uint32{rec.GetQemuUid(), rec.GetQemuUid(), rec.GetQemuUid(), rec.GetQemuUid()}
	}, 10*time.Second, time.Millisecond, "QEMU runs as the recorded uid")
	a.kill9(t)
	require.True(t, proc.Inspect(qemu).Alive, "QEMU outlives its agent, unrecorded")

	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Adopted, "found by its uid and name")
	assert.Equal(t, 1, rep.Attached)
	rec = e.get("vm1")
	assert.Equal(t, qemu, store.IdentityOf(rec.GetProcess()), "the same QEMU adopted by identity, not a second one")
	assert.Nil(t, rec.GetLaunchStartedAt(), "marker resolved")
	st, err := sup.Status("vm1")
	require.NoError(t, err)
	assert.True(t, st.Watched)

	// The delete: marker, Stop, WaitExit, TearDown. Nothing is left.
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	sres, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Millisecond)
	require.NoError(t, err)
	assert.False(t, sres.AlreadyGone, "the adopted QEMU was stopped, not found absent")
	assert.Equal(t, qemu, sres.Identity)
	require.NoError(t, sup.WaitExit(ctxT(t, 10*time.Second), "vm1", nil))
	require.NoError(t, sup.TearDown(ctxT(t, 10*time.Second), "vm1"))
	reapAdopted(t, qemu)
	assert.False(t, proc.Inspect(qemu).Alive)
	p, _ := e.st.Paths("vm1")
	assert.NoFileExists(t, p.Socket)
	assert.NoFileExists(t, p.PID)
	assertNoZombieChildren(t)
}

// A marker with no QEMU behind it (the agent died before the fork, or the
// QEMU is gone) is cleared, and the instance launches normally.
func TestLaunchMarkerWithoutQEMUIsCleared(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "", 0)
	// The marker as launchLocked writes it, with the uid (a marker without
	// one cannot be resolved: TestNoIdentityRecordNeverAdoptsByArgv).
	setUIDMarker(t, e, "vm1")
	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Equal(t, ReattachReport{Records: 1, Duration: rep.Duration}, rep)
	assert.Nil(t, e.get("vm1").GetLaunchStartedAt())
	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	rec := e.get("vm1")
	assert.Equal(t, res.Identity, store.IdentityOf(rec.GetProcess()))
	assert.Nil(t, rec.GetLaunchStartedAt(), "the pid replaced the marker")
}

// TearDown never removes the socket of a live QEMU: recorded, unrecorded
// (found by its socket path), or just a listener on the socket.
func TestTearDownNeverRemovesLiveSocket(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "", 0)
	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	t.Cleanup(func() { killAndReap(t, res.Identity) }) // the record forgets it below
	p, _ := e.st.Paths("vm1")

	err = sup.TearDown(ctxT(t, 10*time.Second), "vm1")
	require.ErrorIs(t, err, ErrStillRunning, "recorded and alive")
	assert.FileExists(t, p.Socket)

	// The record forgets the process (an agent died before writing it):
	// the socket-path scan still finds it, and TearDown adopts, not removes.
	_, err = e.st.Update(ctxT(t, 5*time.Second), "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.Process = nil
		return nil
	})
	require.NoError(t, err)
	require.NoError(t, sup.Close())
	sup = e.newSupervisor(nil)
	err = sup.TearDown(ctxT(t, 10*time.Second), "vm1")
	require.ErrorIs(t, err, ErrStillRunning, "unrecorded but alive")
	assert.FileExists(t, p.Socket)
	assert.Equal(t, res.Identity, store.IdentityOf(e.get("vm1").GetProcess()), "adopted for the Stop that must come first")
	assert.True(t, proc.Inspect(res.Identity).Alive, "nothing signalled")

	// Stopped: now the files go.
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	_, err = sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Millisecond)
	require.NoError(t, err)
	require.NoError(t, sup.TearDown(ctxT(t, 10*time.Second), "vm1"))
	assert.NoFileExists(t, p.Socket)
	assert.NoFileExists(t, p.PID)

	// A listener nobody recorded (not even a QEMU): still refused.
	ln, err := net.Listen("unix", p.Socket)
	require.NoError(t, err)
	defer ln.Close()
	err = sup.TearDown(ctxT(t, 10*time.Second), "vm1")
	require.ErrorIs(t, err, ErrStillRunning)
	assert.FileExists(t, p.Socket)

	require.NoError(t, sup.TearDown(ctxT(t, 5*time.Second), "nosuch"), "no record: nothing to tear down")
}

// truncate cuts instance id's record.json in half, as a crash of a writer
// that did not rename atomically (or a disk fault) would.
func truncate(t *testing.T, e *env, id string) string {
	t.Helper()
	p, err := e.st.Paths(id)
	require.NoError(t, err)
	b, err := os.ReadFile(p.Record)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, b[:len(b)/2], 0o600))
	return p.Record
}

// Invariant 12: one unreadable record beside two live VMs. Start
// succeeds, re-attaches both, quarantines the bad one untouched.
func TestStartQuarantinesUnreadableRecord(t *testing.T) {
	e := newEnv(t)
	launcher := e.newSupervisor(nil)
	ids := map[string]proc.Identity{}
	for _, id := range []string{"vm1", "vm2", "vm3"} {
		e.create(id, "always", 0)
		res, err := launcher.Launch(ctxT(t, 30*time.Second), id)
		require.NoError(t, err)
		ids[id] = res.Identity
	}
	require.NoError(t, launcher.Close())
	bad := ids["vm2"]
	path := truncate(t, e, "vm2")
	t.Cleanup(func() { killAndReap(t, bad) }) // its record no longer names it

	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err, "one bad record never stops the host")
	assert.Equal(t, 3, rep.Records)
	assert.Equal(t, 2, rep.Attached)
	assert.Zero(t, rep.Failed)
	require.Len(t, rep.Unreadable, 1)
	assert.Equal(t, "vm2", rep.Unreadable[0].ID)
	assert.Equal(t, path, rep.Unreadable[0].Path)
	assert.Contains(t, rep.Unreadable[0].Err, store.ErrInvalidRecord.Error())
	logged := e.logs.FilterMessage("record unreadable; instance quarantined: not re-attached, signalled, restarted or released").All()
	require.Len(t, logged, 1)
	assert.Equal(t, path, logged[0].ContextMap()["path"])

	for _, id := range []string{"vm1", "vm3"} {
		st, err := sup.Status(id)
		require.NoError(t, err)
		assert.True(t, st.Watched, "%s re-attached", id)
		assert.Equal(t, ids[id], st.Process)
	}
	// Every operation on the quarantined instance fails with the store's
	// error and touches nothing.
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm2"))
	_, err = sup.Launch(ctxT(t, 10*time.Second), "vm2")
	assert.ErrorIs(t, err, store.ErrInvalidRecord)
	_, err = sup.Stop(ctxT(t, 10*time.Second), "vm2", time.Millisecond)
	assert.ErrorIs(t, err, store.ErrInvalidRecord)
	assert.ErrorIs(t, sup.WaitExit(ctxT(t, 10*time.Second), "vm2", nil), store.ErrInvalidRecord)
	assert.ErrorIs(t, sup.TearDown(ctxT(t, 10*time.Second), "vm2"), store.ErrInvalidRecord)
	_, err = sup.Existing(ctxT(t, 10*time.Second), "vm2")
	assert.ErrorIs(t, err, store.ErrInvalidRecord)
	assert.ErrorIs(t, err, ErrNotRunningAsAsked)
	assert.True(t, proc.Inspect(bad).Alive, "the quarantined instance's QEMU was not signalled")
	p, _ := e.st.Paths("vm2")
	assert.FileExists(t, p.Socket, "nor its socket removed")

	// The others are served: a crash of vm1 is restarted by its policy.
	killed := ids["vm1"]
	require.NoError(t, proc.Signal(killed, syscall.SIGKILL))
	require.Eventually(t, func() bool {
		rec := e.get("vm1")
		return rec.GetState() == stateRunning && rec.GetProcess() != nil && store.IdentityOf(rec.GetProcess()) != killed
	}, 20*time.Second, 5*time.Millisecond, "vm1 restarted beside the quarantined vm2")
}

// A record from an earlier boot names an exited VM,
// even when a live process holds the pid now; nothing is signalled.
func TestStartEarlierBootRecordIsExited(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "never", 0)
	e.create("vm2", "", 0)
	// A live process with the recorded pid and start time: only the boot
	// id differs, as after a reboot that reused the numbers.
	live, err := proc.Start(execSleep())
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = proc.Signal(live.Identity(), syscall.SIGKILL)
		<-live.Done()
	})
	recorded := live.Identity()
	recorded.BootID = "00000000-0000-0000-0000-000000000000"
	for _, id := range []string{"vm1", "vm2"} {
		_, err = e.st.Update(ctxT(t, 5*time.Second), id, func(r *vmflowv1.InstanceRecord) error {
			r.Process = store.ProcessRecord(recorded)
			if id == "vm1" {
				r.State = stateRunning
			}
			return nil
		})
		require.NoError(t, err)
	}

	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	assert.Equal(t, ReattachReport{Records: 2, Gone: 2, Duration: rep.Duration}, rep)
	rec := e.get("vm1")
	assert.Equal(t, stateExited, rec.GetState())
	assert.Nil(t, rec.GetProcess())
	assert.True(t, strings.HasPrefix(rec.GetLastExitStatus(), "host rebooted"), "last exit %q", rec.GetLastExitStatus())
	rec = e.get("vm2")
	assert.Equal(t, stateCreating, rec.GetState(), "Creating stays Creating, pid cleared")
	assert.Nil(t, rec.GetProcess())
	_, exited := live.Exit()
	assert.False(t, exited, "the live process was not signalled")
	assert.True(t, proc.Inspect(live.Identity()).Alive)
	st, err := sup.Status("vm1")
	require.NoError(t, err)
	assert.False(t, st.Watched, "not re-attached")
}

// PrepareLaunch runs under the lock before the first launch and before
// every restart; the default refuses a record with a vGPU.
func TestPrepareLaunchBeforeEveryLaunch(t *testing.T) {
	e := newEnv(t)
	calls := make(chan string, 10)
	sup := e.newSupervisor(func(c *Config) {
		c.PrepareLaunch = func(ctx context.Context, l *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
			calls <- l.ID()
			return DefaultPrepareLaunch(ctx, l, rec)
		}
	})
	e.create("vm1", "always", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	require.Len(t, calls, 1)
	<-calls
	killFromOutside(t, e, "vm1")
	select {
	case id := <-calls:
		assert.Equal(t, "vm1", id, "the restart prepared its launch too")
	case <-time.After(20 * time.Second):
		t.Fatal("restart did not call PrepareLaunch")
	}

	rec := &vmflowv1.InstanceRecord{Id: "vm9", Spec: &vmflowv1.VMSpec{Machine: "q35", VgpuProfile: "nvidia-63"}}
	_, err = DefaultPrepareLaunch(context.Background(), nil, rec)
	assert.ErrorIs(t, err, ErrNoSpec)
	rec.Spec.VgpuProfile = ""
	v, err := DefaultPrepareLaunch(context.Background(), nil, rec)
	require.NoError(t, err)
	assert.True(t, v.NoReboot, "the one conversion, admission.ForRecord")
	assert.True(t, v.SerialToLog)
}

func execSleep() *exec.Cmd { return exec.Command("sleep", "600") }
