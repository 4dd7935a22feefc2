package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	enumspb "go.temporal.io/api/enums/v1"

	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// stopVMAttempts returns, from a workflow's history, how its stop
// (StopInstance: marker, stop ladder, wait for the group) ended:
// the attempt its started event names (the server writes one started event
// per activity, with the attempt that finished) and the event types of its
// outcomes.
func stopVMAttempts(t *testing.T, e *env, workflowID string) (attempts []int32, outcomes []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	it := e.c.GetWorkflowHistory(ctx, workflowID, "", false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	stop := map[int64]bool{}
	for it.HasNext() {
		ev, err := it.Next()
		if err != nil {
			t.Fatalf("history of %s: %v", workflowID, err)
		}
		if a := ev.GetActivityTaskScheduledEventAttributes(); a != nil && a.GetActivityType().GetName() == workflows.ActivityStopInstance {
			stop[ev.GetEventId()] = true
		}
		if a := ev.GetActivityTaskStartedEventAttributes(); a != nil && stop[a.GetScheduledEventId()] {
			attempts = append(attempts, a.GetAttempt())
		}
		switch {
		case ev.GetActivityTaskCompletedEventAttributes() != nil && stop[ev.GetActivityTaskCompletedEventAttributes().GetScheduledEventId()],
			ev.GetActivityTaskFailedEventAttributes() != nil && stop[ev.GetActivityTaskFailedEventAttributes().GetScheduledEventId()],
			ev.GetActivityTaskTimedOutEventAttributes() != nil && stop[ev.GetActivityTaskTimedOutEventAttributes().GetScheduledEventId()]:
			outcomes = append(outcomes, ev.GetEventType().String())
		}
	}
	return attempts, outcomes
}

// agentLines returns the agent log's JSON lines with message msg about
// instance id, in order.
func (e *env) agentLines(id, msg string) []map[string]any {
	e.t.Helper()
	b, err := os.ReadFile(e.agent.Log)
	if err != nil {
		e.t.Fatalf("agent log: %v", err)
	}
	var out []map[string]any
	for _, line := range strings.Split(string(b), "\n") {
		var l map[string]any
		if json.Unmarshal([]byte(line), &l) == nil && l["msg"] == msg && l["instance_id"] == id {
			out = append(out, l)
		}
	}
	return out
}

// spawnAndStopUntilPowerdown spawns a -machine none VM (deaf to the power
// button, so the ladder waits out the graceful time) and starts its delete
// with graceful seconds, returning once the agent pressed the button.
func spawnAndStopUntilPowerdown(e *env, id string, graceful uint32) {
	e.t.Helper()
	e.spawn(e.noneSpawn(id, false))
	e.startDelete(id, graceful)
	waitFor(e.t, time.Minute, "the stop ladder pressed the power button", func() (bool, string) {
		steps := e.agentStopSteps(id)
		return len(steps) > 0 && steps[0] == "powerdown_sent", strings.Join(steps, ",")
	})
}

// TestSIGTERMLetsStopVMFinish: SIGTERM to the real agent binary during a
// short stop ladder (3 s graceful) lets that StopVM attempt complete before
// the agent exits: the history shows attempt 1 completed, and the delete
// finishes once an agent runs again. Before, WorkerStopTimeout was 0: the
// SDK cancelled the activity at once, the attempt failed or timed out, and
// a retry ran the rest of the ladder after a new agent came up.
func TestSIGTERMLetsStopVMFinish(t *testing.T) {
	timeTest(t)
	e := newEnv(t, envOptions{})
	id := "e2e-sigterm-" + suffix(t)
	spawnAndStopUntilPowerdown(e, id, 3)

	began := time.Now()
	if err := e.agent.Signal(syscall.SIGTERM, 30*time.Second); err != nil {
		t.Fatalf("SIGTERM: %v", err)
	}
	t.Logf("agent exited %s after SIGTERM", time.Since(began).Round(time.Millisecond))
	if got := e.agentLines(id, "VM stopped"); len(got) != 1 {
		t.Fatalf("the agent exited without finishing the stop ladder (%d \"VM stopped\" lines)", len(got))
	}
	// Its completion reached Temporal before the agent closed its client.
	waitFor(t, 30*time.Second, "StopVM completed in the history", func() (bool, string) {
		attempts, outcomes := stopVMAttempts(t, e, workflows.DeleteWorkflowID(id))
		return len(outcomes) == 1 && outcomes[0] == enumspb.EVENT_TYPE_ACTIVITY_TASK_COMPLETED.String() &&
			len(attempts) == 1 && attempts[0] == 1, fmt.Sprintf("attempts %v, outcomes %v", attempts, outcomes)
	})
	if steps := e.agentStopSteps(id); strings.Count(strings.Join(steps, ","), "powerdown_sent") != 1 {
		t.Errorf("stop steps %v: the power button pressed more than once", steps)
	}

	e.agent.Start(t)
	runFor(t, e, id)
	e.assertNothingLeft()
}

// TestSIGTERMCancelsLongStopVMAndRetryResumes: a stop ladder longer than
// the agent's --stop-timeout is cancelled when the timeout ends; the agent
// exits in time, and the retry on the next agent resumes from the step the
// record holds, pressing no button twice.
func TestSIGTERMCancelsLongStopVMAndRetryResumes(t *testing.T) {
	timeTest(t)
	e := newEnv(t, envOptions{noStart: true})
	e.agent.Args = append(e.agent.Args, "--stop-timeout", "1s")
	e.agent.Start(t)
	e.worker.Start(t)
	id := "e2e-sigterm-long-" + suffix(t)
	spawnAndStopUntilPowerdown(e, id, 20)

	began := time.Now()
	if err := e.agent.Signal(syscall.SIGTERM, 15*time.Second); err != nil {
		t.Fatalf("SIGTERM: %v", err)
	}
	if took := time.Since(began); took > 10*time.Second {
		t.Errorf("the agent took %s to exit with --stop-timeout 1s", took)
	}
	if got := e.agentLines(id, "VM stopped"); len(got) != 0 {
		t.Fatalf("the 20 s ladder finished within the 1 s stop timeout: %v", got)
	}
	if rec := e.record(id); rec.GetStopStep() != vmflowv1.StopStep_STOP_STEP_POWERDOWN_SENT {
		t.Fatalf("record holds stop step %v, want powerdown sent", rec.GetStopStep())
	}

	e.agent.Start(t)
	runFor(t, e, id)
	steps := e.agentStopSteps(id)
	if n := strings.Count(strings.Join(steps, ","), "powerdown_sent"); n != 1 {
		t.Errorf("stop steps %v: the power button pressed %d times, want once", steps, n)
	}
	resumed := false
	for _, l := range e.agentLines(id, "stopping") {
		resumed = resumed || l["from"] == "powerdown_sent"
	}
	if !resumed {
		t.Errorf("the retry did not resume from powerdown_sent; stop steps %v", steps)
	}
	e.assertNothingLeft()
}

// runFor waits for the delete of id to finish.
func runFor(t *testing.T, e *env, id string) {
	t.Helper()
	if err := e.c.GetWorkflow(e.ctx(3*time.Minute), workflows.DeleteWorkflowID(id), "").Get(e.ctx(3*time.Minute), nil); err != nil {
		t.Fatalf("delete %s: %v", id, err)
	}
}
