package workflows

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The typed client refuses what the workflows or the host would refuse,
// before anything reaches Temporal (no server: the client is never used).
// An empty host_id is not refused: the fleet places a spawn, a delete
// finds the instance's host.
func TestClientRejectsBadDeleteInput(t *testing.T) {
	vc := NewClient(nil, DefaultTaskQueue)
	ctx := context.Background()
	for _, req := range []*vmflowv1.DeleteRequest{
		{InstanceId: "../etc", HostId: "h1"},
		{InstanceId: "vm1", HostId: "h1/../h2"},
		{InstanceId: "VM1", HostId: "h1"},
		{InstanceId: "", HostId: ""},
		{InstanceId: "vm1", HostId: "-h1"},
	} {
		_, err := vc.StartDelete(ctx, req)
		assert.ErrorIs(t, err, ErrInvalidID, "%v", req)
	}
	_, err := vc.StartDelete(ctx, &vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1", GracefulTimeoutSeconds: MaxGracefulTimeoutSeconds + 1})
	assert.ErrorIs(t, err, ErrInvalidInput)
	_, err = vc.StartSpawn(ctx, &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "x_y"})
	assert.ErrorIs(t, err, ErrInvalidID)
}
