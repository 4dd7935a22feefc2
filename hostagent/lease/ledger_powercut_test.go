package lease_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/testsupport/powercut"
)

// TestOrphanLedgerSurvivesPowerCut: the ledger of devices seen unclaimed
// (vgpu-unclaimed.json) is written durably, so a power cut after a round
// neither restarts an orphan's grace period nor leaves an empty ledger: the
// first round after the restart, past the grace period, removes the
// orphan. Fails when the ledger is written without fsync (temp + rename
// only: it comes back missing or empty and the grace period starts over).
func TestOrphanLedgerSurvivesPowerCut(t *testing.T) {
	e := &claimsEnv{sim: simtest.Start(t, vgpusim.Options{MdevParents: 1}), now: newClock()}
	pc := powercut.Start(t)
	state := filepath.Join(pc.Dir(), "state")
	e.devDir = t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(e.devDir, "vfio"), 0o755))
	var err error
	open := func() {
		e.st, err = store.New(state)
		require.NoError(t, err)
		e.claims, err = lease.New(lease.Config{
			Driver: gpu.Config{SysfsRoot: e.sim.Root, StateDir: state}, Store: e.st, DevRoot: e.devDir,
			OrphanGrace: time.Minute, IgnoreUninspectable: proctest.UninspectableInit(), Now: e.now.Now,
		})
		require.NoError(t, err)
	}
	open()
	ctx := context.Background()
	orphan, err := e.claims.Driver().Create(ctx, gpu.CreateRequest{Profile: profile, UUID: "2b6c4e3a-0d4f-4a8e-9a43-6f5d2e1c0b7a"})
	require.NoError(t, err)
	res, err := e.claims.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, res.GetOrphansRemoved(), "first seen now: inside the grace period")

	require.NoError(t, pc.Restart())
	open()
	e.now.Advance(2 * time.Minute)
	res, err = e.claims.Reconcile(ctx)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.GetOrphansRemoved(), "the ledger remembered when the orphan was first seen")
	for _, d := range e.devices(t) {
		assert.NotEqual(t, orphan.ID, d.ID)
	}
}
