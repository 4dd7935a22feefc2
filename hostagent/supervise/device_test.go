package supervise

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// A restart that cannot get its vGPU back (the device is missing and
// cannot be re-created) sets needs_attention in the record, so ls, show and
// a delete's status show it, and counts in the agent's metric; the policy
// keeps trying, rather than failing forever with nothing but a log line.
func TestRestartWithoutDeviceNeedsAttention(t *testing.T) {
	e := uidEnv(t)
	e.create("vm1", "always", 0)
	_, err := e.st.Transition(ctxT(t, 5*time.Second), "vm1", stateRunning)
	require.NoError(t, err)
	_, err = e.st.Update(ctxT(t, 5*time.Second), "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.State = stateExited
		r.LastExit, r.LastExitBoot = timestamppb.Now(), store.BootMomentNow()
		r.LastExitStatus, r.LastExitCode = "unknown (not the agent's child)", -1
		return nil
	})
	require.NoError(t, err)
	var missing atomic.Int32
	sup := e.newSupervisor(func(c *Config) {
		c.RestartBackoff, c.RestartBackoffMax = 10*time.Millisecond, 10*time.Millisecond
		c.PrepareLaunch = func(context.Context, *store.Locked, *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
			return vmm.VMSpec{}, fmt.Errorf("instance vm1: vGPU %q device %s: %w: no capacity", "GRID A100-40C",
				"6c2b0cd4-6f5e-4c3e-9b5e-1c0e6c2b0cd4", lease.ErrClaimDeviceMissing)
		}
		c.OnRestartDeviceMissing = func() { missing.Add(1) }
	})
	_, err = sup.Start(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return missing.Load() >= 2 }, 10*time.Second, 5*time.Millisecond,
		"counted, and retried")
	rec := e.get("vm1")
	assert.Contains(t, rec.GetNeedsAttention(), "restart cannot get its vGPU")
	assert.Contains(t, rec.GetNeedsAttention(), "6c2b0cd4-6f5e-4c3e-9b5e-1c0e6c2b0cd4")
	assert.NotNil(t, rec.GetNeedsAttentionAt())
	assert.Nil(t, rec.GetProcess())
	require.NoError(t, sup.Close())
}
