package supervise

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/internal/crashpoint"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The launch's stages in order: a reorder, an insertion or a removal is a
// diff here. Every crash point a stage names is one the crash matrix arms.
func TestLaunchStagesInOrder(t *testing.T) {
	var names, points []string
	for _, st := range launchStages {
		names = append(names, st.name)
		for _, p := range st.crash {
			assert.Contains(t, crashpoint.All, p, "stage %q", st.name)
		}
		points = append(points, st.crash...)
	}
	assert.Equal(t, []string{"admit", "capacity", "start slot", "ensure leases", "uid", "VFIO nodes", "network", "fork", "record", "QMP ready"}, names)
	// Every launch point of the crash matrix is named by some stage.
	var launch []string
	for _, p := range crashpoint.All {
		if strings.HasPrefix(p, "vmm.launch.") || strings.HasPrefix(p, "supervise.launch.") {
			launch = append(launch, p)
		}
	}
	assert.Subset(t, points, launch)
}

var errInjected = errors.New("injected stage failure")

// failAfter cuts the launch after stage after and puts in the next stage's
// place one of the same name that fails.
func failAfter(t *testing.T, after string) func([]launchStage) []launchStage {
	return func(stages []launchStage) []launchStage {
		i := slices.IndexFunc(stages, func(s launchStage) bool { return s.name == after })
		require.True(t, i >= 0 && i+1 < len(stages), "no stage after %q", after)
		return append(slices.Clone(stages[:i+1]), launchStage{name: stages[i+1].name,
			do: func(*launchRun, context.Context) error { return errInjected }})
	}
}

// stageEnv is a netEnv whose launches fail at the stage after after. Before
// the fork the spec also holds an opened file and a VFIO device whose group
// node is a file of the test's (QEMU could use neither: the fork's cases do
// without).
type stageEnv struct {
	*netEnv
	opened *os.File
	node   string
	pid    proc.Identity // the forked QEMU, from the fork on
}

func newStageEnv(t *testing.T, after string) *stageEnv {
	beforeFork := slices.IndexFunc(launchStages, func(s launchStage) bool { return s.name == after }) <
		slices.IndexFunc(launchStages, func(s launchStage) bool { return s.name == stageFork })
	e := &stageEnv{}
	dev := t.TempDir()
	sysdev := filepath.Join(dev, "gpu0")
	require.NoError(t, os.MkdirAll(filepath.Join(dev, "vfio"), 0o755))
	require.NoError(t, os.Mkdir(sysdev, 0o755))
	require.NoError(t, os.Symlink("../../kernel/iommu_groups/42", filepath.Join(sysdev, "iommu_group")))
	e.node = filepath.Join(dev, "vfio", "42")
	require.NoError(t, os.WriteFile(e.node, nil, 0o600))
	prepare := func(_ context.Context, _ *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
		if !beforeFork {
			return admission.ForRecord(rec, nil), nil
		}
		f, err := os.Open(e.node)
		if err != nil {
			return vmm.VMSpec{}, err
		}
		e.opened = f
		v := admission.ForRecord(rec, []string{sysdev})
		v.Initrd = f
		return v, nil
	}
	e.netEnv = newNetEnv(t, prepare)
	sup := e.newSupervisor(func(c *Config) { c.Network, c.PrepareLaunch, c.DevRoot = e.net, prepare, dev })
	sup.hooks.launchStages = failAfter(t, after)
	sup.hooks.beforeRecorded = func(_ string, pid proc.Identity) { e.pid = pid }
	e.createNet("vm1")
	return e
}

// launch launches vm1, which fails with errInjected, and returns its record.
func (e *stageEnv) launch(t *testing.T) *vmflowv1.InstanceRecord {
	_, err := e.sup.Launch(ctxT(t, 60*time.Second), "vm1")
	require.ErrorIs(t, err, errInjected)
	rec := e.get("vm1")
	assert.Nil(t, rec.GetProcess(), "no QEMU recorded")
	assert.Nil(t, rec.GetLaunchStartedAt(), "no launch marker")
	return rec
}

// assertClosed: the spec's image (here the node file) is no longer open in
// the agent.
func assertClosed(t *testing.T, f *os.File) {
	require.NotNil(t, f, "the spec was assembled")
	_, err := f.Stat()
	assert.ErrorIs(t, err, os.ErrClosed, "the spec's files closed")
}

// assertNoTAPLeaseKept: no TAP left, the address still the instance's.
func (e *stageEnv) assertNoTAPLeaseKept(t *testing.T, rec *vmflowv1.InstanceRecord) {
	lease := store.Network(rec)
	require.NotNil(t, lease)
	assert.True(t, store.LeaseHeld(lease), "the lease is kept")
	assert.Nil(t, nettest.Link(t, e.h, lease.GetNetwork().GetTap()), "no TAP left")
}

// assertQEMUGone: the forked QEMU is gone, reaped, and its QMP socket removed.
func (e *stageEnv) assertQEMUGone(t *testing.T) {
	require.True(t, e.pid.Valid(), "QEMU was forked")
	assert.False(t, proc.Inspect(e.pid).Alive, "no QEMU left")
	p, err := e.st.Paths("vm1")
	require.NoError(t, err)
	assert.NoFileExists(t, p.Socket, "no QMP socket left")
	assertNoZombieChildren(t)
}

// One test per undo: the launch is cut after a stage, the next fails, and
// what the stages done made is taken back (and only that: leases stay).
func TestLaunchUndoAfterEachStage(t *testing.T) {
	for _, c := range []struct {
		after, want string
		check       func(t *testing.T, e *stageEnv, rec *vmflowv1.InstanceRecord)
	}{
		{stageAdmit, "the record untouched", func(t *testing.T, _ *stageEnv, rec *vmflowv1.InstanceRecord) {
			assert.Zero(t, rec.GetQemuUid(), "no uid assigned")
			assert.Nil(t, store.Network(rec), "no lease taken")
		}},
		{stageLeases, "the spec's files closed", func(t *testing.T, e *stageEnv, rec *vmflowv1.InstanceRecord) {
			assertClosed(t, e.opened)
			assert.Zero(t, rec.GetQemuUid(), "no uid assigned")
		}},
		{stageUID, "marker cleared, node never given, cause recorded", func(t *testing.T, e *stageEnv, rec *vmflowv1.InstanceRecord) {
			assert.NotZero(t, rec.GetQemuUid(), "the uid stays the instance's")
			assert.Equal(t, errInjected.Error(), rec.GetLastError())
			assert.Empty(t, rec.GetVfioGroupNodes())
			assertOwner(t, e.node, 0)
			assertClosed(t, e.opened)
		}},
		{stageVFIO, "the node taken back", func(t *testing.T, e *stageEnv, rec *vmflowv1.InstanceRecord) {
			assert.Empty(t, rec.GetVfioGroupNodes(), "no node left given")
			assertOwner(t, e.node, 0)
			assert.Equal(t, errInjected.Error(), rec.GetLastError())
		}},
		{stageNetwork, "no TAP, lease kept", func(t *testing.T, e *stageEnv, rec *vmflowv1.InstanceRecord) {
			e.assertNoTAPLeaseKept(t, rec)
			assertOwner(t, e.node, 0)
			assertClosed(t, e.opened)
			assert.Equal(t, errInjected.Error(), rec.GetLastError())
		}},
		{stageFork, "no process, no socket, no TAP, lease kept", func(t *testing.T, e *stageEnv, rec *vmflowv1.InstanceRecord) {
			e.assertQEMUGone(t)
			e.assertNoTAPLeaseKept(t, rec)
			assert.Contains(t, rec.GetLastError(), errInjected.Error())
		}},
		{stageRecord, "process killed and reaped, socket removed, pid cleared", func(t *testing.T, e *stageEnv, rec *vmflowv1.InstanceRecord) {
			e.assertQEMUGone(t)
			e.assertNoTAPLeaseKept(t, rec)
			assert.Equal(t, errInjected.Error(), rec.GetLastError())
			assert.NotNil(t, rec.GetLastExit(), "the undone QEMU's exit recorded")
		}},
	} {
		t.Run(c.after+" then a failure: "+c.want, func(t *testing.T) {
			e := newStageEnv(t, c.after)
			c.check(t, e, e.launch(t))
		})
	}
}

// assertOwner: path is owned by uid.
func assertOwner(t *testing.T, path string, uid uint32) {
	fi, err := os.Lstat(path)
	require.NoError(t, err)
	assert.Equal(t, uid, fi.Sys().(*syscall.Stat_t).Uid, "owner of %s", path)
}
