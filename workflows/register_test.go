package workflows

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"go.temporal.io/sdk/workflow"
)

type recordingRegistry map[string]workflow.VersioningBehavior

func (r recordingRegistry) RegisterWorkflowWithOptions(_ interface{}, o workflow.RegisterOptions) {
	r[o.Name] = o.VersioningBehavior
}

// Every workflow has a versioning behaviour (a versioned worker refuses one
// without), and the behaviour the rollout relies on: a spawn finishes on
// its build, a delete, reconcile or host view moves to the current one.
func TestRegisterVersioningBehaviors(t *testing.T) {
	r := recordingRegistry{}
	New(Config{}).Register(r)
	assert.Equal(t, recordingRegistry{
		SpawnWorkflow:     workflow.VersioningBehaviorPinned,
		DeleteWorkflow:    workflow.VersioningBehaviorAutoUpgrade,
		ReconcileWorkflow: workflow.VersioningBehaviorAutoUpgrade,
		FleetHostWorkflow: workflow.VersioningBehaviorAutoUpgrade,
	}, r)
	assert.Len(t, r, len(WorkflowNames))
}
