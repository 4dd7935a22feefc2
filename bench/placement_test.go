package bench

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"go.temporal.io/sdk/client"

	"vmflow/platform/fleet"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// placementRow is one step of the placement section: m spawns at once to
// named hosts (round-robin), then m without a host, over the first k
// agents (the others drained).
type placementRow struct {
	agents, m             int
	named, placed         time.Duration // wall time of all m
	namedLat, placedLat   Summary       // each spawn, start to result
	placedMin, placedMax  int           // VMs per agent, fewest and most
	placedAsked, refusals int           // grants asked; refusals among them
}

// placementOn measures placement against named spawns over the first k
// of fleet's agents for each k of steps: the rest are drained, and the
// fleet view waited for.
func placementOn(t *testing.T, stacks []*stack, steps []int, m int) []placementRow {
	s := stacks[0]
	ctx := ctxFor(t, 30*time.Minute)
	var rows []placementRow
	for _, k := range steps {
		k = min(k, len(stacks))
		for i, h := range stacks {
			var err error
			if i < k {
				_, err = h.st.Undrain(ctx)
			} else {
				_, err = h.st.Drain(ctx, "bench: out of this step", time.Now())
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		waitView(ctx, t, s, k, len(stacks))
		r := placementRow{agents: k, m: m}
		ids := func(kind string) []string {
			out := make([]string, m)
			for i := range out {
				out[i] = fmt.Sprintf("p%d-%s-%d", k, kind, i)
			}
			return out
		}
		spawnAll := func(ids []string, host func(i int) string) (time.Duration, Summary, []*vmflowv1.SpawnResult) {
			lat := make([]time.Duration, m)
			res := make([]*vmflowv1.SpawnResult, m)
			wall, err := all(m, func(i int) error {
				req := s.spawnReq(ids[i], false)
				req.HostId = host(i)
				start := time.Now()
				run, err := s.c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: workflows.SpawnWorkflowID(ids[i]), TaskQueue: s.queue, StaticSummary: "bench " + ids[i]}, workflows.SpawnWorkflow, req)
				if err != nil {
					return err
				}
				var out vmflowv1.SpawnResult
				err = run.Get(ctx, &out)
				lat[i], res[i] = time.Since(start), &out
				return err
			})
			if err != nil {
				t.Fatalf("spawn %d over %d agents: %v", m, k, err)
			}
			return wall, Summarize(lat), res
		}
		deleteAll := func(ids []string) {
			if _, err := all(m, func(i int) error {
				_, err := s.run(ctx, workflows.DeleteWorkflowID(ids[i]), workflows.DeleteWorkflow,
					&vmflowv1.DeleteRequest{InstanceId: ids[i], GracefulTimeoutSeconds: 1})
				return err
			}); err != nil {
				t.Fatalf("delete %d: %v", m, err)
			}
		}
		named := ids("n")
		r.named, r.namedLat, _ = spawnAll(named, func(i int) string { return stacks[i%k].hostID })
		deleteAll(named)
		waitView(ctx, t, s, k, len(stacks))
		placed := ids("p")
		var res []*vmflowv1.SpawnResult
		r.placed, r.placedLat, res = spawnAll(placed, func(int) string { return "" })
		per := map[string]int{}
		for _, x := range res {
			per[x.GetHostId()]++
		}
		counts := make([]int, 0, k)
		for i := range k {
			counts = append(counts, per[stacks[i].hostID])
		}
		r.placedMin, r.placedMax = slices.Min(counts), slices.Max(counts)
		for _, id := range placed {
			st, err := workflows.NewClient(s.c, s.queue).Status(ctx, workflows.SpawnWorkflowID(id))
			if err == nil {
				r.refusals += len(st.GetHostsTried())
			}
		}
		r.placedAsked = m + r.refusals
		deleteAll(placed)
		t.Logf("placement over %d agents: named %s (p50 %s p99 %s), placed %s (p50 %s p99 %s), %d to %d per agent, %d refusals",
			k, r.named.Round(time.Millisecond), MS(r.namedLat.Median), MS(r.namedLat.P99), r.placed.Round(time.Millisecond),
			MS(r.placedLat.Median), MS(r.placedLat.P99), r.placedMin, r.placedMax, r.refusals)
		rows = append(rows, r)
	}
	for _, h := range stacks {
		if _, err := h.st.Undrain(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return rows
}

// waitView waits until the fleet view lists every agent, k of them not
// draining and with every vCPU free.
func waitView(ctx context.Context, t *testing.T, s *stack, k, all int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		views, err := fleet.Read(ctx, s.c, s.queue)
		open := 0
		for _, v := range views {
			if !v.GetDraining() && v.GetVcpusFree() == v.GetVcpusTotal() {
				open++
			}
		}
		if err == nil && len(views) == all && open == k {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("fleet view: want %d of %d agents open, have %d of %d (%v)", k, all, open, len(views), err)
		}
		time.Sleep(200 * time.Millisecond) // the poll of a deadline-bounded wait
	}
}

func placementMarkdown(rows []placementRow) string {
	tab := Table{Header: []string{"agents", "spawns", "named: wf/s", "named: p50 / p99 ms", "placed: wf/s", "placed: p50 / p99 ms", "placed per agent (fewest–most)", "grants refused"}}
	for _, r := range rows {
		tab.Add(fmt.Sprint(r.agents), fmt.Sprint(r.m),
			fmt.Sprintf("%.1f", float64(r.m)/r.named.Seconds()), MS(r.namedLat.Median)+" / "+MS(r.namedLat.P99),
			fmt.Sprintf("%.1f", float64(r.m)/r.placed.Seconds()), MS(r.placedLat.Median)+" / "+MS(r.placedLat.P99),
			fmt.Sprintf("%d–%d", r.placedMin, r.placedMax), fmt.Sprintf("%d of %d", r.refusals, r.placedAsked))
	}
	return "### Placement against named hosts\n\n" +
		"Each step: the first N agents open, the others drained (`vmflow-hostagent drain`: the view says so and they grant nothing); all spawns started at once to named hosts (round-robin), then deleted; then as many without a host, placed by the workflow (the fleet view read from visibility, best-of-3, the host's grant), then deleted without `host_id`. Latency is each spawn's, start to result; throughput is spawns over the wall time of all of them.\n\n" +
		tab.Markdown()
}
