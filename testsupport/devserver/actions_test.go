package devserver

import (
	"testing"

	"github.com/stretchr/testify/assert"
	commonpb "go.temporal.io/api/common/v1"
	enumspb "go.temporal.io/api/enums/v1"
	historypb "go.temporal.io/api/history/v1"
)

func TestParseActions(t *testing.T) {
	text := `# HELP action action counter
# TYPE action counter
action{action_type="grpc_StartWorkflowExecution",namespace="temporal_system",operation="StartWorkflowExecution",service_name="frontend"} 2
action{action_type="grpc_StartWorkflowExecution",namespace="default",operation="StartWorkflowExecution",service_name="frontend"} 3
action{action_type="command_ScheduleActivityTask",namespace="default",operation="RespondWorkflowTaskCompleted",service_name="history"} 7
actions_other{namespace="default"} 9
`
	assert.Equal(t, map[string]float64{"grpc_StartWorkflowExecution": 3, "command_ScheduleActivityTask": 7}, parseActions(text, "default"))
	assert.Equal(t, map[string]float64{"grpc_StartWorkflowExecution": 5, "command_ScheduleActivityTask": 7}, parseActions(text, ""))
}

func TestBilledActions(t *testing.T) {
	ev := func(typ enumspb.EventType) *historypb.HistoryEvent { return &historypb.HistoryEvent{EventType: typ} }
	started := ev(enumspb.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
	started.Attributes = &historypb.HistoryEvent_WorkflowExecutionStartedEventAttributes{WorkflowExecutionStartedEventAttributes: &historypb.WorkflowExecutionStartedEventAttributes{
		SearchAttributes: &commonpb.SearchAttributes{IndexedFields: map[string]*commonpb.Payload{"TemporalScheduledById": {}}},
	}}
	retried := ev(enumspb.EVENT_TYPE_ACTIVITY_TASK_STARTED)
	retried.Attributes = &historypb.HistoryEvent_ActivityTaskStartedEventAttributes{ActivityTaskStartedEventAttributes: &historypb.ActivityTaskStartedEventAttributes{Attempt: 3}}
	marker := func(name string) *historypb.HistoryEvent {
		e := ev(enumspb.EVENT_TYPE_MARKER_RECORDED)
		e.Attributes = &historypb.HistoryEvent_MarkerRecordedEventAttributes{MarkerRecordedEventAttributes: &historypb.MarkerRecordedEventAttributes{MarkerName: name}}
		return e
	}
	upsert := func(names ...string) *historypb.HistoryEvent {
		e := ev(enumspb.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES)
		f := map[string]*commonpb.Payload{}
		for _, n := range names {
			f[n] = &commonpb.Payload{}
		}
		e.Attributes = &historypb.HistoryEvent_UpsertWorkflowSearchAttributesEventAttributes{UpsertWorkflowSearchAttributesEventAttributes: &historypb.UpsertWorkflowSearchAttributesEventAttributes{
			SearchAttributes: &commonpb.SearchAttributes{IndexedFields: f}}}
		return e
	}
	n := BilledActions([]*historypb.HistoryEvent{
		started, ev(enumspb.EVENT_TYPE_WORKFLOW_TASK_COMPLETED), ev(enumspb.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED), retried,
		upsert("VmStage", "VmNeedsAttention"), marker("Version"), upsert("TemporalChangeVersion"), marker("SideEffect"),
		ev(enumspb.EVENT_TYPE_TIMER_STARTED),
	})
	assert.Equal(t, map[string]int{"workflow-started": 1, "schedule-action": 1, "activity-attempt": 3, "search-attribute-upsert": 1,
		"change-version-upsert (not billed)": 1, "side-effect": 1, "timer": 1}, n)
	assert.Equal(t, 8, Sum(n))
}
