package agent

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/internal/crashpoint"
	"vmflow/testsupport/stacktest"
)

// testMachinery is what only tests may carry, as strings(1) finds it in a
// binary: the self-SIGKILL switch (its variable and its package) and the
// FUSE vGPU simulator (its package and the FUSE library under it).
var testMachinery = []string{
	crashpoint.EnvVar,
	"vmflow/internal/crashpoint",
	"vmflow/hostagent/gpu/vgpusim",
	"github.com/hanwen/go-fuse",
}

// The production agent (make build: no build tags) holds neither the crash
// points nor the simulator; the harness's build (crashpoint.BuildTag) holds
// the crash points, which shows the search finds what it looks for. Fails
// if either is compiled in always.
func TestProductionBinaryHasNoTestMachinery(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent twice")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := t.TempDir()
	prod := filepath.Join(dir, "vmflow-hostagent")
	require.NoError(t, stacktest.Build(ctx, prod, "./hostagent", nil))
	b, err := os.ReadFile(prod)
	require.NoError(t, err)
	for _, s := range testMachinery {
		assert.False(t, bytes.Contains(b, []byte(s)), "the production agent contains %q", s)
	}

	_, tagged, err := stacktest.BuildBinaries(ctx, dir)
	require.NoError(t, err)
	b, err = os.ReadFile(tagged)
	require.NoError(t, err)
	assert.True(t, bytes.Contains(b, []byte(crashpoint.EnvVar)), "the harness's agent has crash points")
	assert.False(t, bytes.Contains(b, []byte("github.com/hanwen/go-fuse")), "no build carries the simulator")
}
