package devserver

import (
	"context"
	"fmt"
	"strings"

	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/sdk/client"
)

// BilledActions counts a history's actions by kind as Temporal Cloud bills them
// (docs.temporal.io/cloud/actions). Kinds that leave no event (heartbeats,
// queries, rejected updates) are missing; exempt ones go under "(not billed)"
// keys, which Sum skips.
func BilledActions(events []*historypb.HistoryEvent) map[string]int {
	out := map[string]int{}
	for _, e := range events {
		switch e.GetEventType() {
		case enumspb.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
			// Continue-as-new and child starts show as the new run's start.
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
			// The SDK's upsert of TemporalChangeVersion (GetVersion's) is
			// exempt.
			f := e.GetUpsertWorkflowSearchAttributesEventAttributes().GetSearchAttributes().GetIndexedFields()
			if _, ok := f["TemporalChangeVersion"]; ok && len(f) == 1 {
				out["change-version-upsert (not billed)"]++
				continue
			}
			out["search-attribute-upsert"]++
		case enumspb.EVENT_TYPE_MARKER_RECORDED:
			// Version markers are not billed.
			switch e.GetMarkerRecordedEventAttributes().GetMarkerName() {
			case "LocalActivity":
				out["local-activity"]++
			case "SideEffect", "MutableSideEffect":
				out["side-effect"]++
			}
		}
	}
	return out
}

// Sum adds up a BilledActions count.
func Sum(m map[string]int) int {
	n := 0
	for k, v := range m {
		if !strings.HasSuffix(k, "(not billed)") {
			n += v
		}
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
