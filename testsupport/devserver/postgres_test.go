package devserver

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/temporal"
	"go.temporal.io/sdk/worker"
	"go.temporal.io/sdk/workflow"

	"vmflow/internal/contract"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// upsertStage sets VmStage (a search attribute setup-temporal.sh registered)
// and returns.
func upsertStage(ctx workflow.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.SpawnResult, error) {
	key := temporal.NewSearchAttributeKeyKeyword(contract.SAStage)
	if err := workflow.UpsertTypedSearchAttributes(ctx, key.ValueSet("pg-"+req.GetInstanceId())); err != nil {
		return nil, err
	}
	return &vmflowv1.SpawnResult{QmpSocket: req.GetInstanceId()}, nil
}

// The PostgreSQL backend: initdb, the schemas (deploy/temporal/setup-
// postgres.sh), the server from deploy/temporal/postgresql.yaml, the
// namespace and search attributes (deploy/setup-temporal.sh). A workflow
// runs and upserts a search attribute that a visibility query on
// PostgreSQL finds; Stop leaves no process of either.
func TestPostgresBackend(t *testing.T) {
	begin := time.Now()
	s := StartPostgres(t, PostgresOptions{})
	t.Logf("postgres backend ready in %s on %s (temporal-server pid %d, postmaster pid %d)",
		time.Since(begin).Round(time.Millisecond), s.Address(), s.ServerPid(), s.PostgresPid())
	var srv Temporal = s
	assert.Equal(t, "postgres", srv.Backend())

	c := s.Client(t)
	w := worker.New(c, "pg-test", worker.Options{})
	w.RegisterWorkflowWithOptions(upsertStage, workflow.RegisterOptions{Name: "UpsertStage"})
	require.NoError(t, w.Start())
	t.Cleanup(w.Stop)

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	run, err := c.ExecuteWorkflow(ctx, client.StartWorkflowOptions{ID: "pg/1", TaskQueue: "pg-test"},
		"UpsertStage", &vmflowv1.SpawnRequest{InstanceId: "vm1"})
	require.NoError(t, err)
	var res *vmflowv1.SpawnResult
	require.NoError(t, run.Get(ctx, &res))
	assert.Equal(t, "vm1", res.GetQmpSocket())

	// Visibility on PostgreSQL is eventually consistent: wait for the row.
	eventually(t, 30*time.Second, "visibility query by VmStage", func() error {
		out, err := s.CLI(ctx, "workflow", "list", "--query", contract.SAStage+"='pg-vm1'")
		if err != nil {
			return err
		}
		if !strings.Contains(string(out), "pg/1") {
			return fmt.Errorf("not listed yet:\n%s", out)
		}
		return nil
	})

	// setup-postgres.sh runs on every deploy: again on a live cluster, it
	// changes nothing the server needs.
	require.NoError(t, s.setupDatabases(ctx), "setup-postgres.sh is idempotent")
	_, err = c.DescribeWorkflow(ctx, "pg/1", "")
	require.NoError(t, err, "the workflow is still there after a second setup-postgres.sh")

	srvPid, pgPid := s.ServerPid(), s.PostgresPid()
	require.NoError(t, s.Stop())
	for _, pid := range []int{srvPid, pgPid} {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
		assert.True(t, os.IsNotExist(err), "pid %d gone after Stop", pid)
	}
	require.NoError(t, s.Stop(), "stopping twice is fine")
}
