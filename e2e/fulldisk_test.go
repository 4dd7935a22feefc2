package e2e

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc/proctest"
)

// A full state file system never blocks a delete (invariant 14). With the
// agent's state dir on a 16 MiB file system filled to the last byte, a
// delete of a running VM writes its manual-stop marker, runs the stop
// ladder, and removes the record: nothing is left. Before the reserve, the
// delete sat at marking-stopped, retrying, for as long as the disk was full.
func TestDeleteOnFullStateFS(t *testing.T) {
	timeTest(t)
	requireQEMU(t)
	proctest.RequiresRoot(t, "mounting a small file system")
	e := newEnv(t, envOptions{stateFS: 16 << 20})
	id := "e2e-full-" + suffix(t)
	e.spawn(e.noneSpawn(id, false))

	f, err := os.Create(filepath.Join(e.stateDir, "filler"))
	require.NoError(t, err)
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			require.True(t, errors.Is(err, syscall.ENOSPC), "%v", err)
			break
		}
	}
	require.NoError(t, f.Close())

	require.NoError(t, e.startDelete(id, 1).Get(e.ctx(2*time.Minute), nil))
	e.assertNothingLeft()
}
