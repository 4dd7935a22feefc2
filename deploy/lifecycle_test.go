package deploy_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/internal/service"
	"vmflow/testsupport/devserver"
	"vmflow/testsupport/stacktest"
)

// unitDuration parses the systemd time spans the units use ("30s", "5min").
func unitDuration(t *testing.T, v string) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(strings.ReplaceAll(v, "min", "m"))
	require.NoError(t, err, "time span %q", v)
	return d
}

// Both binaries let running work finish on SIGTERM for service.StopTimeout
// (their --stop-timeout default) and must exit before systemd's SIGKILL at
// TimeoutStopSec: a few seconds under it, not at it, so the cancelled
// activities are reported, the client closed and the last spans sent
// (service.TraceFlushTimeout, with tracing on) in time.
func TestStopTimeoutUnderTimeoutStopSec(t *testing.T) {
	for _, unit := range []string{"vmflow-hostagent.service", "vmflow-worker.service"} {
		s := unitKeys(t, unit)["Service"]
		require.Len(t, s["TimeoutStopSec"], 1, unit)
		stop := unitDuration(t, s["TimeoutStopSec"][0])
		margin := stop - service.StopTimeout
		assert.GreaterOrEqual(t, margin, service.TraceFlushTimeout+time.Second, "%s: TimeoutStopSec %s leaves the binary too little time after its %s stop timeout and %s trace flush", unit, stop, service.StopTimeout, service.TraceFlushTimeout)
		assert.LessOrEqual(t, margin, 10*time.Second, "%s: TimeoutStopSec %s is far above the %s stop timeout", unit, stop, service.StopTimeout)
		for _, f := range []string{"vmflow-hostagent.env", "vmflow-worker.env"} {
			for _, l := range envLines(t, f) {
				assert.NotContains(t, l, "--stop-timeout", "%s sets --stop-timeout; keep it with TimeoutStopSec or leave it out", f)
			}
		}
	}
}

// The agent tells systemd when it is ready (after re-attach) and that it is
// alive; the unit must wait for that.
func TestHostAgentUnitNotify(t *testing.T) {
	s := unitKeys(t, "vmflow-hostagent.service")["Service"]
	assert.Equal(t, []string{"notify"}, s["Type"])
	assert.Equal(t, []string{"main"}, s["NotifyAccess"], "a QEMU inherits NOTIFY_SOCKET; only the agent may speak for the unit")
	require.Len(t, s["WatchdogSec"], 1)
	assert.GreaterOrEqual(t, unitDuration(t, s["WatchdogSec"][0]), 10*time.Second)
	require.Len(t, s["TimeoutStartSec"], 1)
	assert.GreaterOrEqual(t, unitDuration(t, s["TimeoutStartSec"][0]), time.Minute, "re-attach of a full host must fit")
}

// envLines are the non-comment lines of an environment file.
func envLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return out
}

// get fetches addr+path and returns the status and body.
func get(ctx context.Context, addr, path string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// Both binaries built with `make build`'s -ldflags say what they are: on
// --version, in their start line and in vmflow_build_info, and both serve
// /healthz and a /readyz that turns ready once their Temporal worker runs.
func TestBinariesSayWhatTheyAre(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const version, revision = "v9.9.9-test", "0123456789abcdef0123456789abcdef01234567"
	dir := t.TempDir()
	stamp := &stacktest.Stamp{Version: version, Revision: revision}
	agent := buildBinary(ctx, t, dir, "vmflow-hostagent", "./hostagent", stamp)
	wrk := buildBinary(ctx, t, dir, "vmflow-worker", "./worker", stamp)
	want := "(revision " + revision + ", " + runtime.Version() + ")"
	for _, c := range [][]string{{agent, "--version"}, {agent, "version"}, {wrk, "--version"}} {
		b, err := exec.CommandContext(ctx, c[0], c[1:]...).CombinedOutput()
		require.NoError(t, err, "%v:\n%s", c, b)
		assert.Equal(t, filepath.Base(c[0])+" "+version+" "+want+"\n", string(b))
	}

	env := append(os.Environ(),
		"TEMPORAL_ADDRESS="+srv.Address(), "TEMPORAL_NAMESPACE="+srv.Namespace(),
		"TEMPORAL_CONFIG_FILE="+filepath.Join(dir, "none.toml"))
	images := filepath.Join(dir, "images")
	require.NoError(t, os.Mkdir(images, 0o755))
	agentOut, agentAddr := startServing(t, env, agent, "run", "--host-id", "version-host", "--state-dir", filepath.Join(dir, "state"),
		"--image-root", images, "--vgpu-driver", "none", "--workflow-task-queue", "vmflow-version")
	workerOut, workerAddr := startServing(t, env, wrk, "--task-queue", "vmflow-version")
	info := `vmflow_build_info{go_version="` + runtime.Version() + `",revision="` + revision + `",version="` + version + `"} 1`
	for _, tc := range []struct {
		name, addr string
		out        *syncBuffer
	}{{"vmflow-hostagent", agentAddr, agentOut}, {"vmflow-worker", workerAddr, workerOut}} {
		var last string
		ok := assert.Eventually(t, func() bool {
			code, body, err := get(ctx, tc.addr, "/readyz")
			last = fmt.Sprint(code, " ", body, " ", err)
			return code == http.StatusOK
		}, time.Minute, 100*time.Millisecond, "%s /readyz", tc.name)
		if !ok {
			t.Logf("%s: last /readyz: %s\nlog:\n%s", tc.name, last, tc.out.String())
			continue
		}
		code, body, err := get(ctx, tc.addr, "/healthz")
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, code, body)
		_, body, err = get(ctx, tc.addr, "/metrics")
		require.NoError(t, err)
		assert.Contains(t, body, info, tc.name)
		started := false
		for _, line := range strings.Split(tc.out.String(), "\n") {
			if strings.Contains(line, `"msg":"`+tc.name+` starting"`) {
				started = true
				assert.Contains(t, line, `"version":"`+version+`","revision":"`+revision+`","go_version":"`+runtime.Version()+`"`)
			}
		}
		assert.True(t, started, "%s logs its build at start:\n%s", tc.name, tc.out.String())
	}
}
