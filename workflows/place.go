package workflows

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/workflow"
	"google.golang.org/protobuf/proto"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Placement: a spawn without a host reads the fleet view (the local
// activity ChooseHosts: the hosts' published views, scored, the hosts
// without a poller left out; its marker rides in the workflow task that
// records the version marker, so it costs no action of its own), then
// asks the candidates for a grant one after the other. The grant is the
// host's CreateRecord, under its admission lock: the record written with
// its reservation, or a refusal that writes nothing. It gets its own short
// ScheduleToStart and one attempt, so a refusal, a draining host or an
// agent that does not pick it up sends the spawn to the next candidate at
// once. When every candidate of a read refused, the view is read again
// without the hosts asked, up to placementRounds times; then the spawn
// fails NoFleetCapacity naming what it asked and the fleet's best offer.
//
// Once granted, the host is the spawn's as if named (VmHostId set: one
// upsert), and the rest of the spawn runs as before.

// placementRounds bounds the reads of the view in one placement. A
// constant: it decides which commands follow.
const placementRounds = 3

// grantOutcome is what one grant ended in.
type grantOutcome int

const (
	granted      grantOutcome = iota
	grantRefused              // the host said no and wrote nothing
	notTaken                  // no agent picked the grant up in time: nothing ran
	lost                      // the agent took it and its answer was lost: it may have written the record
	notOurs                   // a record of the instance there is not this spawn's
)

// grantRefusals are the types a host answers a grant with when it wrote
// nothing and another host may say yes (Unavailable: its ledger cannot
// read a record, so it promises nothing). An error of no class
// (HostError) may come after the record's write: a lost grant.
var grantRefusals = []string{
	ErrTypeNoHostCapacity, ErrTypeNoCapacity, ErrTypeHostDraining, ErrTypeInvalidInput, ErrTypeAdmissionRefused,
	ErrTypeVGPUUnavailable, ErrTypeHostMisconfigured, ErrTypeUnavailable,
}

// place chooses a host for req and has it grant the spawn, filling
// created. named: an earlier spawn of the instance was placed on host and
// its record may still be there, so the caller runs the named path on it
// (created is not filled). An error has ended the spawn (spawn-failed).
func (w *Workflows) place(ctx workflow.Context, t *tracker, req *vmflowv1.SpawnRequest, created *vmflowv1.CreateRecordResult) (host string, named bool, err error) {
	t.stage(ctx, StagePlacing)
	var asked []string
	var last *vmflowv1.ChooseHostsResult
	invalid := 0 // refusals that say the request itself is wrong
	var invalidErr error
	for round := 1; round <= placementRounds; round++ {
		choice, err := w.chooseHosts(ctx, req, asked)
		if err != nil {
			return "", false, w.spawnFailed(ctx, t, temporal.NewApplicationErrorWithOptions(
				"placement: the fleet view could not be read: "+errorText(err), ErrTypeUnavailable,
				temporal.ApplicationErrorOptions{NonRetryable: true, Cause: err}))
		}
		last = choice
		if p := choice.GetPreviousHost(); p != "" {
			t.logger.Info("placed where an earlier spawn of the instance was", "host_id", p)
			t.placed(ctx, p)
			return p, true, nil
		}
		if len(choice.GetCandidates()) == 0 {
			break
		}
		for _, c := range choice.GetCandidates() {
			host := c.GetHostId()
			asked = append(asked, host)
			out, gerr := w.grant(ctx, t, req, host, created)
			switch out {
			case granted:
				t.logger.Info("placed", "host_id", host, "score", c.GetScore(), "why", c.GetWhy(), "hosts_tried", len(asked)-1)
				t.placed(ctx, host)
				return host, false, nil
			case notOurs:
				t.placed(ctx, host)
				return "", false, w.spawnFailed(ctx, t, gerr)
			case lost:
				t.tried(ctx, host, "took the grant and was not heard from ("+errorText(gerr)+"): cleaning up there")
				if cerr := w.startCleanUp(ctx, t, req.GetInstanceId(), host, LostGrantDeleteWorkflowID(req.GetInstanceId(), host), "lost grant"); cerr != nil {
					// Nothing to move on with: a record may stay there.
					t.placed(ctx, host)
					return "", false, w.spawnFailed(ctx, t, temporal.NewNonRetryableApplicationError(
						"placement: the grant on "+host+" was lost ("+errorText(gerr)+") and "+cerr.Error(), ErrTypeHostUnreachable, gerr))
				}
			case notTaken:
				t.tried(ctx, host, fmt.Sprintf("did not pick up within %s", w.cfg.PlacementScheduleToStart))
			case grantRefused:
				if errorType(gerr) == ErrTypeInvalidInput {
					invalid++
					invalidErr = gerr
				}
				t.tried(ctx, host, errorText(gerr))
			}
		}
	}
	if invalid > 0 && invalid == len(asked) {
		// Every host said the request itself is wrong: that is the answer.
		return "", false, w.spawnFailed(ctx, t, invalidErr)
	}
	return "", false, w.spawnFailed(ctx, t, noFleetCapacity(last, t.status.GetHostsTried()))
}

// noFleetCapacity is the spawn's failure when no host granted it.
func noFleetCapacity(last *vmflowv1.ChooseHostsResult, tried []string) error {
	msg := last.GetAsk() + ": no host has them"
	if best := last.GetFleetBest(); best != "" {
		msg += "; " + best
	}
	msg += fmt.Sprintf(" (%d of %d hosts fit by their views", last.GetHostsFit(), last.GetHostsSeen())
	if len(tried) > 0 {
		msg += "; asked: " + strings.Join(tried, "; ")
	}
	return temporal.NewNonRetryableApplicationError(msg+")", ErrTypeNoFleetCapacity, nil)
}

// chooseHosts runs ChooseHosts. Its marker records the answer, so a
// replay decides the same whatever the view says then.
func (w *Workflows) chooseHosts(ctx workflow.Context, req *vmflowv1.SpawnRequest, exclude []string) (*vmflowv1.ChooseHostsResult, error) {
	lctx := withFleetLookup(ctx)
	in := &vmflowv1.ChooseHostsRequest{Spawn: req, Exclude: slices.Clone(exclude), K: uint32(w.cfg.PlacementCandidates),
		RunId: workflow.GetInfo(ctx).WorkflowExecution.RunID, TaskQueue: workflow.GetInfo(ctx).TaskQueueName}
	var out vmflowv1.ChooseHostsResult
	if err := workflow.ExecuteLocalActivity(lctx, LocalActivityChooseHosts, in).Get(ctx, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// withFleetLookup is ctx for placement's local activities (reads of
// visibility and the task queues): seconds each, a few tries, then the
// workflow fails saying the fleet could not be read.
func withFleetLookup(ctx workflow.Context) workflow.Context {
	return workflow.WithLocalActivityOptions(ctx, workflow.LocalActivityOptions{
		ScheduleToCloseTimeout: 30 * time.Second,
		StartToCloseTimeout:    10 * time.Second,
		RetryPolicy:            &temporal.RetryPolicy{InitialInterval: 500 * time.Millisecond, BackoffCoefficient: 2, MaximumAttempts: 4},
	})
}

// grant asks host to create the spawn's record with its reservation: one
// attempt, picked up within PlacementScheduleToStart or passed over.
func (w *Workflows) grant(ctx workflow.Context, t *tracker, req *vmflowv1.SpawnRequest, host string, created *vmflowv1.CreateRecordResult) (grantOutcome, error) {
	c := w.calls()[ActivityCreateRecord]
	actx := workflow.WithActivityOptions(ctx, workflow.ActivityOptions{
		TaskQueue:              HostTaskQueue(host),
		ScheduleToStartTimeout: w.cfg.PlacementScheduleToStart,
		StartToCloseTimeout:    c.timeout,
		RetryPolicy:            &temporal.RetryPolicy{MaximumAttempts: 1},
		Summary:                fmt.Sprintf("grant %s on %s", t.instanceID, host),
	})
	// The host admits the request as one for itself.
	in := proto.CloneOf(req)
	in.HostId, in.PlacementGrant = host, true
	err := workflow.ExecuteActivity(actx, ActivityCreateRecord, in).Get(ctx, created)
	switch {
	case err == nil:
		return granted, nil
	case isScheduleToStart(err):
		return notTaken, err
	case slices.Contains(grantRefusals, errorType(err)):
		return grantRefused, err
	case recordNotOurs(err):
		return notOurs, err
	}
	return lost, err
}

// placed makes host the spawn's: the status and logs name it, and one
// upsert sets VmHostId (with the stage, so both are exact).
func (t *tracker) placed(ctx workflow.Context, host string) {
	t.hostID, t.status.HostId = host, host
	t.logger = t.baseLogger("host_id", host)
	workflow.SetCurrentDetails(ctx, t.details())
	if err := workflow.UpsertTypedSearchAttributes(ctx, SAHostID.ValueSet(host), SAStage.ValueSet(t.status.GetStage()),
		SANeedsAttention.ValueSet(t.status.GetNeedsAttention())); err != nil {
		t.logger.Warn("upsert search attributes failed", "error", err.Error())
		return
	}
	t.upserted, t.sentStage, t.sentNeeds = true, t.status.GetStage(), t.status.GetNeedsAttention()
}

// tried records a host a placing spawn asked and why it moved on.
func (t *tracker) tried(ctx workflow.Context, host, why string) {
	t.status.HostsTried = append(t.status.HostsTried, host+": "+why)
	t.logger.Info("placement moved on", "asked_host_id", host, "why", why)
	workflow.SetCurrentDetails(ctx, t.details())
}
