package workflows

import (
	"context"
	"errors"
	"fmt"

	"go.temporal.io/sdk/activity"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"

	"vmflow/internal/heartbeat"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Combined activities: what spawn runs of changeLazySA version 4 and delete
// runs of versionStuckBound version 5 schedule instead of several host
// activities in a row. Each is the host's own activities called one after
// another in one attempt, so a round trip through the server (an activity
// task, its dispatch and the workflow task after it: a billed action and
// about 11 ms on the WAL dev server, BENCHMARKS.md section 3) buys the work
// of two or three. No durable step is lost: every step is a host-local
// write under the host's locks, idempotent, and a retried attempt redoes the
// steps the last one finished as no-ops; what the workflow decides from
// (created by this spawn, not owned, absent) comes back in the result as
// before. Hosts register them with RegisterHostActivities, so the agent and
// every test host combine them by this one definition.

// RegisterHostActivities registers h's activities under their method names
// and the combined ones made of them (CombinedActivities). Every host's
// registration goes through it: an agent without the combined activities
// would fail the new runs that schedule them (deploy agents before workers).
// h is a HostActivities (the agent's is checked at compile time) or a test
// host with part of its methods: a combined activity that needs a missing
// one fails without retry, naming it.
func RegisterHostActivities(r worker.ActivityRegistry, h any) {
	r.RegisterActivity(h)
	r.RegisterActivity(&CombinedActivities{Host: h})
}

// CombinedActivities are the combined host activities over Host's.
type CombinedActivities struct {
	Host any
}

// part is c.Host as the activity interface T, or a non-retryable error
// naming what the host lacks.
func part[T any](c *CombinedActivities, what string) (T, error) {
	h, ok := c.Host.(T)
	if !ok {
		return h, temporal.NewNonRetryableApplicationError(fmt.Sprintf("host activities %T have no %s", c.Host, what), ErrTypeHost, nil)
	}
	return h, nil
}

// The parts each combined activity calls.
type (
	recordCreator interface {
		CreateRecord(context.Context, *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error)
	}
	deviceClaimer interface {
		ClaimDevices(context.Context, *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error)
	}
	instanceStopper interface {
		BeginDelete(context.Context, *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error)
		StopVM(context.Context, *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error)
		WaitVMExit(context.Context, *vmflowv1.InstanceRef) error
	}
	instanceRemover interface {
		TearDown(context.Context, *vmflowv1.InstanceRef) error
		DeleteRecord(context.Context, *vmflowv1.InstanceRef) error
	}
)

// PrepareSpawn is CreateRecord and then, for a record this spawn created
// that asks for GPUs, ClaimDevices: the claim comes back in the result's
// claim. A failure that may follow this spawn's write of the record (the
// claim's, or any of a retried attempt's, as an earlier one may have
// written it) is marked (MayHaveCreatedRecord), so the workflow starts its
// guarded clean-up rather than reading an InvalidInput or a record found
// unreadable as "not this spawn's record": what separate activities told
// the history is not lost.
func (c *CombinedActivities) PrepareSpawn(ctx context.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error) {
	creator, err := part[recordCreator](c, "CreateRecord")
	if err != nil {
		return nil, err
	}
	created, err := creator.CreateRecord(ctx, req)
	if err != nil {
		if activity.IsActivity(ctx) && activity.GetInfo(ctx).Attempt > 1 {
			return nil, mayHaveCreated(err)
		}
		return nil, err
	}
	if !created.GetCreatedByThisSpawn() || !asksGPUs(req) {
		return created, nil
	}
	claimer, err := part[deviceClaimer](c, "ClaimDevices")
	if err != nil {
		return nil, mayHaveCreated(err)
	}
	claim, err := claimer.ClaimDevices(ctx, claimRequest(req))
	if err != nil {
		return nil, mayHaveCreated(err)
	}
	if claim == nil {
		claim = &vmflowv1.ClaimVGPUResult{} // set: the workflow claims no second time
	}
	created.Claim = claim
	return created, nil
}

// StopInstance is BeginDelete, then, when it began the delete, StopVM and
// WaitVMExit: it returns once the whole thread group is gone. The marker is
// on disk before any stop action, as in separate activities (invariant 6).
func (c *CombinedActivities) StopInstance(ctx context.Context, req *vmflowv1.StopInstanceRequest) (*vmflowv1.StopInstanceResult, error) {
	h, err := part[instanceStopper](c, "BeginDelete, StopVM or WaitVMExit")
	if err != nil {
		return nil, err
	}
	// BeginDelete waits for the instance's lock (a launch in progress holds
	// it): beat meanwhile, as StopVM and WaitVMExit do after it.
	stop := heartbeat.Every(ctx, heartbeat.Interval, func() string { return "beginning the delete of " + req.GetInstanceId() })
	begin, err := h.BeginDelete(ctx, &vmflowv1.BeginDeleteRequest{
		InstanceId:                req.GetInstanceId(),
		OnlyIfCreatedByWorkflowId: req.GetOnlyIfCreatedByWorkflowId(),
		OnlyIfCreatedByRunId:      req.GetOnlyIfCreatedByRunId(),
	})
	stop()
	if err != nil {
		return nil, err
	}
	res := &vmflowv1.StopInstanceResult{Begin: begin}
	if begin.GetAlreadyAbsent() || begin.GetNotOwned() {
		return res, nil
	}
	if res.Stop, err = h.StopVM(ctx, &vmflowv1.StopVMRequest{
		InstanceId: req.GetInstanceId(), GracefulTimeoutSeconds: req.GetGracefulTimeoutSeconds(),
	}); err != nil {
		return nil, err
	}
	if err := h.WaitVMExit(ctx, &vmflowv1.InstanceRef{InstanceId: req.GetInstanceId()}); err != nil {
		return nil, err
	}
	return res, nil
}

// RemoveInstance is TearDown then DeleteRecord: the runtime files, then the
// record, which the store refuses to delete while it holds a lease.
func (c *CombinedActivities) RemoveInstance(ctx context.Context, ref *vmflowv1.InstanceRef) error {
	h, err := part[instanceRemover](c, "TearDown or DeleteRecord")
	if err != nil {
		return err
	}
	if err := h.TearDown(ctx, ref); err != nil {
		return err
	}
	return h.DeleteRecord(ctx, ref)
}

// asksGPUs: the spawn asks for vGPUs or whole GPUs, so it claims.
func asksGPUs(req *vmflowv1.SpawnRequest) bool {
	return req.GetVgpuProfile() != "" || req.GetGpuPassthroughCount() > 0
}

// claimRequest is the claim a spawn request asks for.
func claimRequest(req *vmflowv1.SpawnRequest) *vmflowv1.ClaimVGPURequest {
	return &vmflowv1.ClaimVGPURequest{InstanceId: req.GetInstanceId(), VgpuProfile: req.GetVgpuProfile(), VgpuCount: req.GetVgpuCount(),
		GpuPassthroughCount: req.GetGpuPassthroughCount(), GpuPassthroughModel: req.GetGpuPassthroughModel()}
}

// recordMayExist is the detail of a PrepareSpawn failure that may follow
// this spawn's write of the record.
const recordMayExist = "the record may be this spawn's"

// mayHaveCreated is err with recordMayExist as its details: same message,
// type and retryability.
func mayHaveCreated(err error) error {
	msg, typ, nonRetryable := err.Error(), ErrTypeHost, false
	var appErr *temporal.ApplicationError
	if errors.As(err, &appErr) {
		msg, typ, nonRetryable = appErr.Message(), appErr.Type(), appErr.NonRetryable()
	}
	return temporal.NewApplicationErrorWithOptions(msg, typ, temporal.ApplicationErrorOptions{
		NonRetryable: nonRetryable, Details: []any{recordMayExist},
	})
}

// MayHaveCreatedRecord reports whether err is a PrepareSpawn failure that
// may follow this spawn's write of the record (mayHaveCreated).
func MayHaveCreatedRecord(err error) bool {
	var appErr *temporal.ApplicationError
	if !errors.As(err, &appErr) || !appErr.HasDetails() {
		return false
	}
	var detail string
	return appErr.Details(&detail) == nil && detail == recordMayExist
}
