package activities

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// TestCreateRecordIsTheGrant: CreateRecord is the host's grant. A
// draining host refuses it HostDraining (retryable, with the reason), a
// host whose free vGPUs the granted spawns have spoken for refuses a
// placement's grant NoVGPUCapacity (a named spawn's GPUs are its claim's
// to place, as before), and neither writes a record; each grant tells
// the fleet view the offer changed, a refusal does not.
func TestCreateRecordIsTheGrant(t *testing.T) {
	h := newHost(t)
	capacity, err := lease.NewCapacity(lease.CapacityConfig{Store: h.st, CPUs: 64, MemoryMiB: 1 << 20, MemoryReserveMiB: 1024,
		Draining: h.st.RefuseWhileDraining})
	require.NoError(t, err)
	claims := h.acts.GPUs.(*lease.Claims)
	h.acts.Capacity = capacity
	h.acts.Offers = &lease.Offers{Store: h.st, Capacity: capacity, VGPU: claims}
	changes := 0
	h.acts.Changed = func() { changes++ }

	free := 0
	offers, err := h.acts.Offers.GPUs(context.Background())
	require.NoError(t, err)
	for _, o := range offers {
		if o.GetName() == "GRID A100-4C" {
			free = int(o.GetFree())
		}
	}
	require.Positive(t, free)
	placed := func(id string) *vmflowv1.SpawnRequest {
		r := spawnReq(id)
		r.PlacementGrant = true
		return r
	}
	for i := range free {
		require.NoError(t, h.run(t, h.acts.CreateRecord, placed(fmt.Sprintf("g%d", i)), nil))
	}
	assert.Equal(t, free, changes, "every grant republishes")
	err = h.run(t, h.acts.CreateRecord, placed("over"), nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeNoCapacity, ae.Type(), "every vGPU is spoken for by a granted spawn")
	_, err = h.st.Get("over")
	assert.ErrorIs(t, err, store.ErrNotFound)
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("named"), nil), "a named spawn's GPUs are its claim's to place")
	assert.Equal(t, free+1, changes)

	_, err = h.st.Drain(context.Background(), "host maintenance", time.Now())
	require.NoError(t, err)
	req := placed("drained")
	req.VgpuProfile = ""
	err = h.run(t, h.acts.CreateRecord, req, nil)
	ae = appError(t, err)
	assert.Equal(t, workflows.ErrTypeHostDraining, ae.Type())
	assert.False(t, ae.NonRetryable(), "undrain may change the answer")
	assert.Contains(t, ae.Message(), "host maintenance")
	_, err = h.st.Get("drained")
	assert.ErrorIs(t, err, store.ErrNotFound)
	assert.Equal(t, free+1, changes, "a refusal changes nothing")

	// A record that exists is returned as it is, drain or not: a retried
	// grant of a spawn granted before the drain.
	var res vmflowv1.CreateRecordResult
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("g0"), &res))
	assert.True(t, res.GetAlreadyExisted())
}
