package supervise

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/cli"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
)

// admitting is a host policy the env's records (1 vCPU, 64 MiB) pass;
// strict is the same host after its operator lowered the memory bound.
var (
	admitting = admission.Host{MaxVCPUs: 1, MaxMemoryMiB: 1024}
	strict    = admission.Host{MaxVCPUs: 1, MaxMemoryMiB: 32}
)

// withPolicy makes a supervisor admit every launch and restart against h,
// as the agent wires it (admission.PrepareLaunch).
func withPolicy(h admission.Host, refused *atomic.Int32) func(*Config) {
	return func(c *Config) {
		c.PrepareLaunch = admission.PrepareLaunch(h, nil, false)
		c.RestartBackoff = 10 * time.Millisecond
		if refused != nil {
			c.OnRestartRefused = func() { refused.Add(1) }
		}
	}
}

// TestRestartRefusedByCurrentPolicy: an instance admitted under one policy
// whose VM ends while the agent is down, and the agent comes back with a
// stricter policy: the restart is refused before anything is opened or
// started, the record says why (last_error and needs_attention, shown by
// ls -o json), the refusal is counted, and nothing is rescheduled. Fails
// without admission in PrepareLaunch (the restart launches the VM).
func TestRestartRefusedByCurrentPolicy(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "always", 0)
	sup1 := e.newSupervisor(withPolicy(admitting, nil))
	_, err := sup1.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	require.NoError(t, sup1.Close()) // the agent stops; its VM keeps running
	qemu := killFromOutside(t, e, "vm1")
	require.Eventually(t, func() bool { return !proc.Inspect(qemu).Alive }, 10*time.Second, 5*time.Millisecond)

	var refused atomic.Int32
	sup2 := e.newSupervisor(withPolicy(strict, &refused))
	rep, err := sup2.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Equal(t, 1, rep.RestartsScheduled, "the restart policy still asks for a restart")
	require.Eventually(t, func() bool { return refused.Load() == 1 }, 10*time.Second, 5*time.Millisecond)

	rec := e.get("vm1")
	assert.Equal(t, stateExited, rec.GetState())
	assert.Nil(t, rec.GetProcess(), "not launched")
	assert.Nil(t, rec.GetLaunchStartedAt(), "no launch marker: nothing was forked")
	assert.Contains(t, rec.GetLastError(), "refused by this host's admission policy")
	assert.Contains(t, rec.GetLastError(), "memory_mib: 64 exceeds this host's 32 MiB")
	assert.Contains(t, rec.GetNeedsAttention(), "restart refused")
	assert.Contains(t, rec.GetNeedsAttention(), "memory_mib")
	assert.NotNil(t, rec.GetNeedsAttentionAt())
	assert.Equal(t, uint32(0), rec.GetRestartCount(), "a refused restart started nothing: not an attempt")
	st, err := sup2.Status("vm1")
	require.NoError(t, err)
	assert.True(t, st.NextRestart.IsZero(), "nothing rescheduled: the policy changes only with a new agent")
	assert.Empty(t, e.logs.FilterMessage("qemu started").All())

	var out, errOut bytes.Buffer
	require.Equal(t, cli.ExitOK, cli.Ls([]string{"--state-dir", e.dir, "-o", "json"}, cli.IO{Stdout: &out, Stderr: &errOut}), errOut.String())
	var rows []cli.Instance
	require.NoError(t, json.Unmarshal(out.Bytes(), &rows))
	require.Len(t, rows, 1)
	assert.True(t, slices.ContainsFunc(rows[0].NeedsAttention, func(r string) bool { return strings.HasPrefix(r, "restart refused: ") }),
		"ls: %q", rows[0].NeedsAttention)

	// An agent whose policy admits the record again restarts it, and the
	// refusal is cleared.
	require.NoError(t, sup2.Close())
	sup3 := e.newSupervisor(withPolicy(admitting, nil))
	_, err = sup3.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		r := e.get("vm1")
		return r.GetState() == stateRunning && r.GetProcess() != nil
	}, 20*time.Second, 5*time.Millisecond)
	rec = e.get("vm1")
	assert.Empty(t, rec.GetNeedsAttention())
	assert.Nil(t, rec.GetNeedsAttentionAt())
	assert.Empty(t, rec.GetLastError())
	assertNoZombieChildren(t)
}

// TestLaunchRefusedByPolicy: an explicit launch of a record the policy
// does not admit fails with admission.ErrAdmissionRefused, with no QEMU started
// and no launch marker left. Fails without admission in PrepareLaunch.
func TestLaunchRefusedByPolicy(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "never", 0)
	sup := e.newSupervisor(withPolicy(strict, nil))
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.ErrorIs(t, err, admission.ErrAdmissionRefused)
	rec := e.get("vm1")
	assert.Nil(t, rec.GetProcess())
	assert.Nil(t, rec.GetLaunchStartedAt())
	assert.Equal(t, stateCreating, rec.GetState())
	assert.Contains(t, rec.GetLastError(), "memory_mib")
	assert.Empty(t, e.logs.FilterMessage("launching qemu").All(), "refused before the fork")
}

// TestReattachUnderStricterPolicyKeepsVMRunning: policy is checked before a
// fork, never against a VM that runs. An agent that comes back with a
// policy the running VM's record no longer passes re-attaches it, leaves it
// running, and a launch of it returns it as it is.
func TestReattachUnderStricterPolicyKeepsVMRunning(t *testing.T) {
	e := newEnv(t)
	e.create("vm1", "always", 0)
	sup1 := e.newSupervisor(withPolicy(admitting, nil))
	_, err := sup1.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	require.NoError(t, sup1.Close())
	qemu := store.IdentityOf(e.get("vm1").GetProcess())

	var refused atomic.Int32
	sup2 := e.newSupervisor(withPolicy(strict, &refused))
	rep, err := sup2.Start(ctxT(t, 30*time.Second))
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Attached)
	assert.True(t, proc.Inspect(qemu).Alive, "a running VM is never killed over policy")
	res, err := sup2.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	assert.True(t, res.AlreadyRunning)
	assert.Equal(t, qemu, res.Identity)
	rec := e.get("vm1")
	assert.Equal(t, stateRunning, rec.GetState())
	assert.Equal(t, qemu, store.IdentityOf(rec.GetProcess()))
	assert.Empty(t, rec.GetNeedsAttention())
	assert.Zero(t, refused.Load())
}
