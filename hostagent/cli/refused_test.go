package cli_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestLsShowRestartRefused: a restart the host's admission policy refused
// (needs_attention in the record, as supervise writes it) is a
// needs-attention reason in ls and show, with how long ago, and show has
// the last error. Fails before the record field is read.
func TestLsShowRestartRefused(t *testing.T) {
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	ctx := context.Background()
	_, err = st.Create(ctx, &vmflowv1.InstanceRecord{Id: "vm1", Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: "kvm"}})
	require.NoError(t, err)
	const why = "prepare launch: instance vm1 refused by this host's admission policy: memory_mib: 64 exceeds this host's 32 MiB"
	_, err = st.Update(ctx, "vm1", func(r *vmflowv1.InstanceRecord) error {
		r.LastError = why
		r.NeedsAttention = "restart refused: " + why
		r.NeedsAttentionAt = timestamppb.New(time.Now().Add(-3 * time.Minute))
		return nil
	})
	require.NoError(t, err)

	r := lsJSON(t, dir)["vm1"]
	assertAttention(t, r, "restart refused: ", "memory_mib: 64 exceeds", "(3m ago)")

	code, out, stderr := runShow(t, "--state-dir", dir, "vm1")
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, "last error       "+why)
	assert.Contains(t, out, "needs attention  yes")
	assert.Contains(t, out, "- restart refused: "+why)
}
