package workflows

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/worker"

	"vmflow/platform"
)

// TestReplayRecordedHistories replays histories recorded from real runs on
// the dev server (temporal workflow show --output json) against the current
// workflow code: a change that breaks determinism fails here, before it
// reaches workers with running workflows. Record new ones with
// `temporal workflow show --workflow-id ID --output json > testdata/NAME.json`.
func TestReplayRecordedHistories(t *testing.T) {
	files, err := filepath.Glob("testdata/*.json")
	require.NoError(t, err)
	require.NotEmpty(t, files, "no recorded histories in testdata/")
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			r, err := worker.NewWorkflowReplayerWithOptions(worker.WorkflowReplayerOptions{DataConverter: platform.DataConverter()})
			require.NoError(t, err)
			New(Config{}).Register(r)
			require.NoError(t, r.ReplayWorkflowHistoryFromJSONFile(nil, f))
		})
	}
}
