package workflows

import (
	"testing"

	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/converter"
	"go.temporal.io/sdk/worker"
)

func converterFor(*testing.T) converter.DataConverter { return converter.GetDefaultDataConverter() }

// startStack runs vmflow's workflows (with cfg) on queue and host's
// activities on hostID's queue, both against c, until the test ends, and
// returns the typed client for queue: the real-server tests' one setup.
func startStack(t *testing.T, c client.Client, queue string, cfg Config, hostID string, host any) *Client {
	t.Helper()
	w := worker.New(c, queue, worker.Options{})
	New(cfg).Register(w)
	require.NoError(t, w.Start())
	t.Cleanup(w.Stop)
	hw := worker.New(c, HostTaskQueue(hostID), worker.Options{})
	RegisterHostActivities(hw, host)
	require.NoError(t, hw.Start())
	t.Cleanup(hw.Stop)
	return NewClient(c, queue)
}
