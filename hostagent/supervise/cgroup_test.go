package supervise

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/vmm"
)

// recordingCgroups stands in for the host's cgroups: it records the calls.
type recordingCgroups struct {
	mu      sync.Mutex
	placed  map[string]int
	removed []string
}

func (r *recordingCgroups) Place(_ context.Context, name string, pid int, _ vmm.CgroupLimits) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.placed[name] = pid
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
