package deploy_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/testsupport/devserver"
	"vmflow/testsupport/promtest"
	"vmflow/testsupport/stacktest"
)

// buildBinary builds one of the module's commands ("./worker") into dir
// as name, stamped like `make build` when stamp is set.
func buildBinary(ctx context.Context, t *testing.T, dir, name, pkg string, stamp *stacktest.Stamp) string {
	t.Helper()
	out := filepath.Join(dir, name)
	require.NoError(t, stacktest.Build(ctx, out, pkg, stamp))
	return out
}

// freeAddr is a loopback address nothing listened on a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	addr, err := promtest.FreeAddr()
	require.NoError(t, err)
	return addr
}

// syncBuffer is a bytes.Buffer safe for a process writing while the test
// reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startServing runs bin with args and --metrics-addr on a free loopback
// port until the test ends, then stops it with SIGTERM (as systemd does)
// and waits for it. It returns once bin serves /healthz there, with bin's
// output and the address. The port was free when probed, but another
// process can bind it before bin does: bin then logs the listen failure,
// and startServing stops it and tries a new port.
func startServing(t *testing.T, env []string, bin string, args ...string) (*syncBuffer, string) {
	t.Helper()
	const attempts = 5
	for attempt := 1; ; attempt++ {
		addr := freeAddr(t)
		out := &syncBuffer{}
		cmd := exec.Command(bin, append(slices.Clone(args), "--metrics-addr", addr)...)
		cmd.Env = env
		cmd.Stdout, cmd.Stderr = out, out
		require.NoError(t, cmd.Start())
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		taken := false
		ok := assert.Eventually(t, func() bool {
			if strings.Contains(out.String(), "metrics listen "+addr) {
				taken = true
				return true
			}
			// Bounded: whoever else holds the port may accept and never answer.
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			code, _, err := get(ctx, addr, "/healthz")
			return err == nil && code == http.StatusOK
		}, time.Minute, 50*time.Millisecond, "%s serves /healthz on %s", filepath.Base(bin), addr)
		if !ok || taken {
			_ = cmd.Process.Kill()
			<-done
			if ok && attempt < attempts {
				t.Logf("%s: %s was taken before it bound it; another port", filepath.Base(bin), addr)
				continue
			}
			t.Fatalf("%s never served /metrics (attempt %d):\n%s", filepath.Base(bin), attempt, out.String())
		}
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case err := <-done:
				assert.NoError(t, err, "%s did not stop cleanly on SIGTERM:\n%s", filepath.Base(bin), out.String())
			case <-time.After(30 * time.Second):
				_ = cmd.Process.Kill()
				<-done
				t.Errorf("%s ignored SIGTERM for 30s:\n%s", filepath.Base(bin), out.String())
			}
		})
		return out, addr
	}
}

func scrape(ctx context.Context, addr string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	return string(b), nil
}

// hasMetric reports whether the exposition has a sample line of name (a
// histogram counts by its _count).
func hasMetric(exposition, name string) bool {
	for _, line := range strings.Split(exposition, "\n") {
		if strings.HasPrefix(line, name+" ") || strings.HasPrefix(line, name+"{") ||
			strings.HasPrefix(line, name+"_count ") || strings.HasPrefix(line, name+"_count{") {
			return true
		}
	}
	return false
}

// Both binaries, built and run as systemd would run them, against a dev
// server: each serves every metric README.md's table says it serves, with
// the table's labels and no other, serves no vmflow_ metric the table
// lacks, and says it is connected to Temporal; SDK metrics included.
func TestBinariesServeMetrics(t *testing.T) {
	srv := devserver.Start(t, devserver.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir := t.TempDir()
	agent := buildBinary(ctx, t, dir, "vmflow-hostagent", "./hostagent", nil)
	wrk := buildBinary(ctx, t, dir, "vmflow-worker", "./worker", nil)

	env := append(os.Environ(),
		"TEMPORAL_ADDRESS="+srv.Address(), "TEMPORAL_NAMESPACE="+srv.Namespace(),
		"TEMPORAL_CONFIG_FILE="+filepath.Join(dir, "none.toml"))
	images := filepath.Join(dir, "images")
	require.NoError(t, os.Mkdir(images, 0o755))
	agentOut, agentAddr := startServing(t, env, agent, "run", "--host-id", "metrics-host", "--state-dir", filepath.Join(dir, "state"),
		"--image-root", images, "--vgpu-driver", "none", "--log-level", "info",
		"--workflow-task-queue", "vmflow-metrics")
	workerOut, workerAddr := startServing(t, env, wrk, "--task-queue", "vmflow-metrics")

	table := metricsTable(t)
	for _, tc := range []struct {
		name, addr string
		out        *syncBuffer
		rows       []metricRow
		sdk        []string
	}{
		// SDK metrics: the agent's activity worker polls its host queue.
		{"vmflow-hostagent", agentAddr, agentOut, servedBy(table, true), []string{"temporal_request_total", "temporal_long_request_total"}},
		{"vmflow-worker", workerAddr, workerOut, servedBy(table, false), []string{"temporal_request_total", "temporal_long_request_total",
			"temporal_num_pollers"}},
	} {
		var want []string
		for _, r := range tc.rows {
			if !strings.Contains(r.name, "*") {
				want = append(want, r.name)
			}
		}
		want = append(want, tc.sdk...)
		var last string
		var err error
		ok := assert.Eventually(t, func() bool {
			last, err = scrape(ctx, tc.addr)
			if err != nil {
				return false
			}
			for _, name := range want {
				if !hasMetric(last, name) {
					return false
				}
			}
			return strings.Contains(last, "\nvmflow_temporal_connected 1\n")
		}, time.Minute, 200*time.Millisecond, "%s /metrics", tc.name)
		if !ok {
			for _, name := range want {
				assert.True(t, hasMetric(last, name), "%s does not serve %s", tc.name, name)
			}
			t.Logf("%s: scrape error %v\nlast scrape:\n%s\nlog:\n%s", tc.name, err, last, tc.out.String())
			continue
		}
		labels := exposedLabels(last)
		for _, r := range tc.rows {
			if !strings.Contains(r.name, "*") {
				assert.Equal(t, r.labels, labels[r.name], "%s: the labels of %s (README.md's table)", tc.name, r.name)
			}
		}
		for family := range labels {
			if strings.HasPrefix(family, "vmflow_") {
				assert.True(t, documented(tc.rows, family), "%s serves %s, which README.md's metrics table does not list for it", tc.name, family)
			}
		}
	}
	// Logs are zap JSON with the host id on every agent line.
	for _, line := range strings.Split(strings.TrimSpace(agentOut.String()), "\n") {
		if strings.HasPrefix(line, "{") {
			assert.Contains(t, line, `"host_id":"metrics-host"`, "agent log line without host_id: %s", line)
		}
	}
}
