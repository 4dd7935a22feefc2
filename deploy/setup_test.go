package deploy_test

import (
	"context"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/api/operatorservice/v1"

	"vmflow/internal/tclient"
	"vmflow/testsupport/devserver"
)

// cliEnv is the environment for scripts and runbook lines that run the
// temporal CLI against srv: the bin folder first in PATH, the connection in
// the TEMPORAL_* variables (as in production), and no config file, so a
// developer's profile cannot send the commands elsewhere.
func cliEnv(t *testing.T, srv devserver.Temporal, namespace string) []string {
	t.Helper()
	return append(os.Environ(),
		"PATH="+filepath.Dir(srv.BinaryPath())+string(os.PathListSeparator)+os.Getenv("PATH"),
		"TEMPORAL="+srv.BinaryPath(),
		"TEMPORAL_ADDRESS="+srv.Address(),
		"TEMPORAL_NAMESPACE="+namespace,
		"TEMPORAL_CONFIG_FILE="+filepath.Join(t.TempDir(), "none.toml"),
	)
}

// setup-temporal.sh creates a missing namespace and the four search
// attributes, and a second run changes nothing and succeeds; on the dev
// server's default namespace (attributes already there) it succeeds too.
// On the self-hosted server on PostgreSQL, started bare (no namespace at
// all, as after deploy/temporal/setup-postgres.sh), it creates "default"
// too: the production path.
func TestSetupTemporalScript(t *testing.T) {
	t.Run("dev", func(t *testing.T) {
		srv := devserver.Start(t, devserver.Options{})
		checkSetupScript(t, srv, map[string]bool{"vmflow-setup-test": true, "default": false})
	})
	t.Run("postgres", func(t *testing.T) {
		srv := devserver.StartPostgres(t, devserver.PostgresOptions{NoSetup: true})
		checkSetupScript(t, srv, map[string]bool{"vmflow-setup-test": true, "default": true})
	})
}

// checkSetupScript runs setup-temporal.sh twice for each namespace, which
// the first run must create when created[ns], and checks the attributes.
func checkSetupScript(t *testing.T, srv devserver.Temporal, created map[string]bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := srv.Client(t)
	for _, ns := range slices.Sorted(maps.Keys(created)) {
		for run := 1; run <= 2; run++ {
			cmd := exec.CommandContext(ctx, "bash", "setup-temporal.sh")
			cmd.Env = cliEnv(t, srv, ns)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "namespace %s, run %d:\n%s", ns, run, out)
			assert.Contains(t, string(out), "namespace "+ns+" ready for vmflow")
			if run == 1 && created[ns] {
				assert.Contains(t, string(out), "creating namespace "+ns)
			} else {
				assert.Contains(t, string(out), "namespace "+ns+" exists")
			}
		}
		resp, err := c.OperatorService().ListSearchAttributes(ctx, &operatorservice.ListSearchAttributesRequest{Namespace: ns})
		require.NoError(t, err)
		for name, typ := range tclient.SearchAttributes() {
			assert.Equal(t, typ, resp.GetCustomAttributes()[name], "namespace %s: search attribute %s", ns, name)
		}
	}
}

// A connection the script cannot make fails it; it never "creates" a
// namespace on an error that is not "not found".
func TestSetupTemporalScriptFailsWithoutServer(t *testing.T) {
	bin := devserver.RequireBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "setup-temporal.sh")
	cmd.Env = append(os.Environ(), "TEMPORAL="+bin, "TEMPORAL_ADDRESS=127.0.0.1:1",
		"TEMPORAL_CONFIG_FILE="+filepath.Join(t.TempDir(), "none.toml"))
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "%s", out)
	assert.Contains(t, string(out), "cannot describe namespace")
	assert.NotContains(t, string(out), "creating namespace")
}
