package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu/vgpusim"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/promtest"
	"vmflow/workflows"
)

// The monitoring files the e2e loads, as deploy/ ships them.
const (
	exampleConfig = "../deploy/prometheus/prometheus.yml"
	rulesFile     = "../deploy/prometheus/vmflow-rules.yml"
	dashboardFile = "../deploy/grafana/vmflow.json"
)

// ruleScale shrinks the rules' durations so that they fire inside a test:
// the hour of VmflowDeleteStuckReleaseFailed becomes 30 s, the 15 minutes
// of VmflowLeaseReleaseFailing (its window and its for:) 7 s.
const ruleScale = 1.0 / 120

// The release alerts a stuck release raises.
var releaseAlerts = []string{"VmflowLeaseReleaseFailing", "VmflowDeleteStuckReleaseFailed"}

// TestPrometheusAlertsOnAStuckRelease: Debian's Prometheus scrapes a real
// stack (agent and worker, the vGPU simulator behind the agent) as
// deploy/prometheus/prometheus.yml says, each agent target labelled with
// its host_id, and evaluates vmflow-rules.yml with its durations scaled. A
// release the simulator fails raises both release alerts, seen firing
// through the HTTP API with the host and the agent in their labels; once
// the fault is cleared and the operator's retry has finished the delete,
// they resolve. Then every query of the Grafana dashboard runs against
// what the stack served (TestDashboard... below).
func TestPrometheusAlertsOnAStuckRelease(t *testing.T) {
	timeTest(t)
	promtest.Binary(t) // skip before a stack is built for nothing
	e := newEnv(t, envOptions{metrics: true})
	prom := e.startPrometheus()

	id := "e2e-prom-" + suffix(t)
	e.spawn(e.noneSpawn(id, true))
	e.sim.Set(t, vgpusim.CtlFailRelease, "EBUSY")
	delID := workflows.DeleteWorkflowID(id)
	run := e.startDelete(id, 1)
	e.waitStage(delID, workflows.StageReleaseFailed, time.Minute, nil)

	stuck := time.Now()
	firing := e.waitAlerts(prom, "both release alerts firing", 2*time.Minute, func(as map[string]promtest.Alert) bool {
		for _, name := range releaseAlerts {
			if as[name].State != "firing" {
				return false
			}
		}
		return true
	})
	firingAt := time.Now()
	t.Logf("release alerts firing %s after the delete reached release-failed", firingAt.Sub(stuck).Round(time.Second))
	for _, name := range releaseAlerts {
		a := firing[name]
		assert.Equal(t, e.hostID, a.Labels["host_id"], "%s names the host", name)
		assert.Equal(t, e.agentMetrics, a.Labels["instance"], "%s names the agent", name)
		assert.Equal(t, "vmflow-hostagent", a.Labels["job"], name)
		assert.Contains(t, a.Annotations["summary"], e.hostID, "%s: its summary names the host", name)
		assert.Contains(t, a.Annotations["summary"], e.agentMetrics, "%s: its summary names the agent", name)
		assert.Equal(t, "https://vmflow.example/deploy/RUNBOOK.md#"+strings.ToLower(name), a.Annotations["runbook_url"], name)
	}

	// The operator's way out (RUNBOOK section 2): the fault gone, retry.
	e.sim.Clear(t, vgpusim.CtlFailRelease)
	e.cli("workflow", "update", "execute", "--workflow-id", delID, "--name", workflows.RetryUpdate, "--input", `{"reason":"e2e: fault removed"}`)
	var del vmflowv1.DeleteResult
	require.NoError(t, run.Get(e.ctx(time.Minute), &del))
	deleted := time.Now()
	e.assertNothingLeft()
	e.waitAlerts(prom, "the release alerts resolved", 2*time.Minute, func(as map[string]promtest.Alert) bool {
		for _, name := range releaseAlerts {
			if _, active := as[name]; active {
				return false
			}
		}
		return true
	})
	t.Logf("release alerts resolved %s after the delete finished", time.Since(deleted).Round(time.Second))

	t.Run("dashboard", func(t *testing.T) { checkDashboard(t, prom, e.hostID, firingAt) })
}

// checkDashboard runs every query of the Grafana dashboard, its variables
// substituted (promtest.TestVars: every host), against Prometheus after
// the stack has spawned a VM, failed its release and deleted it: no query
// may fail, each must name only metrics Prometheus holds (served by the
// stack, or its own up and ALERTS), and each must have had series while
// the release was stuck (at), when every panel has something to show; a
// query whose selector matches nothing (a label misspelt) fails there.
// The host variable's own query must list the host.
func checkDashboard(t *testing.T, prom *promtest.Server, hostID string, at time.Time) {
	d, err := promtest.ReadDashboard(dashboardFile)
	require.NoError(t, err)
	served, err := prom.LabelValues("__name__")
	require.NoError(t, err)
	vars := d.TestVars("1m")
	queries, err := d.Queries(vars)
	require.NoError(t, err)
	require.NotEmpty(t, queries)
	for _, q := range queries {
		_, err := prom.Query(q.Expr, time.Now())
		assert.NoError(t, err, "%s", q)
		res, err := prom.Query(q.Expr, at)
		if assert.NoError(t, err, "%s", q) {
			assert.NotEmpty(t, res, "%s: no series while the release was stuck", q)
		}
		for _, m := range promtest.MetricNames(q.Expr) {
			assert.Contains(t, served, m, "%s: names %s, which the stack did not serve", q, m)
		}
	}
	t.Logf("%d queries of %d panels run", len(queries), len(d.AllPanels()))
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		text, err := v.QueryText()
		require.NoError(t, err)
		sel, label, ok := promtest.LabelValuesQuery(text)
		if !assert.True(t, ok, "variable %s: %q is not label_values(selector, label)", v.Name, text) {
			continue
		}
		values, err := prom.LabelValues(label, sel)
		require.NoError(t, err)
		assert.Contains(t, values, hostID, "variable %s lists the host", v.Name)
	}
}

// startPrometheus runs Prometheus on the env's agent and worker (the env
// needs envOptions.metrics) with deploy/'s example configuration made the
// test's (promtest.ConfigFrom: its jobs, the agent's target labelled with
// its host_id, one-second scrapes and evaluations) and the rules scaled by
// ruleScale, and waits until it has scraped both.
func (e *env) startPrometheus() *promtest.Server {
	t := e.t
	t.Helper()
	require.NotEmpty(t, e.agentMetrics, "the env serves no metrics: envOptions.metrics")
	example, err := os.ReadFile(exampleConfig)
	require.NoError(t, err)
	rules, err := os.ReadFile(rulesFile)
	require.NoError(t, err)
	scaled, err := promtest.ScaleRuleDurations(rules, ruleScale)
	require.NoError(t, err)
	cfg, err := promtest.ConfigFrom(example, promtest.ConfigOptions{
		ScrapeInterval: "1s", EvaluationInterval: "1s",
		RuleFiles: []string{filepath.Base(rulesFile)},
		Jobs: map[string][]promtest.ScrapeTarget{
			"vmflow-hostagent": {{Addr: e.agentMetrics, Labels: map[string]string{"host_id": e.hostID}}},
			"vmflow-worker":    {{Addr: e.workerMetrics}},
		},
	})
	require.NoError(t, err)
	prom := promtest.Start(t, map[string][]byte{promtest.ConfigFile: cfg, filepath.Base(rulesFile): scaled})
	waitFor(t, time.Minute, "Prometheus scraping the agent and the worker", func() (bool, string) {
		targets, err := prom.Targets()
		if err != nil {
			return false, err.Error()
		}
		up := 0
		for _, tg := range targets {
			if tg.Health == "up" {
				up++
			}
		}
		return up == 2 && len(targets) == 2, fmt.Sprintf("%+v", targets)
	})
	return prom
}

// waitAlerts polls the active alerts of the env's host (by host_id) until
// cond holds of them, by name, and returns them.
func (e *env) waitAlerts(prom *promtest.Server, what string, timeout time.Duration, cond func(map[string]promtest.Alert) bool) map[string]promtest.Alert {
	e.t.Helper()
	var mine map[string]promtest.Alert
	waitFor(e.t, timeout, what, func() (bool, string) {
		as, err := prom.Alerts()
		if err != nil {
			return false, err.Error()
		}
		mine = map[string]promtest.Alert{}
		var seen []string
		for _, a := range as {
			if a.Labels["host_id"] == e.hostID {
				mine[a.Labels["alertname"]] = a
				seen = append(seen, a.Labels["alertname"]+" "+a.State)
			}
		}
		slices.Sort(seen)
		return cond(mine), fmt.Sprintf("active alerts of %s: %v", e.hostID, seen)
	})
	return mine
}
