package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"

	"vmflow/hostagent/proc"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// Three host agents on one worker and one dev server.
// 30 `-machine none` instances are spread over the hosts; one agent is
// killed (-9) while some of its deletes are in the stop ladder. Only that
// host's deletes show host-unreachable with VmNeedsAttention; the other
// hosts keep spawning and deleting (medians logged before and after the
// stop, nothing asserted on time). Abandon ends some of the dead host's
// deletes and says on each that its record stays on the host. The
// restarted agent re-attaches its VMs, its pending deletes complete, and
// the abandoned instances are listed as deleting by `vmflow-hostagent ls`
// until a new delete of each completes.
func TestFleetOneHostDown(t *testing.T) {
	timeTest(t)
	first := newEnv(t, envOptions{})
	hosts := []*env{first, newEnv(t, envOptions{shareWith: first}), newEnv(t, envOptions{shareWith: first})}
	live, dead := hosts[:2], hosts[2]
	ops := workflows.NewClient(first.c, first.queue)
	_, agentBin := buildBinaries(t)
	tag := suffix(t)
	const perHost = 10
	ids := make([][]string, len(hosts))
	for h := range hosts {
		for i := range perHost {
			ids[h] = append(ids[h], fmt.Sprintf("e2e-fl%d-%s-%02d", h, tag, i))
		}
	}

	// 1. 30 spawns at once, 10 per host, one with a vGPU on each host.
	var spawns []*flight
	for h, e := range hosts {
		for i, id := range ids[h] {
			spawns = append(spawns, startFlight(e, id, e.startSpawn(e.noneSpawn(id, i == 0))))
		}
	}
	t.Logf("30 spawns over 3 hosts: median %s", median(landAll(t, spawns)))

	// 2. Deletes on the live hosts while all agents run.
	var before []*flight
	for h, e := range live {
		for _, id := range ids[h][8:] {
			before = append(before, startFlight(e, id, e.startDelete(id, 1)))
		}
	}
	t.Logf("live hosts' deletes before the stop: median %s", median(landAll(t, before)))

	// 3. Six of the dead host's deletes enter the stop ladder (a -machine
	// none QEMU ignores the power button, so each waits its graceful 8 s in
	// StopVM), then its agent is killed with those activities in flight.
	stopping := ids[2][1:7]
	abandoned, pending := stopping[:3], stopping[3:]
	qemuOf := map[string]proc.Identity{}
	var deadRuns = map[string]client.WorkflowRun{}
	for _, id := range stopping {
		qemuOf[id] = identityOf(dead.record(id))
		deadRuns[id] = dead.startDelete(id, 8)
	}
	waitFor(t, 30*time.Second, "the dead host's deletes in the stop ladder", func() (bool, string) {
		for _, id := range stopping {
			if !slices.Contains(dead.agentStopSteps(id), "powerdown_sent") {
				return false, id + " has no powerdown yet"
			}
		}
		return true, ""
	})
	for _, id := range stopping {
		require.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_DELETING, dead.record(id).GetState(), "%s is deleting on its host", id)
	}
	dead.agent.Kill(t)
	stoppedAt := time.Now()

	// 4. After the stop: one more delete on the dead host (it cannot even
	// begin), deletes and spawns on the live hosts.
	late := ids[2][7]
	qemuOf[late] = identityOf(dead.record(late))
	deadRuns[late] = dead.startDelete(late, 1)
	var after, afterSpawns []*flight
	for h, e := range live {
		for _, id := range ids[h][6:8] {
			after = append(after, startFlight(e, id, e.startDelete(id, 1)))
		}
		for i := range 2 {
			id := fmt.Sprintf("e2e-fl%d-%s-n%d", h, tag, i)
			ids[h] = append(ids[h], id)
			afterSpawns = append(afterSpawns, startFlight(e, id, e.startSpawn(e.noneSpawn(id, false))))
		}
	}
	t.Logf("live hosts after the stop: deletes median %s, spawns median %s",
		median(landAll(t, after)), median(landAll(t, afterSpawns)))

	// Between the waits at host-unreachable each delete tries its host
	// again (its stage shows the step it tries, still needing attention):
	// each must have been seen at host-unreachable at least once.
	deadIDs := append(slices.Clone(stopping), late)
	seen := map[string]bool{}
	waitFor(t, 60*time.Second, "the dead host's deletes at host-unreachable, needing attention", func() (bool, string) {
		for _, id := range deadIDs {
			if seen[id] {
				continue
			}
			st, err := dead.status(workflows.DeleteWorkflowID(id))
			if err != nil {
				return false, err.Error()
			}
			if st.GetStage() != workflows.StageHostUnreachable || !st.GetNeedsAttention() {
				return false, fmt.Sprintf("%s: %+v", id, st)
			}
			seen[id] = true
		}
		return true, ""
	})
	t.Logf("host-unreachable on all %d deletes of the dead host %s after its agent was killed", len(deadIDs), time.Since(stoppedAt).Round(100*time.Millisecond))
	for _, f := range append(before, after...) {
		st, err := f.e.status(workflows.DeleteWorkflowID(f.id))
		require.NoError(t, err)
		assert.Equal(t, workflows.StageDeleted, st.GetStage(), "%s on live host %s", f.id, f.e.hostID)
		assert.False(t, st.GetNeedsAttention(), "%s on live host %s", f.id, f.e.hostID)
	}
	countAttention := func(e *env) int64 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		r, err := e.c.CountWorkflow(ctx, &workflowservice.CountWorkflowExecutionsRequest{
			Query: fmt.Sprintf("VmNeedsAttention=true AND VmHostId='%s' AND ExecutionStatus='Running'", e.hostID)})
		require.NoError(t, err)
		return r.GetCount()
	}
	waitFor(t, 30*time.Second, "VmNeedsAttention on the dead host's deletes", func() (bool, string) {
		n := countAttention(dead)
		return n == int64(len(deadIDs)), fmt.Sprintf("%d of %d", n, len(deadIDs))
	})
	for _, e := range live {
		assert.Zero(t, countAttention(e), "no workflow of live host %s needs attention", e.hostID)
	}

	// 5. Abandon three of the dead host's deletes: each ends, saying its
	// record stays on the host.
	// Abandon is accepted only while the delete waits between tries of its
	// host (not during a try's pickup timeout): an operator sends it again
	// on that refusal, and so does this test.
	for _, id := range abandoned {
		var st *vmflowv1.WorkflowStatus
		refusals := 0
		waitFor(t, 30*time.Second, "abandon of "+id+" accepted", func() (bool, string) {
			var err error
			st, err = ops.Abandon(first.ctx(30*time.Second), id, "e2e: host presumed lost")
			var ae *temporal.ApplicationError
			if errors.As(err, &ae) && ae.Type() == workflows.ErrTypeRefused {
				refusals++
				return false, err.Error()
			}
			require.NoError(t, err, "abandon %s", id)
			return true, ""
		})
		t.Logf("abandon %s (after %d refusals): %+v", id, refusals, st)
		assert.Equal(t, workflows.StageAbandoned, st.GetStage())
		assert.False(t, st.GetNeedsAttention())
		assert.True(t, st.GetMetadataRetained(), "abandon of %s says its record stays on host %s", id, dead.hostID)
		var res vmflowv1.DeleteResult
		require.NoError(t, deadRuns[id].Get(first.ctx(30*time.Second), &res))
		assert.True(t, res.GetAbandoned())
	}

	// 6. The agent comes back: it re-attaches its VMs and finishes the
	// deletes nobody abandoned.
	dead.agent.Start(t)
	waitFor(t, 30*time.Second, "the restarted agent re-attached its 10 VMs", func() (bool, string) {
		type supervising struct {
			Msg      string `json:"msg"`
			Records  int    `json:"records"`
			Attached int    `json:"attached"`
		}
		var last supervising
		// The log holds both runs of the agent: the last such line counts.
		for _, line := range strings.Split(dead.agent.Tail(1<<22), "\n") {
			var l supervising
			if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "supervising" {
				last = l
			}
		}
		return dead.agent.Started().After(stoppedAt) && last.Records == perHost && last.Attached == perHost, fmt.Sprintf("%+v", last)
	})
	var pend []*flight
	for _, id := range append(slices.Clone(pending), late) {
		pend = append(pend, &flight{e: dead, id: id, run: deadRuns[id], begin: stoppedAt})
	}
	landAll(t, pend)
	for _, id := range append(slices.Clone(pending), late) {
		assert.Nil(t, dead.record(id), "%s deleted after the restart", id)
		assertNoProcess(t, qemuOf[id])
	}
	ls := func() map[string]lsInstance {
		out, err := exec.CommandContext(first.ctx(30*time.Second), agentBin, "ls", "--state-dir", dead.stateDir, "-o", "json").Output()
		require.NoError(t, err, "vmflow-hostagent ls")
		var insts []lsInstance
		require.NoError(t, json.Unmarshal(out, &insts), "ls -o json: %s", out)
		m := map[string]lsInstance{}
		for _, in := range insts {
			m[in.ID] = in
		}
		return m
	}
	listed := ls()
	for _, id := range abandoned {
		in, ok := listed[id]
		require.True(t, ok, "ls lists abandoned %s", id)
		assert.Equal(t, "deleting", in.State, "abandoned %s", id)
		assert.True(t, in.Process != nil && in.Process.Alive, "abandoned %s keeps its VM, re-attached: %+v", id, in.Process)
		assert.True(t, proc.Inspect(qemuOf[id]).Alive, "abandoned %s: the same QEMU", id)
	}
	for _, id := range []string{ids[2][0], ids[2][8], ids[2][9]} {
		assert.Equal(t, "running", listed[id].State, "untouched %s", id)
	}

	// 7. A new delete of each abandoned instance completes; until then ls
	// lists it as deleting.
	var redo []*flight
	for _, id := range abandoned {
		redo = append(redo, startFlight(dead, id, dead.startDelete(id, 1)))
	}
	landAll(t, redo)
	listed = ls()
	for _, id := range abandoned {
		assert.NotContains(t, listed, id, "abandoned %s gone after its new delete", id)
		assertNoProcess(t, qemuOf[id])
	}

	// Everything else goes, on every host.
	var rest []*flight
	for h, e := range hosts {
		for _, id := range ids[h] {
			if e.record(id) != nil {
				rest = append(rest, startFlight(e, id, e.startDelete(id, 1)))
			}
		}
	}
	t.Logf("final deletes (%d over 3 hosts): median %s", len(rest), median(landAll(t, rest)))
	for _, e := range hosts {
		e.assertNothingLeft()
	}
}

// lsInstance is what the test reads of `vmflow-hostagent ls -o json`.
type lsInstance struct {
	ID      string       `json:"id"`
	State   string       `json:"state"`
	Process *proc.Status `json:"process"`
}

// flight is one workflow on its way, timed from its start.
type flight struct {
	e     *env
	id    string
	run   client.WorkflowRun
	begin time.Time
}

func startFlight(e *env, id string, run client.WorkflowRun) *flight {
	return &flight{e: e, id: id, run: run, begin: time.Now()}
}

// landAll waits for every flight's result (2 minutes at most) and returns
// how long each took from its start; t fails on any error.
func landAll(t *testing.T, fs []*flight) []time.Duration {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	took := make([]time.Duration, len(fs))
	errs := make([]error, len(fs))
	var wg sync.WaitGroup
	for i, f := range fs {
		wg.Go(func() {
			errs[i] = f.run.Get(ctx, nil)
			took[i] = time.Since(f.begin)
		})
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "%s on host %s", fs[i].id, fs[i].e.hostID)
	}
	return took
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2].Round(time.Millisecond)
}
