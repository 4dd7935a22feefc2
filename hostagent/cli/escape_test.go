package cli_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// forged is what a caller, QEMU or a guest can put in a record: the Temporal
// server accepts a workflow id with escape sequences over raw gRPC, and
// last_error carries QEMU's stderr. Printed raw, it retitles the terminal
// (OSC 0), clears the screen and adds a row of its own.
const forged = "spawn/x\x1b]0;owned\a\x1b[2J\nstate            running\tc1\u009b2J bidi\u202e"

// controls are the bytes and runes a terminal acts on that forged holds.
var controls = []string{"\x1b", "\a", "\u009b", "\u202e", "\r"}

func TestShowAndLsEscapeWhatOthersWrote(t *testing.T) {
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)
	ctx := context.Background()
	const id = "vm-hostile"
	_, err = st.Create(ctx, &vmflowv1.InstanceRecord{
		Id:                  id,
		Spec:                &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 128, Machine: "none"},
		CreatedByWorkflowId: forged, CreatedByRunId: forged,
	})
	require.NoError(t, err)
	require.NoError(t, st.MarkManualStop(ctx, id))
	_, err = st.Update(ctx, id, func(r *vmflowv1.InstanceRecord) error {
		r.LastError = forged
		r.LastExitStatus = forged
		r.NeedsAttention = forged
		r.Leases = []*vmflowv1.Lease{{Phase: vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, Resource: &vmflowv1.Lease_Vgpu{Vgpu: &vmflowv1.VgpuLease{
			Profile: forged, Parent: forged, TypeId: forged, Uuid: "6f9b6c1e-0000-4000-8000-000000000001"}}}}
		r.State = vmflowv1.InstanceState_INSTANCE_STATE_DELETING
		return nil
	})
	require.NoError(t, err)
	_, err = st.Apply(ctx, id, store.LeaseReleaseFailed("vgpu:6f9b6c1e-0000-4000-8000-000000000001", forged))
	require.NoError(t, err)

	for _, args := range [][]string{{"show", "-o", "table"}, {"show", "-o", "json"}, {"ls", "-o", "table"}, {"ls", "-o", "json"}} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			var code int
			var out, stderr string
			if args[0] == "show" {
				code, out, stderr = runShow(t, "--state-dir", dir, args[1], args[2], id)
			} else {
				code, out, stderr = runLs(t, "--state-dir", dir, args[1], args[2])
			}
			require.Equal(t, cli.ExitOK, code, stderr)
			for _, c := range controls {
				assert.NotContains(t, out, c, "a control character reached the terminal")
			}
			assert.NotContains(t, out, "\t", "tabwriter pads with spaces: a tab came from a field")
			switch strings.Join(args, " ") {
			case "show -o table":
				assert.Equal(t, 1, strings.Count(out, "\nstate "), "one state row, none forged:\n%s", out)
				assert.Contains(t, out, `by spawn/x\x1b]0;owned\x07\x1b[2J\nstate`, "the creator is shown, escaped")
			case "ls -o table":
				table := strings.SplitN(out, "\n", 3)
				require.Len(t, table, 3)
				assert.Empty(t, table[2], "one header and one row, none forged:\n%s", out)
			}
		})
	}
}
