package worker

import (
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/workflows"
)

func TestParseConfigDefaults(t *testing.T) {
	c, err := ParseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, workflows.DefaultTaskQueue, c.TaskQueue)
	assert.Equal(t, workflows.Config{}.WithDefaults().ReleaseBackoff, c.Workflows.ReleaseBackoff)
	assert.Equal(t, workflows.Config{}.WithDefaults().SpawnHostWait, c.Workflows.SpawnHostWait)
	assert.Equal(t, 5*time.Minute, c.Workflows.DeleteStuckAfter)
}

func TestParseConfigFlags(t *testing.T) {
	c, err := ParseFlags([]string{"--task-queue", "q2", "--release-backoff", "1s", "--release-backoff-max", "4s", "--metrics-addr", "127.0.0.1:0", "--delete-stuck-after", "90s"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "q2", c.TaskQueue)
	assert.Equal(t, time.Second, c.Workflows.ReleaseBackoff)
	assert.Equal(t, 4*time.Second, c.Workflows.ReleaseBackoffMax)
	assert.Equal(t, "127.0.0.1:0", c.MetricsAddr)
	assert.Equal(t, 90*time.Second, c.Workflows.DeleteStuckAfter)
}

func TestParseConfigRejects(t *testing.T) {
	for _, args := range [][]string{
		{"--task-queue", ""},
		{"--release-backoff", "0s"},
		{"--release-backoff", "-1s"},
		{"--release-backoff", "10m", "--release-backoff-max", "1m"},
		{"--spawn-host-wait", "0"},
		{"--delete-stuck-after", "0"},
		{"--delete-stuck-after", "500ms"},
		{"extra"},
		{"--no-such-flag"},
	} {
		_, err := ParseFlags(args, io.Discard)
		assert.Error(t, err, "%q", args)
	}
}

// Versioning is off unless asked for (the e2e harness, `make dev` and a
// worker run by hand poll unversioned and get tasks at once); with it, the
// deployment defaults to "vmflow" and the build id to the stamped version,
// and an unstamped build must name its build id.
func TestParseConfigVersioning(t *testing.T) {
	c, err := ParseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.False(t, c.Versioning)
	assert.Zero(t, workerOptions(c).DeploymentOptions, "an unversioned worker sends no deployment options")
	assert.Equal(t, "vmflow", c.Deployment.DeploymentName)

	c, err = ParseFlags([]string{"--versioning", "--build-id", "v1.2.3-4-gabcdef0"}, io.Discard)
	require.NoError(t, err)
	o := workerOptions(c).DeploymentOptions
	assert.True(t, o.UseVersioning)
	assert.Equal(t, "vmflow", o.Version.DeploymentName)
	assert.Equal(t, "v1.2.3-4-gabcdef0", o.Version.BuildID)

	c, err = ParseFlags([]string{"--versioning", "--deployment-name", "vmflow-eu", "--build-id", "b7"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "vmflow-eu", workerOptions(c).DeploymentOptions.Version.DeploymentName)

	for _, args := range [][]string{
		{"--versioning"}, // a test binary is unstamped: "dev"
		{"--versioning", "--build-id", "dev"},
		{"--versioning", "--build-id", "v1.2.0-3-gabcdef0-dirty"}, // uncommitted: not one build
		{"--versioning", "--build-id", ""},
		{"--versioning", "--build-id", "b1", "--deployment-name", ""},
		{"--versioning", "--build-id", "b1", "--deployment-name", "vm.flow"},
	} {
		_, err := ParseFlags(args, io.Discard)
		assert.Error(t, err, "%q", args)
	}
}
