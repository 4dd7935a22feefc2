package e2e

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"

	"vmflow/guest"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// TestSpawnBurstFillsTheHostExactly (invariant 17): 50 concurrent spawns
// into a host with room for 20 vCPUs, the agent killed -9 mid-burst and
// started again: exactly 20 run, the other 30 fail NoHostCapacity, and
// the ledger is the running VMs' records, nothing else (the failed
// spawns' clean-ups released what they held).
func TestSpawnBurstFillsTheHostExactly(t *testing.T) {
	// 2 CPUs here × 10 = 20 vCPUs; memory is no bound (TCG VMs hold
	// 1.4 GiB each).
	e := newEnv(t, envOptions{agentArgs: []string{"--cpu-overcommit", "10", "--memory-overcommit", "64"}})
	const n, room = 50, 20
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		run := e.startSpawn(e.noneSpawn(fmt.Sprintf("burst-%02d", i), false))
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = run.Get(e.ctx(5*time.Minute), nil)
		}()
	}
	waitFor(t, 2*time.Minute, "records being created", func() (bool, string) {
		recs, _ := e.st.List()
		return len(recs) >= 5, fmt.Sprintf("%d records", len(recs))
	})
	e.agent.Kill(t)
	e.agent.Start(t)
	wg.Wait()

	ran, refused := 0, 0
	for i, err := range errs {
		var ae *temporal.ApplicationError
		switch {
		case err == nil:
			ran++
		case errors.As(err, &ae) && ae.Type() == workflows.ErrTypeNoHostCapacity:
			refused++
		default:
			t.Errorf("burst-%02d: want success or %s, got %v", i, workflows.ErrTypeNoHostCapacity, err)
		}
	}
	assert.Equal(t, room, ran, "the host is filled exactly")
	assert.Equal(t, n-room, refused)

	waitFor(t, 2*time.Minute, "the failed spawns' clean-ups", func() (bool, string) {
		recs, _ := e.st.List()
		return len(recs) == ran, fmt.Sprintf("%d records, %d running", len(recs), ran)
	})
	recs, err := e.st.List()
	require.NoError(t, err)
	var vcpus uint32
	for _, rec := range recs {
		assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RUNNING, rec.GetState(), rec.GetId())
		l := store.Capacity(rec)
		if assert.NotNil(t, l, rec.GetId()) {
			assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, l.GetPhase(), rec.GetId())
			assert.Equal(t, lease.Share(rec.GetSpec()).GetMemoryMib(), l.GetCapacity().GetMemoryMib(), rec.GetId())
			vcpus += l.GetCapacity().GetVcpus()
		}
	}
	assert.EqualValues(t, room, vcpus, "the ledger is the running VMs' shares")

	// Deleted, the VMs leave the host empty: the ledger holds nothing.
	var dels []client.WorkflowRun
	for _, rec := range recs {
		dels = append(dels, e.startDelete(rec.GetId(), 0))
	}
	for _, d := range dels {
		require.NoError(t, d.Get(e.ctx(3*time.Minute), nil))
	}
	e.assertNothingLeft()
}

// TestDedicatedCPUPinsARealGuest: on this machine's CPUs (the simulator
// shows one NUMA node of two CPUs, as the machine has), with CPU 1 kept
// for dedicated VMs: a booted guest asking dedicated_cpus runs every QEMU
// thread on CPU 1, and a VM without runs on CPU 0 only, so the two never
// share a CPU; both land on node 0 (guest RAM bound there), and the
// spawn's result says where.
func TestDedicatedCPUPinsARealGuest(t *testing.T) {
	if runtime.NumCPU() < 2 {
		t.Skip("needs 2 CPUs")
	}
	e := newEnv(t, envOptions{agentArgs: []string{"--dedicated-cpus", "1"},
		sim: func(o *vgpusim.Options) { o.NUMANodes, o.NodeCPUs = 1, 2 }})
	req := e.guestSpawn("pinned", false)
	req.DedicatedCpus = true
	res := e.spawn(req)
	assert.Equal(t, "1", res.GetCpus())
	assert.Equal(t, []uint32{0}, res.GetNumaNodes())
	shared := e.spawn(e.noneSpawn("shared", false))
	assert.Equal(t, "0", shared.GetCpus(), "the dedicated pool is in no other VM's cpuset")

	for pid, want := range map[int32]string{res.GetPid(): "1", shared.GetPid(): "0"} {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		require.NoError(t, err)
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, task.Name()))
			require.NoError(t, err)
			for _, line := range strings.Split(string(b), "\n") {
				if k, v, ok := strings.Cut(line, ":"); ok && k == "Cpus_allowed_list" {
					assert.Equal(t, want, strings.TrimSpace(v), "pid %d thread %s", pid, task.Name())
				}
			}
		}
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", res.GetPid()))
	require.NoError(t, err)
	assert.Contains(t, string(cmdline), "host-nodes=0,policy=bind", "guest RAM bound to its node")
	e.openConsole("pinned").wait(t, guest.UpLine, 3*time.Minute)

	for _, id := range []string{"pinned", "shared"} {
		require.NoError(t, e.startDelete(id, 0).Get(e.ctx(3*time.Minute), nil))
	}
	e.assertNothingLeft()
}
