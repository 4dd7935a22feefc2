package bench

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmflow/workflows"
)

// all runs fn(i) for i in [0,n) concurrently and returns the wall time and
// the first error.
func all(n int, fn func(i int) error) (time.Duration, error) {
	start := time.Now()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(i)
		}()
	}
	wg.Wait()
	d := time.Since(start)
	for _, err := range errs {
		if err != nil {
			return d, err
		}
	}
	return d, nil
}

// supervising is the agent's re-attach log line.
type supervising struct {
	Msg      string `json:"msg"`
	Records  int    `json:"records"`
	Attached int    `json:"attached"`
	Took     any    `json:"took"` // zap: seconds as a number, or a duration string
}

func (s supervising) took() (time.Duration, error) {
	switch v := s.Took.(type) {
	case float64:
		return time.Duration(v * float64(time.Second)), nil
	case string:
		return time.ParseDuration(v)
	}
	return 0, fmt.Errorf("took %v (%T): unknown encoding", s.Took, s.Took)
}

type scaleRow struct {
	n                       int
	spawn, del              time.Duration
	hwmSpawn, hwmDelete     int64 // KiB
	restartToLine, reattach time.Duration
}

func scale(t *testing.T) string {
	s := newStack(t)
	var rows []scaleRow
	sizes := []int{50, 100, 200}
	if quick() {
		sizes = []int{5, 10}
	}
	for _, n := range sizes {
		r := scaleRow{n: n}
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("s%d-%d", n, i)
		}
		ctx := ctxFor(t, 5*time.Minute)
		var err error
		r.spawn, err = all(n, func(i int) error {
			_, err := s.run(ctx, workflows.SpawnWorkflowID(ids[i]), workflows.SpawnWorkflow, s.spawnReq(ids[i], false))
			return err
		})
		if err != nil {
			t.Fatalf("spawn %d: %v", n, err)
		}
		if r.hwmSpawn, err = VmHWM(s.agent.pid()); err != nil {
			t.Fatal(err)
		}

		// kill -9 the agent with n VMs running; they are re-parented to
		// this process (a child subreaper), which reaps them once deleted.
		recs, err := s.st.List()
		if err != nil {
			t.Fatalf("list records: %v", err)
		}
		if err := s.agent.signal(syscall.SIGKILL, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		for _, rec := range recs {
			if p := rec.GetProcess(); p != nil {
				adopt(int(p.GetPid()))
			}
		}
		line := s.agent.watch(func(l string) bool { return strings.Contains(l, `"msg":"supervising"`) })
		serving := s.agent.watch(func(l string) bool { return strings.Contains(l, `"serving host activities"`) })
		s.agent.start(t)
		var got seen
		select {
		case got = <-line:
		case <-time.After(60 * time.Second):
			t.Fatalf("no supervising line 60 s after the restart; log %s", s.agent.log)
		}
		r.restartToLine = got.at.Sub(s.agent.started)
		var sl supervising
		if err := json.Unmarshal([]byte(got.line), &sl); err != nil {
			t.Fatalf("decode %q: %v", got.line, err)
		}
		if sl.Attached != n {
			t.Fatalf("re-attached %d of %d: %s", sl.Attached, n, got.line)
		}
		if r.reattach, err = sl.took(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-serving:
		case <-time.After(60 * time.Second):
			t.Fatalf("agent not serving 60 s after the restart; log %s", s.agent.log)
		}

		r.del, err = all(n, func(i int) error {
			_, err := s.run(ctx, workflows.DeleteWorkflowID(ids[i]), workflows.DeleteWorkflow, s.deleteReq(ids[i]))
			return err
		})
		if err != nil {
			t.Fatalf("delete %d: %v", n, err)
		}
		if r.hwmDelete, err = VmHWM(s.agent.pid()); err != nil {
			t.Fatal(err)
		}
		left, err := s.st.List()
		if err != nil || len(left) > 0 {
			t.Fatalf("after deleting %d: %d records left (%v)", n, len(left), err)
		}
		rows = append(rows, r)
	}

	tab := Table{Header: []string{"VMs", "spawn-all s", "spawn wf/s", "delete-all s", "delete wf/s", "agent peak RSS (VmHWM) MiB: spawn / re-attach + delete", "re-attach (ReattachReport) ms", "agent exec → \"supervising\" line ms"}}
	var b strings.Builder
	b.WriteString("## 4. Scale on one host\n\n")
	b.WriteString("The stack of section 3 (its own dev server). For each size: start all `SpawnInstance` workflows at once (`-machine none`, 16 MiB, KVM) and wait for every result; read the agent's VmHWM; `kill -9` the agent with all VMs running (this process is a child subreaper and reaps the orphans, as systemd would); start it again and time the re-attach (the `supervising … attached=N` line: its `took` field, the `ReattachReport` duration, and the time from exec to that line, which adds process start-up); then start all `DeleteInstance` workflows at once (1 s graceful timeout, ignored by `-machine none`, so each delete spends ≥1 s in its ladder) and read the restarted agent's VmHWM.\n\n")
	var hundred, twoHundred *scaleRow
	for i, r := range rows {
		tab.Add(fmt.Sprint(r.n), fmt.Sprintf("%.1f", r.spawn.Seconds()), fmt.Sprintf("%.1f", float64(r.n)/r.spawn.Seconds()),
			fmt.Sprintf("%.1f", r.del.Seconds()), fmt.Sprintf("%.1f", float64(r.n)/r.del.Seconds()),
			fmt.Sprintf("%.1f / %.1f", float64(r.hwmSpawn)/1024, float64(r.hwmDelete)/1024), MS(r.reattach), MS(r.restartToLine))
		switch r.n {
		case 100:
			hundred = &rows[i]
		case 200:
			twoHundred = &rows[i]
		}
	}
	b.WriteString(tab.Markdown() + "\n")
	if hundred != nil {
		b.WriteString("- " + target("Target: 100 VMs spawned and deleted in under 30 s", hundred.spawn+hundred.del, 30*time.Second) + "\n")
	}
	if twoHundred != nil {
		b.WriteString("- " + target("Target: re-attach of 200 VMs under 500 ms (ReattachReport)", twoHundred.reattach, 500*time.Millisecond) + fmt.Sprintf(" From exec of the agent to the line: %s ms.\n", MS(twoHundred.restartToLine)))
		peak := max(twoHundred.hwmSpawn, twoHundred.hwmDelete)
		mib := float64(peak) / 1024
		if mib <= 64 {
			fmt.Fprintf(&b, "- **Target: agent RSS under 64 MiB with 200 VMs: met** — peak %.1f MiB (%.0f%% of the budget).\n", mib, 100*mib/64)
		} else {
			fmt.Fprintf(&b, "- **Target: agent RSS under 64 MiB with 200 VMs: missed** — peak %.1f MiB (%.2f× the budget).\n", mib, mib/64)
		}
	}
	return b.String()
}
