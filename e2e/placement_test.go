package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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
	"google.golang.org/protobuf/encoding/protojson"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm/vmmtest"
	"vmflow/platform/fleet"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
	"vmflow/workflows"
)

// fleetHostArgs gives every host of the placement test exactly
// slotsPerHost one-vCPU slots (2 CPUs here × 5), memory no bound (a TCG
// VM holds 1.4 GiB), and a fleet view that follows changes within a
// second.
const slotsPerHost = 10

var fleetHostArgs = []string{"--cpu-overcommit", "5", "--memory-overcommit", "64",
	"--fleet-check-every", "1s", "--fleet-publish-debounce", "200ms"}

// placedFleet is three hosts of one stack: mdev vGPUs on the first,
// vendor-VFIO vGPUs on the second, whole GPUs on the third.
type placedFleet struct {
	t     *testing.T
	hosts []*env
	ops   *workflows.Client
}

func newPlacedFleet(t *testing.T) *placedFleet {
	host := func(share *env, sim func(*vgpusim.Options), args ...string) *env {
		return newEnv(t, envOptions{shareWith: share, sim: sim, agentArgs: append(slices.Clone(fleetHostArgs), args...)})
	}
	f := &placedFleet{t: t}
	t.Cleanup(f.retireViews) // after the agents stop: none publishes again
	mdev := host(nil, func(o *vgpusim.Options) { *o = vgpusim.Options{MdevParents: 1} }, "--vgpu-driver", "mdev")
	vendor := host(mdev, func(o *vgpusim.Options) { *o = vgpusim.Options{VendorVFs: 2} }, "--vgpu-driver", "vendor")
	whole := host(mdev, func(o *vgpusim.Options) { *o = vgpusim.Options{PCIGPUs: 2} }, "--vgpu-driver", "none", "--gpu-passthrough", "all")
	f.hosts, f.ops = []*env{mdev, vendor, whole}, workflows.NewClient(mdev.c, mdev.queue)
	return f
}

// retireViews ends the hosts' FleetHost workflows on the shared server.
func (f *placedFleet) retireViews() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, e := range f.hosts {
		_ = e.c.TerminateWorkflow(ctx, workflows.FleetHostWorkflowID(e.hostID), "", "e2e test over")
	}
}

func (f *placedFleet) byID(id string) *env {
	for _, e := range f.hosts {
		if e.hostID == id {
			return e
		}
	}
	f.t.Fatalf("no host %q in the fleet", id)
	return nil
}

// views is the fleet view by host id.
func (f *placedFleet) views() map[string]*vmflowv1.HostView {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	vs, err := fleet.Read(ctx, f.hosts[0].c, f.hosts[0].queue)
	require.NoError(f.t, err)
	m := map[string]*vmflowv1.HostView{}
	for _, v := range vs {
		m[v.GetHostId()] = v
	}
	return m
}

// waitViews waits until every host's published view satisfies ok.
func (f *placedFleet) waitViews(what string, ok func(e *env, v *vmflowv1.HostView) bool) {
	f.t.Helper()
	waitFor(f.t, time.Minute, what, func() (bool, string) {
		vs := f.views()
		for _, e := range f.hosts {
			v := vs[e.hostID]
			if v == nil || !ok(e, v) {
				return false, fmt.Sprintf("%s: %v", e.hostID, v)
			}
		}
		return true, ""
	})
}

// req is a placed spawn: no host_id.
func placedSpawn(id string) *vmflowv1.SpawnRequest {
	return &vmflowv1.SpawnRequest{InstanceId: id, Vcpus: 1, MemoryMib: 128, Machine: "none", Accel: string(vmmtest.Accel())}
}

func (f *placedFleet) start(req *vmflowv1.SpawnRequest) client.WorkflowRun {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	run, err := f.ops.StartSpawn(ctx, req)
	require.NoError(f.t, err)
	return run
}

// spawnAll starts reqs at once and returns each one's result or error.
func (f *placedFleet) spawnAll(reqs []*vmflowv1.SpawnRequest) ([]*vmflowv1.SpawnResult, []error) {
	runs := make([]client.WorkflowRun, len(reqs))
	for i, r := range reqs {
		runs[i] = f.start(r)
	}
	res, errs := make([]*vmflowv1.SpawnResult, len(reqs)), make([]error, len(reqs))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for i, run := range runs {
		wg.Go(func() {
			var out vmflowv1.SpawnResult
			if errs[i] = run.Get(ctx, &out); errs[i] == nil {
				res[i] = &out
			}
		})
	}
	wg.Wait()
	return res, errs
}

// deleteAll deletes ids without naming their hosts and waits.
func (f *placedFleet) deleteAll(ids ...string) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var runs []client.WorkflowRun
	for _, id := range ids {
		run, err := f.ops.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: id, GracefulTimeoutSeconds: 1})
		require.NoError(f.t, err)
		runs = append(runs, run)
	}
	for i, run := range runs {
		var res vmflowv1.DeleteResult
		require.NoError(f.t, run.Get(ctx, &res), ids[i])
		assert.False(f.t, res.GetAlreadyAbsent(), "%s: the delete found its host", ids[i])
	}
}

// place runs `vmflow place` for req and returns its answer.
func (f *placedFleet) place(req *vmflowv1.SpawnRequest) *vmflowv1.ChooseHostsResult {
	f.t.Helper()
	in, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(req)
	require.NoError(f.t, err)
	e := f.hosts[0]
	var out, errOut bytes.Buffer
	code := fleet.Main(context.Background(), []string{"place", "--address", e.srv.Address(), "--namespace", e.srv.Namespace(),
		"--task-queue", e.queue, "-o", "json", "--input", string(in)}, &out, &errOut)
	require.Contains(f.t, []int{0, 3}, code, errOut.String())
	var res vmflowv1.ChooseHostsResult
	require.NoError(f.t, protojson.Unmarshal(out.Bytes(), &res), out.String())
	return &res
}

// records is every host's records by host id, and checks the fleet's
// invariants: an instance in one host's records only, no device named by
// two held leases, no host holding more vCPUs than its slots.
func (f *placedFleet) records() map[string][]*vmflowv1.InstanceRecord {
	f.t.Helper()
	out := map[string][]*vmflowv1.InstanceRecord{}
	where := map[string]string{}
	devices := map[string]string{}
	for _, e := range f.hosts {
		recs, err := e.st.List()
		require.NoError(f.t, err)
		out[e.hostID] = recs
		var vcpus uint32
		for _, r := range recs {
			if other, dup := where[r.GetId()]; dup {
				f.t.Errorf("instance %s has records on %s and %s", r.GetId(), other, e.hostID)
			}
			where[r.GetId()] = e.hostID
			if c := store.Capacity(r); store.LeaseHeld(c) {
				vcpus += c.GetCapacity().GetVcpus()
			}
			for _, l := range store.HeldLeases(r) {
				if store.LeaseKind(l) == store.KindCapacity {
					continue
				}
				key := e.hostID + "/" + store.LeaseName(l)
				if other, dup := devices[key]; dup {
					f.t.Errorf("%s is held by %s and %s", key, other, r.GetId())
				}
				devices[key] = r.GetId()
			}
		}
		assert.LessOrEqual(f.t, vcpus, uint32(slotsPerHost), "%s promises no more than its slots", e.hostID)
	}
	return out
}

func ids(recs []*vmflowv1.InstanceRecord) []string {
	var out []string
	for _, r := range recs {
		out = append(out, r.GetId())
	}
	return out
}

// TestFleetPlacement (issue 35): three agents on the simulator, spawns
// without a host:
//   - each GPU kind (an mdev profile, a vendor-VFIO profile, a whole
//     GPU's model) lands on the one host that has it, where `vmflow
//     place` said it would, and deletes without a host find it;
//   - 30 concurrent spawns into exactly 30 slots are all placed, every
//     host's records hold each instance once, no device in two records,
//     no host past its slots; the 31st fails NoFleetCapacity naming what
//     it asked and the fleet's best;
//   - a drained host gets none (and refuses a spawn named to it);
//   - an agent killed -9 with room in its view: the spawns placed then
//     pass it over (its grant not picked up within 5 s) and land on
//     another host.
//
// Scaled down: machine "none" VMs, 10 one-vCPU slots a host (the issue's
// NUMA nodes wait for the topology work).
func TestFleetPlacement(t *testing.T) {
	timeTest(t)
	f := newPlacedFleet(t)
	mdev, vendor, whole := f.hosts[0], f.hosts[1], f.hosts[2]
	tag := suffix(t)
	f.waitViews("every host's first view", func(e *env, v *vmflowv1.HostView) bool {
		return v.GetVcpusFree() == slotsPerHost && len(v.GetGpus()) > 0
	})

	// 1. Each GPU kind where it is, as `vmflow place` says.
	gpuReqs := map[*env]*vmflowv1.SpawnRequest{}
	for e, mutate := range map[*env]func(*vmflowv1.SpawnRequest){
		mdev:   func(r *vmflowv1.SpawnRequest) { r.VgpuProfile = "GRID A100-4C" },
		vendor: func(r *vmflowv1.SpawnRequest) { r.VgpuProfile = "NVIDIA L40-4Q" },
		whole:  func(r *vmflowv1.SpawnRequest) { r.GpuPassthroughCount, r.GpuPassthroughModel = 1, "10de:2335" },
	} {
		r := placedSpawn("e2e-pg-" + tag + "-" + e.hostID[len(e.hostID)-6:])
		mutate(r)
		gpuReqs[e] = r
		said := f.place(r)
		require.NotEmpty(t, said.GetCandidates(), "place: %v", said)
		assert.Equal(t, e.hostID, said.GetCandidates()[0].GetHostId(), "vmflow place for %s", r.GetInstanceId())
		assert.Len(t, said.GetAll(), 3, "place scores every host")
	}
	var reqs []*vmflowv1.SpawnRequest
	for _, r := range gpuReqs {
		reqs = append(reqs, r)
	}
	res, errs := f.spawnAll(reqs)
	for i, r := range reqs {
		require.NoError(t, errs[i], r.GetInstanceId())
		e := f.byID(res[i].GetHostId())
		assert.Equal(t, gpuReqs[e], r, "%s landed on %s, the host of its kind", r.GetInstanceId(), e.hostID)
		assert.NotEmpty(t, res[i].GetGpuDeviceIds(), r.GetInstanceId())
		assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RUNNING, e.record(r.GetInstanceId()).GetState())
	}
	f.records()
	var gpuIDs []string
	for _, r := range reqs {
		gpuIDs = append(gpuIDs, r.GetInstanceId())
	}
	f.deleteAll(gpuIDs...)
	for _, e := range f.hosts {
		assert.Empty(t, ids(f.records()[e.hostID]), "%s: the deletes found their hosts", e.hostID)
	}
	f.waitViews("the GPUs back in every view", func(e *env, v *vmflowv1.HostView) bool {
		return v.GetVcpusFree() == slotsPerHost && v.GetInFlight() == 0
	})

	// 2. 30 spawns at once into exactly 30 slots.
	var burst []*vmflowv1.SpawnRequest
	for i := range 3 * slotsPerHost {
		burst = append(burst, placedSpawn(fmt.Sprintf("e2e-pb-%s-%02d", tag, i)))
	}
	began := time.Now()
	res, errs = f.spawnAll(burst)
	t.Logf("30 placed spawns into 30 slots: %s", time.Since(began).Round(100*time.Millisecond))
	landed := map[string][]string{}
	for i, r := range burst {
		if assert.NoError(t, errs[i], r.GetInstanceId()) {
			landed[res[i].GetHostId()] = append(landed[res[i].GetHostId()], r.GetInstanceId())
		}
	}
	recs := f.records()
	for _, e := range f.hosts {
		assert.Len(t, landed[e.hostID], slotsPerHost, "%s is filled exactly", e.hostID)
		assert.ElementsMatch(t, landed[e.hostID], ids(recs[e.hostID]), "%s: the results name the hosts holding the records", e.hostID)
	}
	f.waitViews("a full fleet", func(_ *env, v *vmflowv1.HostView) bool { return v.GetVcpusFree() == 0 })
	_, errs = f.spawnAll([]*vmflowv1.SpawnRequest{placedSpawn("e2e-pb-" + tag + "-31")})
	var ae *temporal.ApplicationError
	require.ErrorAs(t, errs[0], &ae)
	assert.Equal(t, workflows.ErrTypeNoFleetCapacity, ae.Type())
	assert.Contains(t, ae.Message(), "1 vCPUs and 128 MiB")
	assert.Contains(t, ae.Message(), "no host has them; e2e-h-", "names the fleet's best")
	assert.Contains(t, ae.Message(), "has 0 vCPUs")
	for _, e := range f.hosts {
		_, err := e.st.Get("e2e-pb-" + tag + "-31")
		assert.ErrorIs(t, err, store.ErrNotFound, "%s: the refused spawn wrote nothing", e.hostID)
	}

	// 3. A drained host gets none.
	out := whole.hostagentCLI("drain", "--state-dir", whole.stateDir, "--reason", "e2e: rack work")
	assert.Contains(t, out, "draining since")
	f.deleteAll(landed[mdev.hostID][:2]...)
	f.deleteAll(landed[vendor.hostID][:2]...)
	f.deleteAll(landed[whole.hostID][:2]...)
	f.waitViews("the drain and the freed slots in the view", func(e *env, v *vmflowv1.HostView) bool {
		return v.GetVcpusFree() == 2 && v.GetDraining() == (e == whole)
	})
	var after []*vmflowv1.SpawnRequest
	for i := range 5 {
		after = append(after, placedSpawn(fmt.Sprintf("e2e-pd-%s-%d", tag, i)))
	}
	res, errs = f.spawnAll(after)
	placed, refused := 0, 0
	for i, r := range after {
		switch {
		case errs[i] == nil:
			placed++
			assert.NotEqual(t, whole.hostID, res[i].GetHostId(), "%s on the drained host", r.GetInstanceId())
		case errors.As(errs[i], &ae) && ae.Type() == workflows.ErrTypeNoFleetCapacity:
			refused++
		default:
			t.Errorf("%s: %v", r.GetInstanceId(), errs[i])
		}
	}
	assert.Equal(t, 4, placed, "the two undrained hosts' four free slots")
	assert.Equal(t, 1, refused, "the drained host's two free slots are not given")
	named := placedSpawn("e2e-pn-" + tag)
	named.HostId = whole.hostID
	_, errs = f.spawnAll([]*vmflowv1.SpawnRequest{named})
	require.ErrorAs(t, errs[0], &ae)
	assert.Contains(t, errs[0].Error(), workflows.ErrTypeHostDraining, "a spawn named to the drained host is refused")

	// 4. An agent killed with room in its view: its spawns go elsewhere.
	f.deleteAll(landed[vendor.hostID][2:6]...)
	f.deleteAll(landed[mdev.hostID][2:4]...)
	f.waitViews("room on the first two hosts", func(e *env, v *vmflowv1.HostView) bool {
		want := map[*env]uint32{mdev: 2, vendor: 4, whole: 2}[e]
		return v.GetVcpusFree() == want
	})
	vendor.agent.Kill(t)
	killedAt := time.Now()
	var late []*vmflowv1.SpawnRequest
	for i := range 2 {
		late = append(late, placedSpawn(fmt.Sprintf("e2e-pk-%s-%d", tag, i)))
	}
	res, errs = f.spawnAll(late)
	took := time.Since(killedAt)
	for i, r := range late {
		require.NoError(t, errs[i], r.GetInstanceId())
		assert.Equal(t, mdev.hostID, res[i].GetHostId(), "%s passed the killed host over", r.GetInstanceId())
		st, err := mdev.status(workflows.SpawnWorkflowID(r.GetInstanceId()))
		require.NoError(t, err)
		// The server lists a killed agent's poller for minutes, so the
		// view ranks it first (the most room) and the grant times out;
		// a host without a poller is not asked at all.
		for _, tried := range st.GetHostsTried() {
			if strings.HasPrefix(tried, vendor.hostID+":") {
				assert.True(t, strings.HasPrefix(tried, vendor.hostID+": did not pick up within 5s"), tried)
			}
		}
		t.Logf("%s: hosts tried %v", r.GetInstanceId(), st.GetHostsTried())
	}
	assert.Less(t, took, 30*time.Second, "no spawn waits on the killed host beyond its grant's pickup timeout")
	t.Logf("spawns placed past a killed agent in %s", took.Round(100*time.Millisecond))
	vendor.agent.Start(t)

	// Every instance deleted without naming its host, the restarted one's
	// too: nothing is left on any host.
	var left []string
	for _, recs := range f.records() {
		left = append(left, ids(recs)...)
	}
	f.deleteAll(left...)
	for host, recs := range f.records() {
		assert.Empty(t, ids(recs), "%s after every delete", host)
	}
}

// TestFleetViewHandoverOnBackends: a host's FleetHost run ended by its
// next publish (its replacement not yet visible) still offers the host,
// and one ended longer than fleet.HandoverGrace ago does not, on both
// backends: the read's query (running, or closed after a time) is
// visibility SQL that SQLite and PostgreSQL each answer.
func TestFleetViewHandoverOnBackends(t *testing.T) {
	onBackends(t, func(t *testing.T, srv devserver.Temporal) {
		c := srv.Client(t)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		queue, host := "handover-"+suffix(t), "e2e-hv-"+suffix(t)
		v := &vmflowv1.HostView{HostId: host, PublishedAt: time.Now().UTC().Format(time.RFC3339Nano), VcpusTotal: 4, VcpusFree: 4}
		require.NoError(t, fleet.Publish(ctx, c, queue, v))
		hosts := func(at time.Time) []string {
			vs, err := fleet.ReadAt(ctx, c, queue, at)
			require.NoError(t, err)
			var ids []string
			for _, v := range vs {
				ids = append(ids, v.GetHostId())
			}
			return ids
		}
		waitFor(t, 30*time.Second, "the view", func() (bool, string) {
			ids := hosts(time.Now())
			return slices.Equal(ids, []string{host}), fmt.Sprint(ids)
		})
		require.NoError(t, c.TerminateWorkflow(ctx, workflows.FleetHostWorkflowID(host), "", "a publish under way"))
		waitFor(t, 30*time.Second, "the run's end in visibility", func() (bool, string) {
			n, err := c.CountWorkflow(ctx, &workflowservice.CountWorkflowExecutionsRequest{
				Query: "WorkflowId = '" + workflows.FleetHostWorkflowID(host) + "' AND ExecutionStatus = 'Terminated'"})
			return err == nil && n.GetCount() == 1, fmt.Sprint(n, err)
		})
		assert.Equal(t, []string{host}, hosts(time.Now()), "the ended run stands for its host")
		assert.Empty(t, hosts(time.Now().Add(fleet.HandoverGrace+time.Second)), "past the grace: a retired host")
	})
}
