package supervise

import (
	"context"
	"net"
	"os/exec"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
	"vmflow/hostagent/store"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

const (
	stateCreating = vmflowv1.InstanceState_INSTANCE_STATE_CREATING
	stateRunning  = vmflowv1.InstanceState_INSTANCE_STATE_RUNNING
	stateExited   = vmflowv1.InstanceState_INSTANCE_STATE_EXITED
	stepNone      = vmflowv1.StopStep_STOP_STEP_NONE
	stepGone      = vmflowv1.StopStep_STOP_STEP_GONE
)

func TestLaunchRunningStopGone(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "on-failure", 0)

	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	assert.False(t, res.AlreadyRunning)
	rec := e.get("vm1")
	assert.Equal(t, stateRunning, rec.GetState())
	assert.Equal(t, res.Identity, store.IdentityOf(rec.GetProcess()), "pid and start time recorded")
	assert.NotNil(t, rec.GetLastStart())

	st, err := sup.QMPStatus(ctxT(t, 5*time.Second), "vm1")
	require.NoError(t, err)
	assert.True(t, st.Running)
	status, err := sup.Status("vm1")
	require.NoError(t, err)
	assert.True(t, status.Watched)
	assert.True(t, status.Child)
	assert.Equal(t, proc.StateRunning, status.Liveness.State)

	// Where the launch's time went: every stage and vmm.Launch's steps, in
	// order, adding up to the whole call.
	var names []string
	var sum time.Duration
	for _, seg := range res.Timeline {
		names = append(names, seg.Name)
		sum += seg.Took
		assert.GreaterOrEqual(t, seg.Took, time.Duration(0), seg.Name)
	}
	want := []string{segLock, "admit", "capacity", "start slot", "ensure leases", "uid", "VFIO nodes", "network", "fork",
		vmm.LaunchStepClone, "record", vmm.LaunchStepToQMP, vmm.LaunchStepStatus, "QMP ready"}
	if sup.cfg.Cgroups != nil {
		want = slices.Insert(want, slices.Index(want, vmm.LaunchStepToQMP), vmm.LaunchStepCgroup)
	}
	assert.Equal(t, want, names)
	assert.Equal(t, res.Duration, sum, "the segments are the whole call")
	var fork time.Duration
	for _, seg := range []string{vmm.LaunchStepClone, "record", vmm.LaunchStepCgroup, vmm.LaunchStepToQMP, vmm.LaunchStepStatus} {
		fork += res.Timeline.Of(seg)
	}
	assert.Equal(t, fork, res.Timeline.ForkToRunning(), "fork to running: clone up to the running write")
	assert.Positive(t, res.Timeline.Of(vmm.LaunchStepToQMP), "QEMU's start is inside it")

	again, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	assert.True(t, again.AlreadyRunning, "a second launch returns the running VM")
	assert.Equal(t, res.Identity, again.Identity)
	assert.Empty(t, again.Timeline, "nothing started: no launch to time")

	// The delete writes the marker first (invariant 6).
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	// -machine none has no ACPI: the power button is ignored, quit ends it.
	sres, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", 200*time.Millisecond)
	require.NoError(t, err)
	assert.Equal(t, vmm.StepGone, sres.Reached)
	assert.True(t, sres.Child)
	assert.Equal(t, res.Identity, sres.Identity)
	require.NotNil(t, sres.Exit)
	assert.Equal(t, 0, sres.Exit.Code, "quit exits 0")

	rec = e.get("vm1")
	assert.Equal(t, stepGone, rec.GetStopStep(), "record says stop step gone")
	assert.Nil(t, rec.GetProcess(), "identity cleared")
	assert.Equal(t, stateExited, rec.GetState())
	assert.Equal(t, "exit status 0", rec.GetLastExitStatus())
	assert.Equal(t, proc.StateExited, proc.Inspect(res.Identity).State)
	_, err = proc.ReadStat(res.Identity.PID)
	assert.ErrorIs(t, err, proc.ErrNotFound, "reaped: no <defunct> entry")
	assertNoZombieChildren(t)
	p, _ := e.st.Paths("vm1")
	assert.NoFileExists(t, p.Socket)
	assert.NoFileExists(t, p.PID)

	// Idempotent, and the marker keeps the VM down.
	sres, err = sup.Stop(ctxT(t, 10*time.Second), "vm1", 0)
	require.NoError(t, err)
	assert.True(t, sres.AlreadyGone)
	_, err = sup.Launch(ctxT(t, 10*time.Second), "vm1")
	assert.ErrorIs(t, err, ErrManualStop)
	require.NoError(t, sup.WaitExit(ctxT(t, 5*time.Second), "vm1", nil))
}

func TestStopRefusedWithoutMarker(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "", 0)
	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)

	_, err = sup.Stop(ctxT(t, 10*time.Second), "vm1", time.Millisecond)
	require.ErrorIs(t, err, store.ErrManualStopMissing)
	assert.True(t, proc.Inspect(res.Identity).Alive, "nothing was sent")
	rec := e.get("vm1")
	assert.Equal(t, stepNone, rec.GetStopStep())
	assert.Equal(t, stateRunning, rec.GetState())
	assert.Equal(t, res.Identity, store.IdentityOf(rec.GetProcess()))
}

func TestConcurrentStopIsBusy(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))

	// The first Stop sits in its graceful wait (machine none ignores the
	// power button) long enough for the second to arrive.
	var wg sync.WaitGroup
	var firstErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, firstErr = sup.Stop(ctxT(t, 30*time.Second), "vm1", 3*time.Second)
	}()
	require.Eventually(t, func() bool {
		return e.get("vm1").GetStopStep() == vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT
	}, 10*time.Second, 5*time.Millisecond)
	_, err = sup.Stop(ctxT(t, 10*time.Second), "vm1", time.Millisecond)
	require.ErrorIs(t, err, store.ErrBusy)
	wg.Wait()
	require.NoError(t, firstErr)
	assert.Equal(t, stepGone, e.get("vm1").GetStopStep())
}

func TestFailedLaunchLeavesNothing(t *testing.T) {
	e := newEnv(t)
	// /bin/false forks fine and exits at once: the pid is recorded, then
	// the launch fails fast and must clear it.
	sup := e.newSupervisor(func(c *Config) { c.QEMU = "/bin/false" })
	e.create("vm1", "always", 0)
	start := time.Now()
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.ErrorIs(t, err, vmm.ErrLaunchExited)
	assert.Less(t, time.Since(start), 5*time.Second, "fails fast")
	rec := e.get("vm1")
	assert.Nil(t, rec.GetProcess(), "pid cleared")
	assert.Nil(t, rec.GetLaunchStartedAt(), "launch marker cleared")
	assert.Equal(t, stateCreating, rec.GetState())
	assert.Contains(t, rec.GetLastError(), "exited during launch")
	p, _ := e.st.Paths("vm1")
	assert.NoFileExists(t, p.Socket)
	assertNoZombieChildren(t)
}

func TestAgentRestartReattaches(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "on-failure", 0)
	a, pid := startAgent(t, e.dir, "vm1", "", "running")
	rec := e.get("vm1")
	require.Equal(t, stateRunning, rec.GetState())
	qemu := store.IdentityOf(rec.GetProcess())
	require.Equal(t, pid, qemu.PID)
	adoptOnCleanup(t, qemu)
	lastStart := rec.GetLastStart().AsTime()

	a.kill9(t)
	require.True(t, proc.Inspect(qemu).Alive, "QEMU outlives its agent")

	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Equal(t, ReattachReport{Records: 1, Attached: 1, Duration: rep.Duration}, rep)
	st, err := sup.Status("vm1")
	require.NoError(t, err)
	assert.Equal(t, qemu, st.Process, "same process, not restarted")
	assert.True(t, st.Watched)
	assert.False(t, st.Child)
	rec = e.get("vm1")
	assert.Equal(t, stateRunning, rec.GetState())
	assert.Equal(t, lastStart, rec.GetLastStart().AsTime())
	qs, err := sup.QMPStatus(ctxT(t, 5*time.Second), "vm1")
	require.NoError(t, err, "QMP on demand")
	assert.True(t, qs.Running)

	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	sres, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", 100*time.Millisecond)
	require.NoError(t, err)
	assert.False(t, sres.Child, "the non-child path")
	assert.Nil(t, sres.Exit)
	assert.Equal(t, vmm.StepGone, sres.Reached)
	rec = e.get("vm1")
	assert.Nil(t, rec.GetProcess())
	assert.Equal(t, stepGone, rec.GetStopStep())
	assert.Equal(t, stateExited, rec.GetState())
	assert.Equal(t, int32(-1), rec.GetLastExitCode(), "unknown: the agent was not the parent")

	reapAdopted(t, qemu)
	_, err = proc.ReadStat(qemu.PID)
	assert.ErrorIs(t, err, proc.ErrNotFound)
	assertNoZombieChildren(t)
}

func TestAgentKilledBetweenForkAndQMP(t *testing.T) {
	t.Run("qemu lives", func(t *testing.T) {
		e := newEnv(t)
		e.create("vm1", "", 0)
		a, pid := startAgent(t, e.dir, "vm1", "after-started", "started")
		rec := e.get("vm1")
		require.Equal(t, stateCreating, rec.GetState(), "killed before QMP answered")
		qemu := store.IdentityOf(rec.GetProcess())
		require.Equal(t, pid, qemu.PID, "the pid is in the record right after the fork")
		adoptOnCleanup(t, qemu)
		a.kill9(t)

		sup := e.newSupervisor(nil)
		rep, err := sup.Start(ctxT(t, 30*time.Second))
		require.NoError(t, err)
		assert.Equal(t, 1, rep.Attached)
		assert.Equal(t, stateCreating, e.get("vm1").GetState(), "no Creating -> Exited, and QMP not yet confirmed")

		// The retried launch finds it alive and confirms QMP.
		res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
		require.NoError(t, err)
		assert.True(t, res.AlreadyRunning)
		assert.Equal(t, qemu, res.Identity, "re-attached, not a second QEMU")
		assert.Equal(t, stateRunning, e.get("vm1").GetState())

		require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
		sres, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Millisecond)
		require.NoError(t, err)
		assert.False(t, sres.Child)
		reapAdopted(t, qemu)
		assertNoZombieChildren(t)
	})
	t.Run("qemu died", func(t *testing.T) {
		e := newEnv(t)
		e.create("vm1", "always", 0)
		a, _ := startAgent(t, e.dir, "vm1", "after-started", "started")
		qemu := store.IdentityOf(e.get("vm1").GetProcess())
		adoptOnCleanup(t, qemu)
		a.kill9(t)
		require.NoError(t, proc.Signal(qemu, 9))
		// Not reaped yet: an unreaped zombie (as on a host whose PID 1
		// does not reap) still matches the identity but is gone.
		require.Eventually(t, func() bool { return !proc.Inspect(qemu).Alive }, 10*time.Second, 5*time.Millisecond)

		sup := e.newSupervisor(nil)
		rep, err := sup.Start(ctxT(t, 30*time.Second))
		require.NoError(t, err)
		assert.Equal(t, ReattachReport{Records: 1, Gone: 1, Duration: rep.Duration}, rep)
		rec := e.get("vm1")
		assert.Equal(t, stateCreating, rec.GetState(), "stays Creating: the spawn retries the launch")
		assert.Nil(t, rec.GetProcess(), "pid cleared")
		p, _ := e.st.Paths("vm1")
		assert.NoFileExists(t, p.Socket)
		reapAdopted(t, qemu)
		assertNoZombieChildren(t)
	})
}

// killFromOutside SIGKILLs instance id's QEMU through a verified pidfd and
// returns its identity.
func killFromOutside(t *testing.T, e *env, id string) proc.Identity {
	t.Helper()
	rec := e.get(id)
	require.Equal(t, stateRunning, rec.GetState())
	qemu := store.IdentityOf(rec.GetProcess())
	require.NoError(t, proc.Signal(qemu, 9))
	return qemu
}

func TestRestartOnFailureWithBackoff(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "on-failure", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)

	prev := store.IdentityOf(e.get("vm1").GetProcess())
	for attempt, backoff := range []time.Duration{time.Second, 2 * time.Second} {
		killed := killFromOutside(t, e, "vm1")
		var rec *vmflowv1.InstanceRecord
		require.Eventually(t, func() bool {
			rec = e.get("vm1")
			return rec.GetState() == stateRunning && rec.GetProcess() != nil && store.IdentityOf(rec.GetProcess()) != killed
		}, 20*time.Second, 5*time.Millisecond, "restart %d", attempt+1)
		assert.Equal(t, uint32(attempt+1), rec.GetRestartCount())
		assert.Equal(t, "signal: killed", rec.GetLastExitStatus())
		assert.Equal(t, int32(-1), rec.GetLastExitCode())
		// The backoff as the record shows it: from the exit to the restart.
		gap := rec.GetLastStart().AsTime().Sub(rec.GetLastExit().AsTime())
		assert.GreaterOrEqual(t, gap, backoff, "restart %d came %s after the exit", attempt+1, gap)
		assert.Less(t, gap, backoff+3*time.Second)
		assert.NotEqual(t, prev, store.IdentityOf(rec.GetProcess()))
		prev = store.IdentityOf(rec.GetProcess())
		e.waitLog("vm1", "restart scheduled", "restart policy on-failure")
	}
	scheduled := e.logs.FilterMessage("restart scheduled").All()
	require.Len(t, scheduled, 2)
	assert.Equal(t, time.Second, scheduled[0].ContextMap()["backoff"])
	assert.Equal(t, 2*time.Second, scheduled[1].ContextMap()["backoff"])
	assertNoZombieChildren(t)
}

func TestRestartBlockedByManualStop(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "always", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))

	killFromOutside(t, e, "vm1")
	e.waitLog("vm1", "not restarting", "manual-stop marker present")
	rec := e.get("vm1")
	assert.Equal(t, stateExited, rec.GetState())
	assert.Nil(t, rec.GetProcess())
	st, err := sup.Status("vm1")
	require.NoError(t, err)
	assert.True(t, st.NextRestart.IsZero(), "no restart pending")
	assertNoZombieChildren(t)
}

func TestRestartBlockedByManualStopDuringBackoff(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(func(c *Config) { c.RestartBackoff = 2 * time.Second })
	e.create("vm1", "on-failure", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)

	killFromOutside(t, e, "vm1")
	require.Eventually(t, func() bool {
		st, err := sup.Status("vm1")
		return err == nil && !st.NextRestart.IsZero()
	}, 10*time.Second, time.Millisecond, "restart scheduled")
	// The delete begins while the restart waits out its backoff.
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))

	e.waitLog("vm1", "restart cancelled", "manual-stop marker present")
	rec := e.get("vm1")
	assert.Equal(t, stateExited, rec.GetState())
	assert.Nil(t, rec.GetProcess(), "never relaunched")
	assert.Equal(t, uint32(0), rec.GetRestartCount())
	assert.Empty(t, e.logs.FilterMessage("restarting").All())
	// And Stop, the delete's next step, has nothing to do.
	sres, err := sup.Stop(ctxT(t, 10*time.Second), "vm1", 0)
	require.NoError(t, err)
	assert.True(t, sres.AlreadyGone)
}

func TestRestartNeverLeavesExited(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "never", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	killFromOutside(t, e, "vm1")
	e.waitLog("vm1", "not restarting", "restart policy never")
	rec := e.get("vm1")
	assert.Equal(t, stateExited, rec.GetState())
	assert.Nil(t, rec.GetProcess())
	assert.Equal(t, "signal: killed", rec.GetLastExitStatus())
	p, _ := e.st.Paths("vm1")
	assert.NoFileExists(t, p.Socket)
	assert.NoFileExists(t, p.PID)
	assertNoZombieChildren(t)
}

func TestWaitExitReportsProgress(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(func(c *Config) { c.ProgressInterval = 20 * time.Millisecond })
	e.create("vm1", "", 0)
	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)

	var mu sync.Mutex
	var seen []proc.Status
	progress := func(s proc.Status) { mu.Lock(); seen = append(seen, s); mu.Unlock() }
	// Ends on the caller's context while the VM lives, with progress.
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	err = sup.WaitExit(ctx, "vm1", progress)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	mu.Lock()
	require.NotEmpty(t, seen)
	assert.True(t, seen[0].Alive)
	assert.Equal(t, res.Identity.PID, seen[0].PID)
	assert.GreaterOrEqual(t, seen[0].Tasks, 1)
	mu.Unlock()

	done := make(chan error, 1)
	go func() { done <- sup.WaitExit(ctxT(t, 30*time.Second), "vm1", progress) }()
	killFromOutside(t, e, "vm1")
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("WaitExit did not return after the kill")
	}
	assert.Equal(t, proc.StateExited, proc.Inspect(res.Identity).State)
}

func TestCloseLeavesVMsRunning(t *testing.T) {
	e := newEnv(t)
	sup := e.newSupervisor(nil)
	e.create("vm1", "", 0)
	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	require.NoError(t, sup.Close())
	require.NoError(t, sup.Close())
	assert.True(t, proc.Inspect(res.Identity).Alive)
	_, err = sup.Launch(ctxT(t, 5*time.Second), "vm1")
	assert.ErrorIs(t, err, ErrClosed)

	// A new supervisor in the same process re-attaches it.
	sup2 := e.newSupervisor(nil)
	rep, err := sup2.Start(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Attached)
}

func TestStartNeverSignalsMismatchedPid(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "never", 0)
	// A live stranger holds the recorded pid: same pid, another start time.
	cmd := exec.Command("sleep", "600")
	stranger, err := proc.Start(cmd)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = proc.Signal(stranger.Identity(), syscall.SIGKILL)
		<-stranger.Done()
	})
	recorded := stranger.Identity()
	recorded.StartTime++
	_, err = e.st.Update(ctxT(t, 5*time.Second), "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.Process = store.ProcessRecord(recorded)
		r.State = stateRunning
		return nil
	})
	require.NoError(t, err)
	// A stale socket a killed QEMU left behind: a socket nobody listens on.
	p, _ := e.st.Paths("vm1")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: p.Socket, Net: "unix"})
	require.NoError(t, err)
	ln.SetUnlinkOnClose(false)
	require.NoError(t, ln.Close())

	sup := e.newSupervisor(nil)
	rep, err := sup.Start(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	assert.Equal(t, ReattachReport{Records: 1, Gone: 1, Duration: rep.Duration}, rep)
	rec := e.get("vm1")
	assert.Equal(t, stateExited, rec.GetState())
	assert.Nil(t, rec.GetProcess())
	assert.Equal(t, int32(-1), rec.GetLastExitCode())
	assert.NoFileExists(t, p.Socket)
	_, exited := stranger.Exit()
	assert.False(t, exited, "the stranger was not signalled")
	assert.True(t, proc.Inspect(stranger.Identity()).Alive)
}

func TestStopResumesFromRecordedStep(t *testing.T) {
	e := newEnv(t)
	// A previous agent pressed the power button an hour ago and died.
	sup := pressedByDeadAgent(t, e, timestamppb.New(time.Now().Add(-time.Hour)), nil)

	start := time.Now()
	res, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Minute)
	require.NoError(t, err)
	assert.Less(t, time.Since(start), 10*time.Second, "the graceful time was used up before the restart")
	assert.Equal(t, vmm.StepPowerdownSent, res.ResumedFrom)
	require.NotEmpty(t, res.Steps)
	assert.Equal(t, "resumed", res.Steps[0].Via, "the button is not pressed again")
	assert.Equal(t, vmm.StepQuitSent, res.Steps[1].Step)
	assert.Equal(t, stepGone, e.get("vm1").GetStopStep())
	assertNoZombieChildren(t)
}
