package supervise

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// A VM exited, its agent restarted, and meanwhile the wall clock was
// stepped back an hour: the recorded exit lies an hour in the future. The
// restart backoff resumed by the new agent is never longer than the
// configured one (measured on CLOCK_BOOTTIME, the moment kept beside the
// exit). Fails on the wall clock alone (the delay is 1h plus the backoff).
func TestRestartBackoffAfterAgentRestartIgnoresClockStep(t *testing.T) {
	e := uidEnv(t)
	e.create("vm1", "always", 0)
	_, err := e.st.Transition(ctxT(t, 5*time.Second), "vm1", stateRunning)
	require.NoError(t, err)
	_, err = e.st.Update(ctxT(t, 5*time.Second), "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.State = stateExited
		r.LastExit = timestamppb.New(time.Now().Add(time.Hour))
		r.LastExitBoot = store.BootMomentNow()
		r.LastExitStatus, r.LastExitCode = "signal: killed", -1
		return nil
	})
	require.NoError(t, err)
	const backoff = time.Hour // never fires during the test
	sup := e.newSupervisor(func(c *Config) { c.RestartBackoff, c.RestartBackoffMax = backoff, backoff })
	rep, err := sup.Start(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	require.Equal(t, 1, rep.RestartsScheduled)
	le := e.waitLog("vm1", "restart scheduled", "")
	delay, ok := le.ContextMap()["delay"].(time.Duration)
	require.True(t, ok, "%v", le.ContextMap())
	assert.LessOrEqual(t, delay, backoff)
	assert.Greater(t, delay, backoff-time.Minute, "the exit was moments ago on CLOCK_BOOTTIME")
	st, err := sup.Status("vm1")
	require.NoError(t, err)
	assert.WithinDuration(t, time.Now().Add(delay), st.NextRestart, time.Minute)
}

// A resumed graceful wait is what is left of the configured one, measured
// on CLOCK_BOOTTIME; with only a wall-clock timestamp, a clock stepped back
// gives the configured wait, never more.
func TestResumedGracefulNeverLonger(t *testing.T) {
	const graceful = 30 * time.Second
	now := time.Now()
	future := timestamppb.New(now.Add(time.Hour))
	assert.Equal(t, graceful, resumedWait(graceful, store.Elapsed(future, nil, now)))
	got := resumedWait(graceful, store.Elapsed(future, store.BootMomentNow(), now))
	assert.LessOrEqual(t, got, graceful)
	assert.Greater(t, got, graceful-10*time.Second)
	assert.Equal(t, time.Millisecond, resumedWait(graceful, store.Elapsed(timestamppb.New(now.Add(-time.Hour)), nil, now)),
		"used up: the floor vmm does not read as its default")
}

// The button was pressed by an agent that died, and the wall clock was then
// stepped back an hour: the resumed stop waits no longer than its graceful
// time (on the old wall-clock arithmetic it waited 1h plus that).
func TestStopResumedAfterClockStepBack(t *testing.T) {
	e := newEnv(t)
	sup := pressedByDeadAgent(t, e, timestamppb.New(time.Now().Add(time.Hour)), store.BootMomentNow())
	const graceful = 2 * time.Second
	res, err := sup.Stop(ctxT(t, 30*time.Second), "vm1", graceful)
	require.NoError(t, err)
	assert.Equal(t, vmm.StepPowerdownSent, res.ResumedFrom)
	stopping := e.logs.FilterMessage("stopping").All()
	require.Len(t, stopping, 1)
	assert.LessOrEqual(t, stopping[0].ContextMap()["graceful"], graceful)
	assert.Equal(t, stepGone, e.get("vm1").GetStopStep())
	assertNoZombieChildren(t)
}

// pressedByDeadAgent launches vm1 and makes its record say what an agent
// that pressed the power button at (wall, boot) and died left: the marker
// and stop step powerdown sent.
func pressedByDeadAgent(t *testing.T, e *env, wall *timestamppb.Timestamp, boot *vmflowv1.BootMoment) *Supervisor {
	t.Helper()
	sup := e.newSupervisor(nil)
	e.create("vm1", "", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	_, err = e.st.Update(ctxT(t, 5*time.Second), "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.StopStep = vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT
		r.StopStepAt, r.StopStepBoot = wall, boot
		return nil
	})
	require.NoError(t, err)
	return sup
}
