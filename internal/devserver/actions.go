package devserver

import (
	"context"
	"fmt"

	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/sdk/client"
)

// BilledActions counts a history's actions the way Temporal Cloud bills
// them (docs.temporal.io/cloud/actions), by kind: workflow started (plus
// the schedule action when a Schedule started it), activity attempt,
// timer, signal, update, search-attribute upsert, continue-as-new, child
// start, local-activity marker. Two billed kinds leave no event, so they
// are not here: activity heartbeats that reach the server, and queries.
func BilledActions(events []*historypb.HistoryEvent) map[string]int {
	out := map[string]int{}
	for _, e := range events {
		switch e.GetEventType() {
		case enumspb.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
			out["workflow-started"]++
			if _, ok := e.GetWorkflowExecutionStartedEventAttributes().GetSearchAttributes().GetIndexedFields()["TemporalScheduledById"]; ok {
				out["schedule-action"]++
			}
		case enumspb.EVENT_TYPE_ACTIVITY_TASK_STARTED:
			// One event per activity, written when it ends; its attempt
			// says how many attempts ran.
			out["activity-attempt"] += int(max(e.GetActivityTaskStartedEventAttributes().GetAttempt(), 1))
		case enumspb.EVENT_TYPE_TIMER_STARTED:
			out["timer"]++
		case enumspb.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
			out["signal"]++
		case enumspb.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
			out["update"]++
		case enumspb.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
			out["search-attribute-upsert"]++
		case enumspb.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
			out["continue-as-new"]++
		case enumspb.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
			out["child-start"]++
		case enumspb.EVENT_TYPE_MARKER_RECORDED:
			if e.GetMarkerRecordedEventAttributes().GetMarkerName() == "LocalActivity" {
				out["local-activity"]++
			}
		}
	}
	return out
}

// Sum adds up a BilledActions count.
func Sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// History returns one run's whole history (runID "" is the latest run).
func History(ctx context.Context, c client.Client, workflowID, runID string) ([]*historypb.HistoryEvent, error) {
	it := c.GetWorkflowHistory(ctx, workflowID, runID, false, enumspb.HISTORY_EVENT_FILTER_TYPE_ALL_EVENT)
	var events []*historypb.HistoryEvent
	for it.HasNext() {
		e, err := it.Next()
		if err != nil {
			return nil, fmt.Errorf("history of %s: %w", workflowID, err)
		}
		events = append(events, e)
	}
	return events, nil
}
