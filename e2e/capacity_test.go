package e2e

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"

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
