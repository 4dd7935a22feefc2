package activities

import (
	"context"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/workflows"
)

// The activity environment runs every activity as this workflow execution.
const (
	testWorkflowID = "default-test-workflow-id"
	testRunID      = "default-test-run-id"
)

// TestCreateRecordNamesItsSpawn: the record names the spawn that ran
// CreateRecord, a retried attempt of the same spawn still owns it, and a
// record another spawn (or a pre-creator agent) wrote is reported as not
// this spawn's (invariant 9).
func TestCreateRecordNamesItsSpawn(t *testing.T) {
	h := newHost(t)
	req := spawnReq("vm1")
	var res vmflowv1.CreateRecordResult
	require.NoError(t, h.run(t, h.acts.CreateRecord, req, &res))
	assert.True(t, res.GetCreatedByThisSpawn())
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.Equal(t, testWorkflowID, rec.GetCreatedByWorkflowId())
	assert.Equal(t, testRunID, rec.GetCreatedByRunId())

	require.NoError(t, h.run(t, h.acts.CreateRecord, req, &res))
	assert.True(t, res.GetAlreadyExisted())
	assert.True(t, res.GetCreatedByThisSpawn(), "a retried CreateRecord of the same spawn (worker crash) is still its own")

	for name, creator := range map[string][2]string{
		"other run": {testWorkflowID, "an-earlier-run"},
		"legacy":    {"", ""},
	} {
		id := map[string]string{"other run": "vm2", "legacy": "vm3"}[name]
		w := &vmflowv1.InstanceRecord{Id: id, Spec: admission.RecordSpec(spawnReq(id)),
			CreatedByWorkflowId: creator[0], CreatedByRunId: creator[1]}
		_, err := h.st.Create(context.Background(), w)
		require.NoError(t, err)
		var got vmflowv1.CreateRecordResult
		require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq(id), &got), name)
		assert.True(t, got.GetAlreadyExisted(), name)
		assert.False(t, got.GetCreatedByThisSpawn(), name)
	}
}

// TestBeginDeleteGuard: a failed spawn's clean-up touches only a record
// that spawn created. Another spawn's record and a legacy one are left
// exactly as they were: no marker, no state change. An unreadable one is
// left alone too, but is not reported as another's: its owner is unknown,
// and "not owned" would end the clean-up with the spawn's own record and
// claim left behind; RecordUnreadable parks it for an operator. Before, the
// torn record was reported not-owned.
func TestBeginDeleteGuard(t *testing.T) {
	h := newHost(t)
	ctx := context.Background()
	guard := func(id string) *vmflowv1.BeginDeleteRequest {
		return &vmflowv1.BeginDeleteRequest{InstanceId: id, OnlyIfCreatedByWorkflowId: testWorkflowID, OnlyIfCreatedByRunId: testRunID}
	}
	_, err := h.st.Create(ctx, &vmflowv1.InstanceRecord{Id: "theirs", Spec: admission.RecordSpec(spawnReq("theirs")),
		CreatedByWorkflowId: "spawn/theirs", CreatedByRunId: "r1"})
	require.NoError(t, err)
	_, err = h.st.Create(ctx, &vmflowv1.InstanceRecord{Id: "legacy", Spec: admission.RecordSpec(spawnReq("legacy"))})
	require.NoError(t, err)
	_, err = h.st.Create(ctx, &vmflowv1.InstanceRecord{Id: "torn", Spec: admission.RecordSpec(spawnReq("torn")),
		CreatedByWorkflowId: testWorkflowID, CreatedByRunId: testRunID})
	require.NoError(t, err)
	p, err := h.st.Paths("torn")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte(`{"id": "torn", "spe`), 0o600))

	for _, id := range []string{"theirs", "legacy", "torn"} {
		var res vmflowv1.BeginDeleteResult
		err := h.run(t, h.acts.BeginDelete, guard(id), &res)
		if id == "torn" {
			ae := appError(t, err)
			assert.Equal(t, workflows.ErrTypeRecordUnreadable, ae.Type())
			assert.True(t, ae.NonRetryable())
		} else {
			require.NoError(t, err, id)
			assert.True(t, res.GetNotOwned(), id)
			assert.NotEmpty(t, res.GetCreatedBy(), id)
		}
		marked, err := h.st.ManualStop(id)
		require.NoError(t, err)
		assert.False(t, marked, "%s: no manual-stop marker written", id)
	}
	rec, err := h.st.Get("theirs")
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_CREATING, rec.GetState())

	// Its own record is deleted as usual; an absent one is absent.
	var own vmflowv1.CreateRecordResult
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("mine"), &own))
	var res vmflowv1.BeginDeleteResult
	require.NoError(t, h.run(t, h.acts.BeginDelete, guard("mine"), &res))
	assert.False(t, res.GetNotOwned())
	rec, err = h.st.Get("mine")
	require.NoError(t, err)
	assert.True(t, store.IsDeleting(rec))
	require.NoError(t, h.run(t, h.acts.BeginDelete, guard("nobody"), &res))
	assert.True(t, res.GetAlreadyAbsent())
}

// TestUnreadableRecordIsNotRetried: an unreadable record fails the delete's
// steps with a non-retryable RecordUnreadable (the workflow parks it, needing
// attention) rather than a HostError retried forever out of sight; the
// marker is still written first so nothing restarts the VM.
func TestUnreadableRecordIsNotRetried(t *testing.T) {
	h := newHost(t)
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("vm1"), nil))
	p, err := h.st.Paths("vm1")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte("{"), 0o600))

	err = h.run(t, h.acts.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeRecordUnreadable, ae.Type())
	assert.True(t, ae.NonRetryable())
	marked, err := h.st.ManualStop("vm1")
	require.NoError(t, err)
	assert.True(t, marked)

	err = h.run(t, h.acts.CreateRecord, spawnReq("vm1"), nil)
	assert.Equal(t, workflows.ErrTypeRecordUnreadable, appError(t, err).Type(), "a spawn finding it is told, not retried")

	// Every other activity that reads the record says the same, whichever
	// host package it went through: none turns it into a retryable
	// HostError.
	ref := &vmflowv1.InstanceRef{InstanceId: "vm1"}
	for _, c := range []struct {
		name string
		fn   any
		in   any
	}{
		{"ClaimVGPU", h.acts.ClaimVGPU, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: spawnReq("vm1").GetVgpuProfile()}},
		{"LaunchVM", h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}},
		{"StopVM", h.acts.StopVM, &vmflowv1.StopVMRequest{InstanceId: "vm1"}},
		{"WaitVMExit", h.acts.WaitVMExit, ref},
		{"ReleaseLeases", h.acts.ReleaseLeases, ref},
		{"TearDown", h.acts.TearDown, ref},
		{"DeleteRecord", h.acts.DeleteRecord, ref},
	} {
		ae := appError(t, h.run(t, c.fn, c.in, nil))
		assert.Equal(t, workflows.ErrTypeRecordUnreadable, ae.Type(), "%s: %v", c.name, ae)
		assert.True(t, ae.NonRetryable(), c.name)
	}
}

// TestReleaseWithoutDriverKeepsClaim: an agent without a vGPU driver does
// not report a held claim as released (the store would then refuse the
// record's delete forever, silently); it fails non-retryably naming the
// claim, and the claim stays.
func TestReleaseWithoutDriverKeepsClaim(t *testing.T) {
	h := newHost(t)
	req := spawnReq("vm1")
	require.NoError(t, h.run(t, h.acts.CreateRecord, req, nil))
	require.NoError(t, h.run(t, h.acts.ClaimVGPU, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: req.GetVgpuProfile()}, nil))
	require.NoError(t, h.run(t, h.acts.BeginDelete, &vmflowv1.BeginDeleteRequest{InstanceId: "vm1"}, nil))

	h.acts.GPUs = nil // as under --vgpu-driver=none
	h.acts.Logger = zaptest.NewLogger(t)
	err := h.run(t, h.acts.ReleaseLeases, &vmflowv1.InstanceRef{InstanceId: "vm1"}, nil)
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeVGPUUnavailable, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, ae.Error(), "GRID A100-4C")
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.True(t, store.ClaimHeld(rec), "the claim is kept")

	// Without a claim there is nothing to release, driver or not.
	require.NoError(t, h.run(t, h.acts.CreateRecord, spawnReq("vm2"), nil))
	var res vmflowv1.ReleaseVGPUResult
	require.NoError(t, h.run(t, h.acts.ReleaseLeases, &vmflowv1.InstanceRef{InstanceId: "vm2"}, &res))
	assert.False(t, res.GetReleased())
}

// TestLaunchExistingOnlyTouchesNothing: the existing-only launch a re-sent
// spawn makes returns a VM that runs as asked, and for a hung VM or an
// exited one fails non-retryably with InstanceExists saying what is there,
// leaving the process and the record as they were.
func TestLaunchExistingOnlyTouchesNothing(t *testing.T) {
	h := newHost(t)
	req := spawnReq("vm1")
	require.NoError(t, h.run(t, h.acts.CreateRecord, req, nil))
	require.NoError(t, h.run(t, h.acts.ClaimVGPU, &vmflowv1.ClaimVGPURequest{InstanceId: "vm1", VgpuProfile: req.GetVgpuProfile()}, nil))
	var launched vmflowv1.LaunchVMResult
	require.NoError(t, h.run(t, h.acts.LaunchVM, &vmflowv1.LaunchVMRequest{InstanceId: "vm1"}, &launched))
	t.Cleanup(func() { _ = syscall.Kill(int(launched.GetPid()), syscall.SIGKILL) })

	only := &vmflowv1.LaunchVMRequest{InstanceId: "vm1", ExistingOnly: true}
	var found vmflowv1.LaunchVMResult
	require.NoError(t, h.run(t, h.acts.LaunchVM, only, &found))
	assert.True(t, found.GetAlreadyRunning())
	assert.Equal(t, launched.GetPid(), found.GetPid())
	assert.NotEmpty(t, found.GetVgpuUuid(), "mdev: the claim's UUID")
	assert.Equal(t, found.GetVgpuUuid(), found.GetVgpuDeviceId())

	// Hung: QEMU stopped, its monitor silent.
	pid := int(launched.GetPid())
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	err := h.run(t, h.acts.LaunchVM, only, nil)
	require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
	ae := appError(t, err)
	assert.Equal(t, workflows.ErrTypeInstanceExists, ae.Type())
	assert.True(t, ae.NonRetryable())
	assert.Contains(t, ae.Error(), "did not answer")
	assert.NoError(t, syscall.Kill(pid, 0), "the hung VM was not touched")

	// Exited: killed from outside, recorded by the supervisor's watcher.
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	require.Eventually(t, func() bool {
		rec, err := h.st.Get("vm1")
		return err == nil && rec.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_EXITED
	}, 10*time.Second, 10*time.Millisecond)
	err = h.run(t, h.acts.LaunchVM, only, nil)
	ae = appError(t, err)
	assert.Equal(t, workflows.ErrTypeInstanceExists, ae.Type())
	assert.Contains(t, ae.Error(), "exited")
	rec, err := h.st.Get("vm1")
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_EXITED, rec.GetState(), "nothing relaunched it")
	assert.True(t, store.ClaimHeld(rec), "nothing released its vGPU")
}
