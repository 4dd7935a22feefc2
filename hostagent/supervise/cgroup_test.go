package supervise

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// recordingCgroups stands in for the host's cgroups: it records the calls.
type recordingCgroups struct {
	mu      sync.Mutex
	placed  map[string]int
	limits  []vmm.CgroupLimits
	removed []string
}

func (r *recordingCgroups) Place(_ context.Context, name string, pid int, l vmm.CgroupLimits) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.placed[name] = pid
	r.limits = append(r.limits, l)
	return nil
}

func (r *recordingCgroups) Remove(_ context.Context, name string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.removed = append(r.removed, name)
	return nil
}

// Every launch places its QEMU in the cgroup named by the instance and its
// uid; the tear down after the stop removes it.
func TestLaunchPlacesAndTearDownRemovesCgroup(t *testing.T) {
	e := newEnv(t)
	cg := &recordingCgroups{placed: map[string]int{}}
	sup := e.newSupervisor(func(c *Config) { c.Cgroups = cg })
	e.create("vm1", "", 0)
	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	name := vmm.CgroupName("vm1", e.get("vm1").GetQemuUid())
	assert.Equal(t, map[string]int{name: res.Identity.PID}, cg.placed)

	require.NoError(t, e.st.MarkManualStop(ctxT(t, 5*time.Second), "vm1"))
	_, err = sup.Stop(ctxT(t, 30*time.Second), "vm1", time.Millisecond)
	require.NoError(t, err)
	require.NoError(t, sup.TearDown(ctxT(t, 10*time.Second), "vm1"))
	assert.Equal(t, []string{name}, cg.removed)
}

// The operator's disk I/O bound (--vm-io-*) reaches every VM's cgroup,
// bound by bound the tighter of it and the spec's own, on the block device
// under the VM's disk.
func TestOperatorIOLimitsReachCgroup(t *testing.T) {
	vmmtest.RequiresQEMUImg(t)
	e := newEnv(t)
	cg := &recordingCgroups{placed: map[string]int{}}
	dir := testDir(t)
	basePath := filepath.Join(dir, "base.raw")
	require.NoError(t, os.WriteFile(basePath, make([]byte, 1<<20), 0o644))
	sup := e.newSupervisor(func(c *Config) {
		c.Cgroups = cg
		c.VMIO = vmm.IOLimits{ReadBPS: 1 << 20, WriteBPS: 1 << 20}
		c.PrepareLaunch = func(ctx context.Context, _ *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
			spec := admission.ForRecord(rec, nil)
			spec.Machine, spec.SerialToLog = vmm.MachineQ35, false
			spec.IO = vmm.IOLimits{ReadBPS: 2 << 20, WriteIOPS: 50}
			base, err := os.Open(basePath)
			if err != nil {
				return spec, err
			}
			ov, _, err := vmm.OpenOverlay(ctx, vmm.OverlayConfig{Path: filepath.Join(dir, "disk.qcow2"),
				Temp: filepath.Join(dir, ".tmp-disk.qcow2"), Base: base, BackingName: basePath})
			spec.Disk = &vmm.Disk{Base: base, Overlay: ov}
			return spec, err
		}
	})
	e.create("vm1", "", 0)
	_, err := sup.Launch(ctxT(t, 60*time.Second), "vm1")
	if errors.Is(err, vmm.ErrIOUnbounded) {
		t.Skip(err) // the test's folder is on no block device
	}
	require.NoError(t, err)
	require.Len(t, cg.limits, 1)
	assert.Equal(t, vmm.IOLimits{ReadBPS: 1 << 20, WriteBPS: 1 << 20, WriteIOPS: 50}, cg.limits[0].IO)
	assert.Len(t, cg.limits[0].IODevices, 1, "the one disk under the base and the overlay")
}
