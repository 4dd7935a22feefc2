package bench

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"

	"vmflow/daemon/agent"
	"vmflow/hostagent/gpu/vgpusim"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
	"vmflow/workflows"
)

// namespaceAPSLimit is a Temporal Cloud namespace's default actions per
// second.
const namespaceAPSLimit = 500

// actionCount is one measurement: billed actions counted from histories
// (devserver.BilledActions) and the server's own `action` counter.
type actionCount struct {
	history int
	server  float64
}

// settled reads the server's action counter once two reads 2 s apart agree
// (it is exported on a reporting interval, behind the calls).
func (s *stack) settled(ctx context.Context) (map[string]float64, error) {
	var prev map[string]float64
	for {
		cur, err := s.dev.Actions(ctx, s.srv.Namespace())
		if err != nil {
			return nil, err
		}
		if prev != nil && maps.Equal(prev, cur) {
			return cur, nil
		}
		prev = cur
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("action counter never held still: %w", ctx.Err())
		case <-time.After(2 * time.Second):
		}
	}
}

func serverDelta(before, after map[string]float64) float64 {
	d := 0.0
	for k, v := range after {
		d += v - before[k]
	}
	return d
}

// measure runs f and counts the actions of the workflows it names.
func (s *stack) measure(ctx context.Context, f func() ([]string, error)) (actionCount, error) {
	before, err := s.settled(ctx)
	if err != nil {
		return actionCount{}, err
	}
	ids, err := f()
	if err != nil {
		return actionCount{}, err
	}
	after, err := s.settled(ctx)
	if err != nil {
		return actionCount{}, err
	}
	n := actionCount{server: serverDelta(before, after)}
	for k, v := range after {
		if d := v - before[k]; d > 0 {
			s.t.Logf("%v: server action %s +%.0f", ids, k, d)
		}
	}
	for _, id := range ids {
		events, err := devserver.History(ctx, s.c, id, "")
		if err != nil {
			return n, err
		}
		n.history += devserver.Sum(devserver.BilledActions(events))
	}
	return n, nil
}

// idle counts the server's actions while the stack sits idle for d.
func (s *stack) idle(ctx context.Context, d time.Duration) (float64, error) {
	before, err := s.settled(ctx)
	if err != nil {
		return 0, err
	}
	select { // a measurement window, not a synchronisation
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-time.After(d):
	}
	after, err := s.settled(ctx)
	if err != nil {
		return 0, err
	}
	return serverDelta(before, after), nil
}

// setScheduleEvery sets the host's reconcile schedule to run every d, as an
// agent of another build left it.
func (s *stack) setScheduleEvery(ctx context.Context, d time.Duration) error {
	h := s.c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID(s.hostID))
	return h.Update(ctx, client.ScheduleUpdateOptions{DoUpdate: func(in client.ScheduleUpdateInput) (*client.ScheduleUpdate, error) {
		sc := in.Description.Schedule
		sc.Spec = &client.ScheduleSpec{Intervals: []client.ScheduleIntervalSpec{{Every: d}}}
		return &client.ScheduleUpdate{Schedule: &sc}, nil
	}})
}

// typedRun is a spawn and its delete as the typed client starts them.
type typedRun struct{ spawn, del func() ([]string, error) }

// typedPair is instance id's spawn (with a simulated vGPU when vgpu) on
// host ("": placed) and its delete, as the typed client starts them: with
// the search attributes set at start, as a platform API does.
func typedPair(ctx context.Context, s *stack, id, host string, vgpu bool) typedRun {
	vc := workflows.NewClient(s.c, s.queue)
	return typedRun{
		spawn: func() ([]string, error) {
			req := s.spawnReq(id, vgpu)
			req.HostId = host
			run, err := vc.StartSpawn(ctx, req)
			if err != nil {
				return nil, err
			}
			return []string{workflows.SpawnWorkflowID(id)}, run.Get(ctx, nil)
		},
		del: func() ([]string, error) {
			run, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: id, HostId: host, GracefulTimeoutSeconds: 1})
			if err != nil {
				return nil, err
			}
			return []string{workflows.DeleteWorkflowID(id)}, run.Get(ctx, nil)
		},
	}
}

// placedPair is a spawn named to s's host (id a) and one without a host
// (id b), each with its delete (the placed one's without host_id).
func placedPair(ctx context.Context, s *stack, a, b string) (named, placed typedRun) {
	return typedPair(ctx, s, a, s.hostID, false), typedPair(ctx, s, b, "", false)
}

// actionsPerHost measures what a host costs in Temporal actions, the way
// Temporal Cloud bills them, and projects it to fleets.
func actionsPerHost(t *testing.T) string {
	s := newStack(t)
	ctx := ctxFor(t, 12*time.Minute)
	tab := Table{Header: []string{"what", "billed actions, from histories", "server `action` counter"}}
	add := func(what string, n actionCount) {
		tab.Add(what, fmt.Sprint(n.history), fmt.Sprintf("%.0f", n.server))
	}
	must := func(n actionCount, err error) actionCount {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	run := func(id string, vgpu bool) func() ([]string, error) {
		return func() ([]string, error) {
			_, err := s.run(ctx, workflows.SpawnWorkflowID(id), workflows.SpawnWorkflow, s.spawnReq(id, vgpu))
			return []string{workflows.SpawnWorkflowID(id)}, err
		}
	}
	del := func(id string) func() ([]string, error) {
		return func() ([]string, error) {
			_, err := s.run(ctx, workflows.DeleteWorkflowID(id), workflows.DeleteWorkflow, s.deleteReq(id))
			return []string{workflows.DeleteWorkflowID(id)}, err
		}
	}
	spawnVGPU := must(s.measure(ctx, run("a1", true)))
	add("spawn, simulated vGPU", spawnVGPU)
	deleteVGPU := must(s.measure(ctx, del("a1")))
	add("clean delete, simulated vGPU", deleteVGPU)
	add("spawn, no vGPU", must(s.measure(ctx, run("a2", false))))
	add("clean delete, no vGPU", must(s.measure(ctx, del("a2"))))
	add("**spawn + clean delete, simulated vGPU**", actionCount{spawnVGPU.history + deleteVGPU.history, spawnVGPU.server + deleteVGPU.server})
	// The same as the platform API starts them (vmflow's typed client: the
	// search attributes set at start, which saves each workflow its first
	// upsert).
	typed := typedPair(ctx, s, "a6", s.hostID, true)
	typedSpawn := must(s.measure(ctx, typed.spawn))
	add("spawn, simulated vGPU, typed client", typedSpawn)
	typedDelete := must(s.measure(ctx, typed.del))
	add("clean delete, simulated vGPU, typed client", typedDelete)
	pair := actionCount{typedSpawn.history + typedDelete.history, typedSpawn.server + typedDelete.server}
	add("**spawn + clean delete, simulated vGPU, typed client** (goal ≤ 15 on the server's counter)", pair)

	// Placement: a spawn without a host against one named, both started
	// as the typed client starts them (search attributes at start, as a
	// platform API does). The server column includes the fleet view's
	// publishes the spawn causes (a FleetHost start each), the same for
	// both; the difference is placement's own cost.
	named, placed := placedPair(ctx, s, "a4", "a5")
	namedN, placedN := must(s.measure(ctx, named.spawn)), must(s.measure(ctx, placed.spawn))
	add("spawn, no vGPU, named host (typed client)", namedN)
	add("spawn, no vGPU, placed: no host_id (typed client)", placedN)
	add("**placed spawn − named spawn** (goal ≤ 2)", actionCount{placedN.history - namedN.history, placedN.server - namedN.server})
	namedD, placedD := must(s.measure(ctx, named.del)), must(s.measure(ctx, placed.del))
	add("**delete without host_id − delete naming it**", actionCount{placedD.history - namedD.history, placedD.server - namedD.server})

	// One failed release round: the simulator refuses the release, the
	// delete waits in release-failed, a retry finishes it.
	must(s.measure(ctx, run("a3", true)))
	failed := must(s.measure(ctx, func() ([]string, error) {
		ctl := filepath.Join(s.sim.Control, vgpusim.CtlFailRelease)
		if err := os.WriteFile(ctl, []byte("EBUSY"), 0o644); err != nil {
			return nil, err
		}
		id := workflows.DeleteWorkflowID("a3")
		run, err := s.c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: id, TaskQueue: s.queue}, workflows.DeleteWorkflow, s.deleteReq("a3"))
		if err != nil {
			return nil, err
		}
		vc := workflows.NewClient(s.c, s.queue)
		// Wait on VmStage, exact while a delete waits (a status query
		// every 100 ms would be billed: a query is an action).
		for {
			d, err := s.c.DescribeWorkflow(ctx, id, "")
			var stage string
			if err == nil {
				if p := d.RawResponse.GetWorkflowExecutionInfo().GetSearchAttributes().GetIndexedFields()[workflows.SAStage.GetName()]; p != nil {
					_ = converter.GetDefaultDataConverter().FromPayload(p, &stage)
				}
			}
			if stage == workflows.StageReleaseFailed {
				break
			}
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("%s never reached release-failed: %w", id, ctx.Err())
			case <-time.After(100 * time.Millisecond):
			}
		}
		if err := os.Remove(ctl); err != nil {
			return nil, err
		}
		if _, err := vc.Retry(ctx, id, "bench: fault cleared"); err != nil {
			return nil, err
		}
		return []string{id}, run.Get(ctx, nil)
	}))
	add("failed release round (a delete with one, minus a clean delete)", actionCount{failed.history - deleteVGPU.history, failed.server - deleteVGPU.server})

	// One reconcile run, as the agent's scan triggers it.
	sched := s.c.ScheduleClient().GetHandle(ctx, workflows.ReconcileScheduleID(s.hostID))
	reconcile := must(s.measure(ctx, func() ([]string, error) {
		if err := sched.Trigger(ctx, client.ScheduleTriggerOptions{}); err != nil {
			return nil, err
		}
		for {
			d, err := sched.Describe(ctx)
			if err != nil {
				return nil, err
			}
			if n := len(d.Info.RecentActions); n > 0 {
				res := d.Info.RecentActions[n-1].StartWorkflowResult
				r, err := s.c.DescribeWorkflow(ctx, res.WorkflowID, res.FirstExecutionRunID)
				if err == nil && r.WorkflowCloseTime != nil {
					return []string{res.WorkflowID}, nil
				}
			}
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("the triggered reconcile never finished: %w", ctx.Err())
			case <-time.After(200 * time.Millisecond):
			}
		}
	}))
	add("reconcile run (schedule action included)", reconcile)

	// Idle: after (the agent's local scan, no schedule run in the window)
	// and before (the schedule every minute, as every agent before this
	// release left it), one window each. 90 s holds one or two runs of
	// the every-minute schedule; longer windows would push make bench past
	// its 15-minute timeout.
	window := 90 * time.Second
	if quick() {
		window = 40 * time.Second
	}
	idleAfter, err := s.idle(ctx, window)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.setScheduleEvery(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	idleBefore, err := s.idle(ctx, window)
	if err != nil {
		t.Fatal(err)
	}
	perDay := func(inWindow float64) float64 { return inWindow * float64(24*time.Hour) / float64(window) }
	runsPerDay := float64(24*time.Hour) / float64(agent.DefaultReconcileEvery)
	afterDay := perDay(idleAfter) + runsPerDay*reconcile.server
	beforeDay := perDay(idleBefore)

	var out string
	out += "## What a host costs in Temporal actions\n\n"
	out += "Billed actions counted from each workflow's history by Temporal Cloud's list (workflow started, including by continue-as-new or as a child; schedule action; activity attempt; timer; signal; update; search-attribute upsert, except the SDK's exempt TemporalChangeVersion one; side effect; heartbeats, queries and rejected updates leave no event and are not in this column), beside the dev server's own `action` counter (`--metrics-port`, namespace of the test, read once it holds still; it also counts markers and the server's scheduler workflow, which Cloud does not bill as such). One host, the real worker and agent, the vGPU simulator.\n\n"
	out += tab.Markdown() + "\n"
	idle := Table{Header: []string{"idle host", "server actions in the window", "per day (window scaled, plus schedule runs)"}}
	idle.Add(fmt.Sprintf("before: reconcile Schedule every minute (%s window)", window), fmt.Sprintf("%.0f", idleBefore), fmt.Sprintf("%.0f", beforeDay))
	idle.Add(fmt.Sprintf("after: local scan every minute, Schedule every %s (%s window, plus %.0f run/day × %.0f)", agent.DefaultReconcileEvery, window, runsPerDay, reconcile.server),
		fmt.Sprintf("%.0f", idleAfter), fmt.Sprintf("%.0f", afterDay))
	out += idle.Markdown() + "\n"
	fleet := Table{Header: []string{"idle fleet", "actions per day", fmt.Sprintf("steady actions per second (namespace default limit %d)", namespaceAPSLimit)}}
	for _, hosts := range []int{1000, 10000} {
		for _, v := range []struct {
			name string
			day  float64
		}{{"before", beforeDay}, {"after", afterDay}} {
			day := v.day * float64(hosts)
			fleet.Add(fmt.Sprintf("%d hosts, %s", hosts, v.name), fmt.Sprintf("%.0f", day), fmt.Sprintf("%.2f", day/86400))
		}
	}
	out += fleet.Markdown() + "\n"
	goal := "met"
	if pair.server > 15 {
		goal = "missed"
	}
	out += fmt.Sprintf("- **Target: a spawn with a vGPU and its clean delete, started as the platform API starts them (the typed client), cost at most 15 actions by the server's own counter: %s** — %.0f (%d billed from the histories); started without search attributes (a bare `ExecuteWorkflow`, the rows above it) %.0f: each workflow then pays one more upsert to set them. Before the combined activities (BENCHMARKS.md of 2026-12-06 06:55, bare starts): 23, 17 billed. In the counter beside the workflows' own: the agent's fleet-view publishes, one `FleetHost` start per change of its offer (the spawn's and the delete's), and the activities' heartbeats (none now: the first beat is one interval in).\n",
		goal, pair.server, pair.history, spawnVGPU.server+deleteVGPU.server)
	return out
}
