package supervise

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestLaunchPlacesCapacityOrStartsNothing: a launch makes the record's
// share of the host active before anything is started; a launch the
// ledger has no room for is refused with the reason recorded and no
// process, uid or marker. Fails without the capacity stage (the second VM
// starts).
func TestLaunchPlacesCapacityOrStartsNothing(t *testing.T) {
	e := newEnv(t)
	now := time.Now()
	capacity, err := lease.NewCapacity(lease.CapacityConfig{Store: e.st, CPUs: 1, MemoryMiB: 8192, MemoryReserveMiB: 1024,
		CPUOvercommit: 1, Now: func() time.Time { return now }})
	require.NoError(t, err)
	sup := e.newSupervisor(func(c *Config) { c.PlaceCapacity = capacity.Place })
	e.create("vm1", "never", 0) // before the ledger: no share of its own yet
	e.create("vm2", "never", 0)

	_, err = sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	l := store.Capacity(e.get("vm1"))
	require.NotNil(t, l, "the launch gave the record its share")
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, l.GetPhase())

	_, err = sup.Launch(ctxT(t, 30*time.Second), "vm2")
	require.ErrorIs(t, err, lease.ErrNoHostCapacity, "1 CPU × 1.0 holds one 1-vCPU VM")
	rec := e.get("vm2")
	assert.Nil(t, rec.GetProcess())
	assert.Nil(t, rec.GetLaunchStartedAt())
	assert.Zero(t, rec.GetQemuUid(), "refused before a uid was assigned")
	assert.Contains(t, rec.GetLastError(), "no host capacity")
}

// TestLaunchWaitsForASlotAndItsDeadlineStartsAtItsFork: with every start
// slot taken, a launch waits (longer than its ReadyTimeout) and then
// starts: its QMP deadline counts from its own fork, not from the queue.
// A launch whose context ends in the queue starts nothing.
func TestLaunchWaitsForASlotAndItsDeadlineStartsAtItsFork(t *testing.T) {
	e := newEnv(t)
	ready := 3 * time.Second
	sup := e.newSupervisor(func(c *Config) { c.LaunchConcurrency = 1; c.ReadyTimeout = 10 * time.Second })
	e.create("vm1", "never", 0)
	e.create("vm2", "never", 0)
	sup.cfg.ReadyTimeout = ready

	sup.starts <- struct{}{} // another start is in flight
	done := make(chan error, 1)
	go func() {
		_, err := sup.Launch(ctxT(t, 60*time.Second), "vm1")
		done <- err
	}()
	e.waitLog("vm1", "waiting for a launch slot", "")
	select {
	case err := <-done:
		t.Fatalf("the launch did not wait for its slot: %v", err)
	case <-time.After(ready + time.Second):
	}
	<-sup.starts
	require.NoError(t, <-done, "the queue's wait is not the launch's QMP deadline")
	assert.NotNil(t, e.get("vm1").GetProcess())

	sup.starts <- struct{}{}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err := sup.Launch(ctx, "vm2")
	<-sup.starts
	require.ErrorIs(t, err, context.DeadlineExceeded)
	rec := e.get("vm2")
	assert.Nil(t, rec.GetProcess(), "nothing started")
	assert.Nil(t, rec.GetLaunchStartedAt(), "a queued launch never wrote its marker")
	assert.Zero(t, rec.GetQemuUid(), "nor took a uid")
}
