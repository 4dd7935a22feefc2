package cli_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/cli"
	"vmflow/hostagent/store"
)

func runMain(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := cli.Main(context.Background(), args, cli.IO{Stdout: &stdout, Stderr: &stderr}, nil)
	return code, stdout.String(), stderr.String()
}

// TestDrainAndUndrain: drain needs a reason and writes the marker the
// ledger refuses on, flags on either side; undrain removes it and says
// when there was none.
func TestDrainAndUndrain(t *testing.T) {
	dir := t.TempDir()
	st, err := store.New(dir)
	require.NoError(t, err)

	code, _, stderr := runMain(t, "drain", "--state-dir", dir)
	assert.Equal(t, cli.ExitUsage, code)
	assert.Contains(t, stderr, "--reason is required")
	code, _, _ = runMain(t, "drain", "stray", "--state-dir", dir, "--reason", "x")
	assert.Equal(t, cli.ExitUsage, code)
	assert.NoError(t, st.RefuseWhileDraining(), "a refused drain writes nothing")

	code, out, stderr := runMain(t, "drain", "--reason", "BIOS update\x1b[2J", "--state-dir", dir)
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, "draining since")
	assert.NotContains(t, out, "\x1b", "the reason is escaped")
	err = st.RefuseWhileDraining()
	assert.ErrorIs(t, err, store.ErrDraining)
	assert.Contains(t, err.Error(), "BIOS update")

	code, out, stderr = runMain(t, "undrain", "--state-dir", dir)
	require.Equal(t, cli.ExitOK, code, stderr)
	assert.Contains(t, out, "undrained")
	assert.NoError(t, st.RefuseWhileDraining())
	code, out, _ = runMain(t, "undrain", "--state-dir", dir)
	assert.Equal(t, cli.ExitOK, code)
	assert.Contains(t, out, "not draining")

	code, _, stderr = runMain(t, "drain", "--reason", "x", "--state-dir", dir+"/nope")
	assert.Equal(t, cli.ExitError, code)
	assert.Contains(t, stderr, "state-dir")
}
