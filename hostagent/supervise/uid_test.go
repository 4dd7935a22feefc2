package supervise

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/store"
)

// uidEnv is an env for launches refused before QEMU is started: it needs
// no QEMU.
func uidEnv(t *testing.T) *env {
	e := &env{t: t, dir: testDir(t), uids: newUIDRange()}
	st, err := store.New(e.dir)
	require.NoError(t, err)
	e.st = st
	return e
}

// A --qemu-uid-range that the host also hands out (here: a user's
// subordinate range, as useradd writes it) is refused at launch with the
// overlap named, before anything is opened or started; the agent says so
// once when it starts, and supervision goes on. Fails without the check
// (the launch goes ahead and assigns a uid).
func TestLaunchRefusedWhenUIDRangeHandedOut(t *testing.T) {
	e := uidEnv(t)
	etc := t.TempDir()
	line := "alice:" + strconv.FormatUint(uint64(e.uids.First-10), 10) + ":65536"
	require.NoError(t, os.WriteFile(filepath.Join(etc, "subuid"), []byte(line+"\n"), 0o644))
	e.create("vm1", "never", 0)
	sup := e.newSupervisor(func(c *Config) { c.EtcDir = etc })
	assert.NotEmpty(t, e.logs.FilterMessage("launches will be refused").All())

	_, err := sup.Launch(ctxT(t, 10*time.Second), "vm1")
	require.ErrorIs(t, err, store.ErrUIDRangeTaken)
	assert.Contains(t, err.Error(), filepath.Join(etc, "subuid")+" line 1 ("+line+")")
	rec := e.get("vm1")
	assert.Zero(t, rec.GetQemuUid(), "no uid assigned")
	assert.Nil(t, rec.GetLaunchStartedAt(), "nothing forked")
	assert.Nil(t, rec.GetProcess())
	assert.Contains(t, rec.GetLastError(), "overlaps")
}

// A VFIO group node still owned by a uid (given to a QEMU that is gone, not
// taken back yet) counts as that uid in use.
func TestUIDsInUseCountsVFIONodes(t *testing.T) {
	e := uidEnv(t)
	dev := t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(dev, "vfio"), 0o755))
	node := filepath.Join(dev, "vfio", "42")
	require.NoError(t, os.WriteFile(node, nil, 0o600))
	require.NoError(t, os.Lchown(node, int(e.uids.First), int(e.uids.First)))
	sup := e.newSupervisor(func(c *Config) { c.DevRoot = dev })
	used, err := sup.uidsInUse(ctxT(t, 10*time.Second))
	require.NoError(t, err)
	assert.True(t, used[e.uids.First])
	assert.True(t, used[0], "root's processes are seen too")
}
