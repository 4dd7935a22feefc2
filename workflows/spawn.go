package workflows

import (
	"errors"

	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// SpawnInstance creates an instance on its host: validate, record, claim a
// vGPU if asked, launch QEMU and wait until QMP says running.
//
// Once this spawn has created (or found its own) record, any failure starts
// the delete path for the instance as a child DeleteInstance that outlives
// this workflow, so nothing a half-made spawn left on the host leaks, and
// then fails with the original error.
func (w *Workflows) SpawnInstance(ctx workflow.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.SpawnResult, error) {
	if req == nil {
		return nil, invalidInput("empty spawn request")
	}
	if !ValidID(req.GetInstanceId()) {
		return nil, invalidInput("instance_id %q: must match %s", req.GetInstanceId(), idPattern)
	}
	if !ValidID(req.GetHostId()) {
		return nil, invalidInput("host_id %q: must match %s", req.GetHostId(), idPattern)
	}
	t, err := newTracker(ctx, "spawn", req.GetInstanceId(), req.GetHostId())
	if err != nil {
		return nil, err
	}
	h := &hostRunner{w: w, t: t, hostID: req.GetHostId(), giveUp: w.cfg.SpawnHostWait}
	calls := w.calls()
	ref := &vmflowv1.InstanceRef{InstanceId: req.GetInstanceId()}

	t.stage(ctx, StageValidating)
	if err := h.run(ctx, calls[ActivityValidateSpawn], req, nil); err != nil {
		return nil, w.spawnFailed(ctx, t, err)
	}

	t.stage(ctx, StageCreatingRecord)
	var created vmflowv1.CreateRecordResult
	if err := h.run(ctx, calls[ActivityCreateRecord], req, &created); err != nil {
		switch errorType(err) {
		case ErrTypeInvalidInput, ErrTypeConflict, ErrTypeInstanceDeleting:
			// The record there is not ours (another spec, or a delete owns
			// it): deleting it would destroy someone else's VM.
			return nil, w.spawnFailed(ctx, t, err)
		}
		return nil, w.cleanUpAfter(ctx, t, req, err)
	}
	t.setRetained(ctx, true)

	res := &vmflowv1.SpawnResult{InstanceUuid: created.GetInstanceUuid()}
	if req.GetVgpuProfile() != "" {
		t.stage(ctx, StageClaimingVGPU)
		var claim vmflowv1.ClaimVGPUResult
		in := &vmflowv1.ClaimVGPURequest{InstanceId: req.GetInstanceId(), VgpuProfile: req.GetVgpuProfile()}
		if err := h.run(ctx, calls[ActivityClaimVGPU], in, &claim); err != nil {
			return nil, w.cleanUpAfter(ctx, t, req, err)
		}
		res.VgpuUuid, res.VgpuDeviceId = claim.GetDeviceId(), claim.GetDeviceId()
	}

	t.stage(ctx, StageLaunching)
	var launched vmflowv1.LaunchVMResult
	if err := h.run(ctx, calls[ActivityLaunchVM], ref, &launched); err != nil {
		return nil, w.cleanUpAfter(ctx, t, req, err)
	}
	res.Pid, res.QmpSocket = launched.GetPid(), launched.GetQmpSocket()
	t.stage(ctx, StageRunning)
	return res, nil
}

// spawnFailed ends a spawn that created nothing on the host.
func (w *Workflows) spawnFailed(ctx workflow.Context, t *tracker, cause error) error {
	t.status.LastError = errorText(cause)
	t.stage(ctx, StageSpawnFailed)
	if errors.Is(cause, errHostGaveUp) {
		return temporal.NewNonRetryableApplicationError(cause.Error()+": nothing was created", ErrTypeHostUnreachable, cause)
	}
	return cause
}

// cleanUpAfter starts the delete path for a spawn that failed after its
// record existed, then returns the original error. The child delete is
// abandoned on close: it must finish even though this workflow is failing.
// A delete already running for the instance counts as started.
func (w *Workflows) cleanUpAfter(ctx workflow.Context, t *tracker, req *vmflowv1.SpawnRequest, cause error) error {
	t.status.LastError = errorText(cause)
	t.stage(ctx, StageSpawnFailed)
	del := &vmflowv1.DeleteRequest{InstanceId: req.GetInstanceId(), HostId: req.GetHostId()}
	cctx := workflow.WithChildOptions(ctx, workflow.ChildWorkflowOptions{
		WorkflowID:            DeleteWorkflowID(req.GetInstanceId()),
		ParentClosePolicy:     enumspb.PARENT_CLOSE_POLICY_ABANDON,
		WorkflowIDReusePolicy: enumspb.WORKFLOW_ID_REUSE_POLICY_ALLOW_DUPLICATE,
		StaticSummary:         deleteSummary(del) + " (spawn failed)",
	})
	var exec workflow.Execution
	err := workflow.ExecuteChildWorkflow(cctx, DeleteWorkflow, del).GetChildWorkflowExecution().Get(ctx, &exec)
	switch {
	case err == nil:
		t.logger.Info("delete path started", "workflow_id", exec.ID, "run_id", exec.RunID)
	case temporal.IsWorkflowExecutionAlreadyStartedError(err):
		t.logger.Info("delete path already running", "workflow_id", DeleteWorkflowID(req.GetInstanceId()))
	default:
		t.logger.Error("could not start the delete path", "error", err.Error())
		return temporal.NewNonRetryableApplicationError(
			"spawn failed ("+errorText(cause)+") and its delete path could not start ("+err.Error()+"): start "+DeleteWorkflow+" "+DeleteWorkflowID(req.GetInstanceId())+" by hand",
			errorType(cause), cause)
	}
	return cause
}
