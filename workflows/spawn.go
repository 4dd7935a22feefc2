package workflows

import (
	"errors"
	"fmt"

	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// SpawnInstance validates, records, claims a vGPU if asked and launches QEMU.
// Once it may have created the record, a failure starts a child delete limited
// to this spawn's record (invariant 9) that outlives it; a spawn finding
// another's instance starts nothing.
func (w *Workflows) SpawnInstance(ctx workflow.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.SpawnResult, error) {
	res, err := w.spawnInstance(ctx, req)
	awaitHandlers(ctx)
	return res, err
}

func (w *Workflows) spawnInstance(ctx workflow.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.SpawnResult, error) {
	if req == nil {
		return nil, invalidInput("empty spawn request")
	}
	if !ValidID(req.GetInstanceId()) {
		return nil, invalidInput("instance_id %q: must match %s", req.GetInstanceId(), idPattern)
	}
	if req.GetHostId() != "" && !ValidID(req.GetHostId()) {
		return nil, invalidInput("host_id %q: must match %s (or be empty: the fleet places the VM)", req.GetHostId(), idPattern)
	}
	// Runs recorded before lazy search attributes replay with one upsert
	// per stage; new runs also always take invariant 9's path, so they
	// record no second version marker (each costs a billed upsert).
	// Version 2: the claim is ClaimDevices (the lease engine's name).
	// Version 3: a spawn without a host is placed (place.go).
	// Version 4: a spawn to a named host creates its record and claims its
	// GPUs in one activity (PrepareSpawn: CreateRecord admits anyway, so no
	// ValidateSpawn before it), two round trips fewer.
	spawnVersion := workflow.GetVersion(ctx, changeLazySA, workflow.DefaultVersion, spawnVersionCombined)
	placing := req.GetHostId() == ""
	if placing && spawnVersion < 3 {
		// Runs recorded before placement failed here, before any command.
		return nil, invalidInput("host_id %q: must match %s", req.GetHostId(), idPattern)
	}
	lazy := spawnVersion >= 1
	first := StageValidating
	if placing {
		first = StagePlacing
	}
	var t *tracker
	var err error
	if lazy {
		t, err = newLazyTracker(ctx, "spawn", req.GetInstanceId(), req.GetHostId(), first)
	} else {
		t, err = newTracker(ctx, "spawn", req.GetInstanceId(), req.GetHostId())
	}
	if err != nil {
		return nil, err
	}
	h := &hostRunner{w: w, t: t, hostID: req.GetHostId(), giveUp: w.cfg.SpawnHostWait}
	calls := w.calls()

	var created vmflowv1.CreateRecordResult
	if placing {
		host, named, err := w.place(ctx, t, req, &created)
		if err != nil {
			return nil, err
		}
		// From here on the spawn is its host's, as if named.
		h.hostID, req.HostId = host, host
		if named {
			// An earlier spawn's record may be there: the host is this
			// spawn's as if named (it waits for the host, and finds the
			// record).
			if err := w.validateAndCreate(ctx, t, h, req, &created, spawnVersion); err != nil {
				return nil, err
			}
		}
	} else if err := w.validateAndCreate(ctx, t, h, req, &created, spawnVersion); err != nil {
		return nil, err
	}
	t.setRetained(ctx, true)
	// Histories from before creators were recorded replay the old path:
	// their CreateRecord results carry no created_by_this_spawn.
	if (lazy || workflow.GetVersion(ctx, changeSpawnCreator, workflow.DefaultVersion, 1) >= 1) && !created.GetCreatedByThisSpawn() {
		return w.spawnFoundExisting(ctx, t, h, req, &created)
	}

	res := &vmflowv1.SpawnResult{InstanceUuid: created.GetInstanceUuid(), HostId: h.hostID}
	if claim := created.GetClaim(); claim != nil {
		// PrepareSpawn claimed already.
		res.VgpuUuid, res.VgpuDeviceId = claim.GetVgpuUuid(), claim.GetDeviceId()
		res.GpuDeviceIds = claim.GetDeviceIds()
		t.status.GpuDeviceIds = res.GpuDeviceIds
	} else if asksGPUs(req) {
		claimStage := StageClaimingVGPU
		if spawnVersion >= 2 {
			claimStage = StageClaimingGPUs
		}
		t.stage(ctx, claimStage)
		var claim vmflowv1.ClaimVGPUResult
		in := claimRequest(req)
		claimCall := calls[ActivityClaimVGPU]
		if spawnVersion >= 2 {
			claimCall = calls[ActivityClaimDevices]
		}
		if err := h.run(ctx, claimCall, in, &claim); err != nil {
			return nil, w.cleanUpAfter(ctx, t, req, h.hostID, err)
		}
		res.VgpuUuid, res.VgpuDeviceId = claim.GetVgpuUuid(), claim.GetDeviceId()
		res.GpuDeviceIds = claim.GetDeviceIds()
		t.status.GpuDeviceIds = res.GpuDeviceIds // read by the status query; no action billed
	}

	t.stage(ctx, StageLaunching)
	var launched vmflowv1.LaunchVMResult
	if err := h.run(ctx, calls[ActivityLaunchVM], &vmflowv1.LaunchVMRequest{InstanceId: req.GetInstanceId()}, &launched); err != nil {
		return nil, w.cleanUpAfter(ctx, t, req, h.hostID, err)
	}
	res.Pid, res.QmpSocket = launched.GetPid(), launched.GetQmpSocket()
	res.Ip, res.Mac = launched.GetIp(), launched.GetMac()
	res.NumaNodes, res.Cpus = launched.GetNumaNodes(), launched.GetCpus()
	t.status.Ip, t.status.Mac = res.Ip, res.Mac
	t.stage(ctx, StageRunning)
	return res, nil
}

// validateAndCreate runs ValidateSpawn and CreateRecord on h's host, as a
// spawn to a named host does; from version 4 on, PrepareSpawn (the record
// and its claim) instead. An error has ended the spawn already
// (spawnFailed, or the clean-up started).
func (w *Workflows) validateAndCreate(ctx workflow.Context, t *tracker, h *hostRunner, req *vmflowv1.SpawnRequest, created *vmflowv1.CreateRecordResult, version workflow.Version) error {
	calls := w.calls()
	create := calls[ActivityCreateRecord]
	if version >= spawnVersionCombined {
		create = calls[ActivityPrepareSpawn]
	} else {
		t.stage(ctx, StageValidating)
		if err := h.run(ctx, calls[ActivityValidateSpawn], req, nil); err != nil {
			return w.spawnFailed(ctx, t, err)
		}
	}
	t.stage(ctx, StageCreatingRecord)
	if err := h.run(ctx, create, req, created); err != nil {
		// A failure that may follow this spawn's write of the record
		// is cleaned up whatever its type.
		if recordNotOurs(err) && !MayHaveCreatedRecord(err) {
			return w.spawnFailed(ctx, t, err)
		}
		// Whether an attempt of this spawn wrote the record is unknown
		// here; the clean-up's creator guard decides on the host.
		return w.cleanUpAfter(ctx, t, req, h.hostID, err)
	}
	return nil
}

// recordNotOurs: CreateRecord found a record that is not this spawn's (another
// spec, a delete owns it, or nobody can read it): deleting it would destroy
// someone else's VM.
func recordNotOurs(err error) bool {
	switch errorType(err) {
	case ErrTypeInvalidInput, ErrTypeConflict, ErrTypeInstanceDeleting, ErrTypeRecordUnreadable:
		return true
	}
	return false
}

// spawnVersionCombined is the changeLazySA version of spawns that create
// and claim in one activity (PrepareSpawn).
const spawnVersionCombined workflow.Version = 4

// changeSpawnCreator is the GetVersion change id of invariant 9's spawn
// path: a spawn that finds another spawn's record only reports it.
const changeSpawnCreator = "spawn-creator"

// spawnFoundExisting succeeds with another spawn's same-spec VM if it runs as
// asked, else fails with InstanceExists; it touches nothing (invariant 9).
func (w *Workflows) spawnFoundExisting(ctx workflow.Context, t *tracker, h *hostRunner, req *vmflowv1.SpawnRequest, created *vmflowv1.CreateRecordResult) (*vmflowv1.SpawnResult, error) {
	t.setRetained(ctx, false) // not this spawn's to keep or lose
	t.logger.Info("instance exists, created by another spawn", "created_by", created.GetCreatedBy())
	t.stage(ctx, StageLaunching)
	var found vmflowv1.LaunchVMResult
	in := &vmflowv1.LaunchVMRequest{InstanceId: req.GetInstanceId(), ExistingOnly: true}
	if err := h.run(ctx, w.calls()[ActivityLaunchVM], in, &found); err != nil {
		return nil, w.spawnFailed(ctx, t, err)
	}
	t.status.GpuDeviceIds, t.status.Ip, t.status.Mac = found.GetGpuDeviceIds(), found.GetIp(), found.GetMac()
	t.stage(ctx, StageRunning)
	return &vmflowv1.SpawnResult{
		HostId: h.hostID,
		Pid:    found.GetPid(), QmpSocket: found.GetQmpSocket(), VgpuUuid: found.GetVgpuUuid(),
		VgpuDeviceId: found.GetVgpuDeviceId(), InstanceUuid: created.GetInstanceUuid(), GpuDeviceIds: found.GetGpuDeviceIds(),
		Ip: found.GetIp(), Mac: found.GetMac(), NumaNodes: found.GetNumaNodes(), Cpus: found.GetCpus(),
	}, nil
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

// cleanUpAfter starts the delete path for a spawn that failed after its record
// existed (abandoned on close, so it finishes) and returns the original error.
func (w *Workflows) cleanUpAfter(ctx workflow.Context, t *tracker, req *vmflowv1.SpawnRequest, hostID string, cause error) error {
	t.status.LastError = errorText(cause)
	t.stage(ctx, StageSpawnFailed)
	if err := w.startCleanUp(ctx, t, req.GetInstanceId(), hostID, DeleteWorkflowID(req.GetInstanceId()), "spawn failed"); err != nil {
		return temporal.NewNonRetryableApplicationError(
			"spawn failed ("+errorText(cause)+") and "+err.Error(), errorType(cause), cause)
	}
	if errors.Is(cause, errHostGaveUp) {
		return temporal.NewNonRetryableApplicationError(cause.Error()+": a delete of what this spawn made there waits for the host", ErrTypeHostUnreachable, cause)
	}
	return cause
}

// startCleanUp starts, as id, a delete on hostID of only the record this
// very spawn created (invariant 9: after a failed or lost CreateRecord
// nobody here knows whether it did, and the record may be a re-sent
// spawn's), abandoned on close so it finishes. An error says it could not
// start and what to start by hand.
func (w *Workflows) startCleanUp(ctx workflow.Context, t *tracker, instanceID, hostID, id, why string) error {
	self := workflow.GetInfo(ctx).WorkflowExecution
	del := &vmflowv1.DeleteRequest{
		InstanceId: instanceID, HostId: hostID,
		OnlyIfCreatedByWorkflowId: self.ID, OnlyIfCreatedByRunId: self.RunID,
	}
	cctx := workflow.WithChildOptions(ctx, workflow.ChildWorkflowOptions{
		WorkflowID:            id,
		ParentClosePolicy:     enumspb.PARENT_CLOSE_POLICY_ABANDON,
		WorkflowIDReusePolicy: enumspb.WORKFLOW_ID_REUSE_POLICY_ALLOW_DUPLICATE,
		StaticSummary:         deleteSummary(del) + " (" + why + ")",
	})
	var exec workflow.Execution
	err := workflow.ExecuteChildWorkflow(cctx, DeleteWorkflow, del).GetChildWorkflowExecution().Get(ctx, &exec)
	switch {
	case err == nil:
		t.logger.Info("delete path started", "workflow_id", exec.ID, "run_id", exec.RunID, "host_id", hostID)
	case temporal.IsWorkflowExecutionAlreadyStartedError(err):
		t.logger.Info("delete path already running", "workflow_id", id)
	default:
		t.logger.Error("could not start the delete path", "error", err.Error(), "workflow_id", id)
		return fmt.Errorf("its delete path could not start (%s): start %s %s with host_id %s by hand", err.Error(), DeleteWorkflow, id, hostID)
	}
	return nil
}
