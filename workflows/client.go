package workflows

import (
	"context"
	"errors"
	"fmt"
	"time"

	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"

	"vmflow/internal/contract"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Client is the typed client the platform API uses: it starts spawns and
// deletes under their fixed ids and conflict policies, signals retry and
// abandon, and queries status. It never talks to a host.
type Client struct {
	c         client.Client
	taskQueue string
}

// NewClient wraps c; taskQueue is the workflow worker's queue ("" means
// DefaultTaskQueue).
func NewClient(c client.Client, taskQueue string) *Client {
	if taskQueue == "" {
		taskQueue = DefaultTaskQueue
	}
	return &Client{c: c, taskQueue: taskQueue}
}

// ErrInvalidID is returned for an instance or host id that does not match
// the id pattern, before anything is sent.
var ErrInvalidID = errors.New("invalid id")

// ErrInvalidInput is returned for a request field out of its range.
var ErrInvalidInput = errors.New("invalid input")

// MaxGracefulTimeoutSeconds bounds DeleteRequest.graceful_timeout_seconds:
// contract.MaxGracefulTimeout, which the agent also caps at.
const MaxGracefulTimeoutSeconds = uint32(contract.MaxGracefulTimeout / time.Second)

// checkIDs checks an instance id and a host id, which may be empty (the
// fleet places a spawn, a delete finds the instance's host).
func checkIDs(instanceID, hostID string) error {
	if !ValidID(instanceID) {
		return fmt.Errorf("instance_id %q: %w: must match %s", instanceID, ErrInvalidID, idPattern)
	}
	if hostID != "" && !ValidID(hostID) {
		return fmt.Errorf("host_id %q: %w: must match %s or be empty", hostID, ErrInvalidID, idPattern)
	}
	return nil
}

// options sets at start (unbilled, unlike an upsert) the search attributes the
// first upsert would set, so a lazy tracker skips it (newTrackerSA).
func (c *Client) options(id, summary, instanceID, hostID, firstStage string) client.StartWorkflowOptions {
	sa := []temporal.SearchAttributeUpdate{SAInstanceID.ValueSet(instanceID), SAStage.ValueSet(firstStage), SANeedsAttention.ValueSet(false)}
	if hostID != "" {
		// Without one the workflow sets it once it knows the host.
		sa = append(sa, SAHostID.ValueSet(hostID))
	}
	return client.StartWorkflowOptions{
		ID:        id,
		TaskQueue: c.taskQueue,
		// A second start while one runs joins it; a finished one may be
		// started again (a re-spawn after a delete, a second delete).
		WorkflowIDConflictPolicy: enumspb.WORKFLOW_ID_CONFLICT_POLICY_USE_EXISTING,
		WorkflowIDReusePolicy:    enumspb.WORKFLOW_ID_REUSE_POLICY_ALLOW_DUPLICATE,
		StaticSummary:            summary,
		TypedSearchAttributes:    temporal.NewSearchAttributes(sa...),
	}
}

// StartSpawn starts SpawnInstance as spawn/<instance_id>, or joins the one
// already running. Without a host_id the fleet places it.
func (c *Client) StartSpawn(ctx context.Context, req *vmflowv1.SpawnRequest) (client.WorkflowRun, error) {
	if err := checkIDs(req.GetInstanceId(), req.GetHostId()); err != nil {
		return nil, err
	}
	summary, first := fmt.Sprintf("spawn %s on %s", req.GetInstanceId(), req.GetHostId()), StageValidating
	if req.GetHostId() == "" {
		summary, first = fmt.Sprintf("spawn %s (placed)", req.GetInstanceId()), StagePlacing
	}
	run, err := c.c.ExecuteWorkflow(ctx, c.options(SpawnWorkflowID(req.GetInstanceId()), summary, req.GetInstanceId(), req.GetHostId(), first), SpawnWorkflow, req)
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", SpawnWorkflowID(req.GetInstanceId()), err)
	}
	return run, nil
}

// StartDelete starts DeleteInstance as delete/<instance_id>, or joins the
// one already running.
func (c *Client) StartDelete(ctx context.Context, req *vmflowv1.DeleteRequest) (client.WorkflowRun, error) {
	if err := checkIDs(req.GetInstanceId(), req.GetHostId()); err != nil {
		return nil, err
	}
	// The host agent caps the wait at an hour anyway; a caller asking for
	// more has a bug worth hearing about.
	if g := req.GetGracefulTimeoutSeconds(); g > MaxGracefulTimeoutSeconds {
		return nil, fmt.Errorf("graceful_timeout_seconds %d: %w: at most %d", g, ErrInvalidInput, MaxGracefulTimeoutSeconds)
	}
	run, err := c.c.ExecuteWorkflow(ctx, c.options(DeleteWorkflowID(req.GetInstanceId()), deleteSummary(req), req.GetInstanceId(), req.GetHostId(), StageMarkingStopped), DeleteWorkflow, req)
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", DeleteWorkflowID(req.GetInstanceId()), err)
	}
	return run, nil
}

// Retry cuts a workflow's wait short with the retry update and returns its
// status once the next attempt is scheduled (at once, with a Note, while a try
// runs). In its last stage it refuses with an ErrTypeRefused application error.
func (c *Client) Retry(ctx context.Context, workflowID, reason string) (*vmflowv1.WorkflowStatus, error) {
	return c.update(ctx, workflowID, RetryUpdate, &vmflowv1.RetrySignal{Reason: reason})
}

// Abandon ends a delete whose host is gone for good and returns its final
// status; accepted only while it waits for an unreachable host or is parked.
func (c *Client) Abandon(ctx context.Context, instanceID, reason string) (*vmflowv1.WorkflowStatus, error) {
	if reason == "" {
		return nil, errors.New("abandon: a reason is required")
	}
	return c.update(ctx, DeleteWorkflowID(instanceID), AbandonUpdate, &vmflowv1.AbandonSignal{Reason: reason})
}

// UpdateTimeout bounds Retry and Abandon when the caller's context has no
// deadline: an update waits for a worker to run it, and with no worker
// polling (or, under Worker Versioning, no current build) it would wait for
// ever without a word.
const UpdateTimeout = 2 * time.Minute

// update runs a Workflow Update and waits for its result: operator actions
// answer synchronously, with the status or the workflow's refusal.
func (c *Client) update(ctx context.Context, workflowID, name string, arg any) (*vmflowv1.WorkflowStatus, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, UpdateTimeout)
		defer cancel()
	}
	h, err := c.c.UpdateWorkflow(ctx, client.UpdateWorkflowOptions{
		WorkflowID: workflowID, UpdateName: name, Args: []any{arg},
		WaitForStage: client.WorkflowUpdateStageCompleted,
	})
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", name, workflowID, err)
	}
	var st vmflowv1.WorkflowStatus
	if err := h.Get(ctx, &st); err != nil {
		return nil, fmt.Errorf("%s %s: %w", name, workflowID, err)
	}
	return &st, nil
}

// Status queries a workflow's status (any of the three).
func (c *Client) Status(ctx context.Context, workflowID string) (*vmflowv1.WorkflowStatus, error) {
	v, err := c.c.QueryWorkflow(ctx, workflowID, "", StatusQuery)
	if err != nil {
		return nil, fmt.Errorf("query %s of %s: %w", StatusQuery, workflowID, err)
	}
	var st vmflowv1.WorkflowStatus
	if err := v.Get(&st); err != nil {
		return nil, fmt.Errorf("decode %s of %s: %w", StatusQuery, workflowID, err)
	}
	return &st, nil
}
