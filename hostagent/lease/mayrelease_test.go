package lease_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// A record with no process and no launch marker is not proof that no QEMU
// runs. An agent older than the marker that died between the fork and the
// pid's write left such a record with its QEMU running (holding the device).
// Until a Stop has looked and written stop step gone, a release refuses with
// ErrVMAlive, unless the instance never launched at all (a spawn that failed
// before its launch: no start or exit recorded, no socket or pidfile on
// disk).
func TestReleaseWithoutProcessNeedsStopOrNoLaunch(t *testing.T) {
	for _, tc := range []struct {
		name     string
		setup    func(t *testing.T, e *claimsEnv, r *vmflowv1.InstanceRecord)
		released bool
	}{
		{"older agent died between fork and pid: the socket is there", func(t *testing.T, e *claimsEnv, r *vmflowv1.InstanceRecord) {
			p, err := e.st.Paths(r.GetId())
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(p.Socket, nil, 0o600))
		}, false},
		{"a restart's fork, same death: a start was recorded", func(t *testing.T, e *claimsEnv, r *vmflowv1.InstanceRecord) {
			r.LastStart = timestamppb.New(time.Now().Add(-time.Hour))
			r.LastExit = timestamppb.New(time.Now().Add(-time.Minute))
		}, false},
		{"only the pidfile", func(t *testing.T, e *claimsEnv, r *vmflowv1.InstanceRecord) {
			p, err := e.st.Paths(r.GetId())
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(p.PID, []byte("4242\n"), 0o600))
		}, false},
		{"never launched (spawn failed before its launch)", func(*testing.T, *claimsEnv, *vmflowv1.InstanceRecord) {}, true},
		{"a Stop looked and wrote gone", func(t *testing.T, e *claimsEnv, r *vmflowv1.InstanceRecord) {
			p, err := e.st.Paths(r.GetId())
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(p.Socket, nil, 0o600))
			r.LastStart = timestamppb.New(time.Now().Add(-time.Hour))
			r.StopStep, r.StopStepAt = vmflowv1.StopStep_STOP_STEP_GONE, timestamppb.Now()
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newClaims(t, vgpusim.Options{MdevParents: 1})
			ctx := context.Background()
			e.record(t, "vm1")
			_, err := claimOne(ctx, e.claims, "vm1", profile)
			require.NoError(t, err)
			_, err = e.st.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
				tc.setup(t, e, r)
				return nil
			})
			require.NoError(t, err)
			e.beginDelete(t, "vm1")

			released, _, err := e.claims.Release(ctx, "vm1")
			if !tc.released {
				require.ErrorIs(t, err, lease.ErrVMAlive)
				assert.False(t, released)
				assert.Len(t, e.devices(t), 1, "the device stays while an unrecorded QEMU may hold it")
				rec, err := e.st.Get("vm1")
				require.NoError(t, err)
				assert.True(t, store.VGPU(rec).GetReleasedAt() == nil, "the claim is still held")
				return
			}
			require.NoError(t, err)
			assert.True(t, released)
			assert.Empty(t, e.devices(t))
		})
	}
}
