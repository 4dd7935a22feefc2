package store

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/proc"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// A delete begun on a running VM without a vGPU (BeginDelete, then straight
// to DeleteRecord) must not remove the record while its QEMU lives: the
// QEMU would run with no record naming it and its uid free (invariant 11).
// The store refuses as it refuses a record holding a claim; once the
// process is gone (or the record names one of another boot) the delete goes
// through.
func TestDeleteRefusedWhileProcessMayLive(t *testing.T) {
	ctx := context.Background()
	s := newStore(t)
	mustCreate(t, s, "vm1")
	h := startHelper(t, "sleeper", s.StateDir(), "vm1")
	h.expectLine(t, "READY")
	live, err := proc.ReadIdentity(h.cmd.Process.Pid)
	require.NoError(t, err)
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.State = running
		r.Process = ProcessRecord(live)
		return nil
	})
	require.NoError(t, err)
	moveTo(t, s, "vm1", deleting)

	err = s.Delete(ctx, "vm1")
	require.ErrorIs(t, err, ErrProcessMayLive)
	assert.Contains(t, err.Error(), live.String())
	_, err = s.Get("vm1")
	require.NoError(t, err, "the record survives a refused delete")

	// An identity that cannot be checked counts as alive.
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.Process = &vmflowv1.ProcessIdentity{Pid: int32(live.PID)}
		return nil
	})
	require.NoError(t, err)
	require.ErrorIs(t, s.Delete(ctx, "vm1"), ErrProcessMayLive)

	// A launch marker without a process: a QEMU the record does not name
	// yet may run.
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.Process = nil
		r.LaunchStartedAt = timestamppb.Now()
		return nil
	})
	require.NoError(t, err)
	require.ErrorIs(t, s.Delete(ctx, "vm1"), ErrProcessMayLive)

	// A process of another boot is gone.
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.LaunchStartedAt = nil
		r.Process = ProcessRecord(proc.Identity{PID: live.PID, StartTime: live.StartTime, BootID: "00000000-0000-0000-0000-000000000000"})
		return nil
	})
	require.NoError(t, err)
	require.NoError(t, s.Delete(ctx, "vm1"))

	// And one that exited in this boot.
	mustCreate(t, s, "vm1")
	_, err = s.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.Process = ProcessRecord(live)
		return nil
	})
	require.NoError(t, err)
	moveTo(t, s, "vm1", deleting)
	require.NoError(t, h.stdin.Close())
	require.NoError(t, h.wait(t))
	require.NoError(t, s.Delete(ctx, "vm1"))
	_, err = s.Get("vm1")
	assert.ErrorIs(t, err, ErrNotFound)
}
