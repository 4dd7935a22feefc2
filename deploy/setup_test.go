package deploy_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/api/operatorservice/v1"

	"vmflow/internal/devserver"
	"vmflow/internal/tclient"
)

// cliEnv is the environment for scripts and runbook lines that run the
// temporal CLI against srv: the bin folder first in PATH, the connection in
// the TEMPORAL_* variables (as in production), and no config file, so a
// developer's profile cannot send the commands elsewhere.
func cliEnv(t *testing.T, srv *devserver.Server, namespace string) []string {
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
func TestSetupTemporalScript(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := srv.Client(t)

	for _, ns := range []string{"vmflow-setup-test", "default"} {
		for run := 1; run <= 2; run++ {
			cmd := exec.CommandContext(ctx, "bash", "setup-temporal.sh")
			cmd.Env = cliEnv(t, srv, ns)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "namespace %s, run %d:\n%s", ns, run, out)
			assert.Contains(t, string(out), "namespace "+ns+" ready for vmflow")
			if ns != "default" {
				if run == 1 {
					assert.Contains(t, string(out), "creating namespace "+ns)
				} else {
					assert.Contains(t, string(out), "namespace "+ns+" exists")
				}
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
