package workflows

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/mock"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/activity"
	sdklog "go.temporal.io/sdk/log"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/testsuite"
	"go.temporal.io/sdk/workflow"
	"pgregory.net/rapid"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// A model of placement: rapid draws a fleet (hosts with room or none,
// draining, down, one whose agent takes a grant and is not heard from
// again: a lost grant, one that goes away right after granting: host
// gone) and the views each read of the fleet view returns (a stale one
// shows room a host no longer has, or hides room it has, or lists a host
// whose agent is down); the SDK's test environment runs the real
// SpawnInstance without a host against fake hosts that grant exactly
// what they have. After the spawn ends:
//
//   - no host holds more than its room (the hosts decide, whatever the
//     view said), and no host is asked twice by one placement;
//   - a spawn that succeeded runs on a host that granted it, which the
//     result and the status name;
//   - every record this spawn may have written on a host it did not end
//     on (a lost grant; a host gone after granting) has a clean-up of
//     only this spawn's record started on that host;
//   - a spawn that no host granted failed NoFleetCapacity (not
//     retryable), naming what it asked, after at most 3 reads of the
//     view, every host asked listed in the status;
//   - a host that does not pick up is passed over after its own short
//     wait, never the named host's minutes.

type modelFleetHost struct {
	room     int  // free one-vCPU slots
	draining bool // refuses grants
	down     bool // never picks up
	lose     bool // takes the grant, writes the record, the answer is lost
	gone     bool // grants, then never picks up again
}

type placeScenario struct {
	hosts map[string]*modelFleetHost
	// views[i] is what read i of the view believes: each host's room (a
	// stale view differs from the truth), and whether its poller shows.
	views []map[string]modelView
}

type modelView struct {
	room  int
	shown bool
}

var placeScenarios = rapid.Custom(func(t *rapid.T) placeScenario {
	sc := placeScenario{hosts: map[string]*modelFleetHost{}}
	n := rapid.IntRange(1, 5).Draw(t, "hosts")
	for i := range n {
		h := &modelFleetHost{room: rapid.IntRange(0, 2).Draw(t, "room")}
		switch rapid.IntRange(0, 9).Draw(t, "trouble") {
		case 0:
			h.draining = true
		case 1:
			h.down = true
		case 2:
			h.lose = true
		case 3:
			h.gone = true
		}
		sc.hosts[fmt.Sprintf("h%d", i)] = h
	}
	for range 3 {
		v := map[string]modelView{}
		for id, h := range sc.hosts {
			room := h.room
			if rapid.IntRange(0, 3).Draw(t, "stale") == 0 {
				room = rapid.IntRange(0, 2).Draw(t, "stale_room") // the view is stale
			}
			v[id] = modelView{room: room, shown: !h.down || rapid.Bool().Draw(t, "poller_lingers")}
		}
		sc.views = append(sc.views, v)
	}
	return sc
})

// fakeFleet answers a placing spawn's activities as its hosts would.
type fakeFleet struct {
	mu       sync.Mutex
	sc       placeScenario
	reads    int
	asked    []string            // grants, in order
	written  map[string]bool     // hosts holding a record of this spawn
	granted  map[string]bool     // hosts that answered a grant with yes
	cleanups map[string]string   // workflow id → host of each clean-up started
	excludes [][]string          // each read's exclude list
	launched map[string]struct{} // hosts a launch ran on
}

func (f *fakeFleet) choose(_ context.Context, r *vmflowv1.ChooseHostsRequest) (*vmflowv1.ChooseHostsResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.excludes = append(f.excludes, slices.Clone(r.GetExclude()))
	v := f.sc.views[min(f.reads, len(f.sc.views)-1)]
	f.reads++
	res := &vmflowv1.ChooseHostsResult{Ask: "1 vCPUs and 128 MiB", HostsSeen: uint32(len(v))}
	var ids []string
	for id, hv := range v {
		if hv.room > 0 && hv.shown && !f.sc.hosts[id].draining && !slices.Contains(r.GetExclude(), id) {
			ids = append(ids, id)
		}
	}
	sort.Slice(ids, func(i, j int) bool {
		if v[ids[i]].room != v[ids[j]].room {
			return v[ids[i]].room > v[ids[j]].room
		}
		return ids[i] < ids[j]
	})
	res.HostsFit = uint32(len(ids))
	for _, id := range ids[:min(len(ids), int(r.GetK()))] {
		res.Candidates = append(res.Candidates, &vmflowv1.HostCandidate{HostId: id, Fits: true, Live: true})
	}
	if len(res.Candidates) == 0 {
		res.FleetBest = "h0 has 0 vCPUs free"
	}
	return res, nil
}

func (f *fakeFleet) create(ctx context.Context, r *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	host := strings.TrimPrefix(activity.GetInfo(ctx).TaskQueue, HostTaskQueue(""))
	if r.GetHostId() != host {
		return nil, appErr(ErrTypeInvalidInput, true) // the host admits requests for itself only
	}
	h := f.sc.hosts[host]
	if h.down {
		return nil, temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)
	}
	f.asked = append(f.asked, host)
	switch {
	case h.draining:
		return nil, appErr(ErrTypeHostDraining, false)
	case h.room == 0:
		return nil, appErr(ErrTypeNoHostCapacity, false)
	}
	h.room--
	f.written[host] = true
	if h.lose {
		return nil, temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_START_TO_CLOSE, nil)
	}
	f.granted[host] = true
	return &vmflowv1.CreateRecordResult{InstanceUuid: "u", CreatedByThisSpawn: true}, nil
}

func (f *fakeFleet) launch(ctx context.Context, _ *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	host := strings.TrimPrefix(activity.GetInfo(ctx).TaskQueue, HostTaskQueue(""))
	if f.sc.hosts[host].gone {
		return nil, temporal.NewTimeoutError(enumspb.TIMEOUT_TYPE_SCHEDULE_TO_START, nil)
	}
	f.launched[host] = struct{}{}
	return &vmflowv1.LaunchVMResult{Pid: 1}, nil
}

// TestWorkflowModelPlacement runs the placement model (see above).
func TestWorkflowModelPlacement(t *testing.T) {
	if err := setWorkflowModelChecks(); err != nil {
		t.Fatal(err)
	}
	stats := map[string]int{}
	rapid.Check(t, func(rt *rapid.T) {
		sc := placeScenarios.Draw(rt, "fleet")
		rooms := map[string]int{}
		for id, h := range sc.hosts {
			rooms[id] = h.room
		}
		f := &fakeFleet{sc: sc, written: map[string]bool{}, granted: map[string]bool{}, cleanups: map[string]string{}, launched: map[string]struct{}{}}
		var s testsuite.WorkflowTestSuite
		s.SetLogger(sdklog.NewStructuredLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
		e := &env{TestWorkflowEnvironment: s.NewTestWorkflowEnvironment(), lastSeen: map[string]any{}}
		cfg := Config{}.WithDefaults()
		New(cfg).Register(e)
		RegisterHostActivities(e, &stubHost{})
		e.RegisterActivityWithOptions(stubFleet{}.ChooseHosts, activity.RegisterOptions{Name: LocalActivityChooseHosts})
		e.OnUpsertTypedSearchAttributes(mock.Anything).Return(nil).Maybe()
		e.SetTestTimeout(20 * time.Second)
		e.OnActivity(LocalActivityChooseHosts, mock.Anything, mock.Anything).Return(f.choose)
		e.OnActivity(h.CreateRecord, mock.Anything, mock.Anything).Return(f.create)
		e.OnActivity(h.LaunchVM, mock.Anything, mock.Anything).Return(f.launch)
		e.OnWorkflow(DeleteWorkflow, mock.Anything, mock.Anything).Return(
			func(ctx workflow.Context, r *vmflowv1.DeleteRequest) (*vmflowv1.DeleteResult, error) {
				f.mu.Lock()
				defer f.mu.Unlock()
				if r.GetOnlyIfCreatedByWorkflowId() == "" || r.GetOnlyIfCreatedByRunId() == "" {
					rt.Errorf("a clean-up of %s on %s not limited to this spawn's record", r.GetInstanceId(), r.GetHostId())
				}
				f.cleanups[workflow.GetInfo(ctx).WorkflowExecution.ID] = r.GetHostId()
				return &vmflowv1.DeleteResult{}, nil
			}).Maybe()
		began := e.Now()
		e.ExecuteWorkflow(SpawnWorkflow, placedReq())
		if !e.IsWorkflowCompleted() {
			rt.Fatalf("the spawn did not end")
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		took := e.Now().Sub(began)
		v, qerr := e.QueryWorkflow(StatusQuery)
		var st vmflowv1.WorkflowStatus
		if qerr != nil || v.Get(&st) != nil {
			rt.Fatalf("status: %v", qerr)
		}
		err := e.GetWorkflowError()

		for id, h := range sc.hosts {
			if h.room < 0 {
				rt.Fatalf("%s granted past its room", id)
			}
		}
		for i, a := range f.asked {
			if slices.Contains(f.asked[:i], a) {
				rt.Fatalf("%s asked twice: %v", a, f.asked)
			}
		}
		if f.reads > placementRounds {
			rt.Fatalf("%d reads of the view", f.reads)
		}
		cleaned := map[string]bool{}
		for _, host := range f.cleanups {
			cleaned[host] = true
		}
		var res vmflowv1.SpawnResult
		end := ""
		if err == nil {
			if gerr := e.GetWorkflowResult(&res); gerr != nil {
				rt.Fatalf("result: %v", gerr)
			}
			end = res.GetHostId()
			if !f.granted[end] {
				rt.Fatalf("runs on %s, which granted nothing (granted %v)", end, f.granted)
			}
			if st.GetHostId() != end {
				rt.Fatalf("status names %q, the result %q", st.GetHostId(), end)
			}
			if _, ok := f.launched[end]; !ok {
				rt.Fatalf("no launch on %s", end)
			}
			stats["placed"]++
		}
		for host := range f.written {
			if host != end && !cleaned[host] {
				rt.Fatalf("a record of this spawn may be on %s and no clean-up was started there (cleanups %v, error %v)", host, f.cleanups, err)
			}
			if sc.hosts[host].lose && !cleaned[host] {
				rt.Fatalf("a lost grant on %s was not cleaned up", host)
			}
		}
		for id, host := range f.cleanups {
			if id != LostGrantDeleteWorkflowID("vm1", host) && id != DeleteWorkflowID("vm1") {
				rt.Fatalf("a clean-up %s", id)
			}
		}
		if err != nil {
			var ae *temporal.ApplicationError
			if !errors.As(err, &ae) {
				rt.Fatalf("failed without an application error: %v", err)
			}
			switch ae.Type() {
			case ErrTypeNoFleetCapacity:
				stats["no-fleet-capacity"]++
				if !ae.NonRetryable() || !strings.Contains(ae.Message(), "1 vCPUs and 128 MiB: no host has them") {
					rt.Fatalf("NoFleetCapacity: %v", ae)
				}
				if len(f.granted) > 0 {
					rt.Fatalf("NoFleetCapacity after %v granted", f.granted)
				}
				for _, a := range f.asked {
					if !slices.ContainsFunc(st.GetHostsTried(), func(s string) bool { return strings.HasPrefix(s, a+": ") }) {
						rt.Fatalf("%s asked but not in hosts_tried %v", a, st.GetHostsTried())
					}
				}
			case ErrTypeHostUnreachable:
				stats["host-gone"]++
				if !sc.hosts[st.GetHostId()].gone || !cleaned[st.GetHostId()] {
					rt.Fatalf("host unreachable on %s (gone %v, cleaned %v)", st.GetHostId(), sc.hosts[st.GetHostId()].gone, cleaned)
				}
			default:
				rt.Fatalf("failed %s: %v", ae.Type(), ae)
			}
		}
		// Waits: each host that did not pick up costs its pickup timeout
		// (the test clock skips it); only a host gone after its grant is
		// waited for as a named host is.
		if end != "" || len(f.granted) == 0 {
			if limit := time.Duration(len(sc.hosts)+1) * cfg.PlacementScheduleToStart; took > limit && !anyGone(sc, f.granted) {
				rt.Fatalf("placement took %s, more than its hosts' pickup timeouts (%s)", took, limit)
			}
		}
		if len(f.cleanups) > 0 {
			stats["cleaned-up"]++
		}
	})
	t.Logf("placement model: %v", stats)
}

func anyGone(sc placeScenario, granted map[string]bool) bool {
	for h := range granted {
		if sc.hosts[h].gone {
			return true
		}
	}
	return false
}
