package vmm

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
)

// FindBySocket finds a QEMU by the -qmp argument Argv wrote, and only for
// exactly that socket path (a comma in the path is escaped both ways).
func TestFindBySocket(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "find")
	// A comma exercises the QemuOpts escaping Argv applies.
	dir := filepath.Dir(cfg.Paths.QMPSocket)
	cfg.Paths.QMPSocket = filepath.Join(dir, "q,emu.sock")
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)

	ids, err := FindBySocket(ctxT(t, 10*time.Second), cfg.Paths.QMPSocket)
	require.NoError(t, err)
	assert.Equal(t, []proc.Identity{vm.Identity()}, ids, "the launched QEMU, with its identity")
	ids, err = FindBySocket(ctxT(t, 10*time.Second), filepath.Join(dir, "q"))
	require.NoError(t, err)
	assert.Empty(t, ids, "a prefix of the path is another instance")
	ids, err = FindBySocket(ctxT(t, 10*time.Second), strings.TrimSuffix(cfg.Paths.QMPSocket, ".sock")+".sock2")
	require.NoError(t, err)
	assert.Empty(t, ids)
}
