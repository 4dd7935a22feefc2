package deploy_test

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/testsupport/promtest"
)

const dashboardFile = "grafana/vmflow.json"

// prometheusOwn are the series Prometheus makes itself that a dashboard
// may read: each target's up and the rules' ALERTS.
var prometheusOwn = []string{"up", "ALERTS"}

// TestDashboardModel: grafana/vmflow.json is a Grafana dashboard model
// that imports as it is: a Prometheus data-source variable every panel and
// target uses, a host_id variable from label_values, panels with unique
// ids that do not overlap, each panel (rows aside) with at least one
// query, every query naming only metrics of README.md's table (or
// Prometheus's own, or a series the rules record), and every selector of
// an agent's metric filtered by the host variable. The e2e
// (TestPrometheusAlertsOnAStuckRelease) runs every query against a real
// Prometheus scraping a real stack.
func TestDashboardModel(t *testing.T) {
	d, err := promtest.ReadDashboard(dashboardFile)
	require.NoError(t, err)
	assert.Equal(t, "vmflow", d.UID)
	assert.NotEmpty(t, d.Title)
	assert.GreaterOrEqual(t, d.SchemaVersion, 39, "schemaVersion 39 or later (a newer Grafana migrates an older model as it loads it)")

	ds := promtest.Datasource{Type: "prometheus", UID: "${datasource}"}
	vars := map[string]promtest.Variable{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v
	}
	require.Contains(t, vars, "datasource")
	assert.Equal(t, "datasource", vars["datasource"].Type)
	dsQuery, err := vars["datasource"].QueryText()
	require.NoError(t, err)
	assert.Equal(t, "prometheus", dsQuery)
	require.Contains(t, vars, "host_id")
	host := vars["host_id"]
	assert.Equal(t, "query", host.Type)
	assert.Equal(t, &ds, host.Datasource)
	hostQuery, err := host.QueryText()
	require.NoError(t, err)
	sel, label, ok := promtest.LabelValuesQuery(hostQuery)
	require.True(t, ok, "host_id comes from label_values: %s", hostQuery)
	assert.Equal(t, "host_id", label)
	assert.Equal(t, []string{"up"}, promtest.MetricNames(sel), "an agent that does not answer is still listed")
	assert.True(t, host.IncludeAll && host.Multi && host.AllValue == ".*", "host_id: several hosts or all")

	table := metricsTable(t)
	recorded := map[string]bool{}
	for _, r := range loadRules(t, rulesFile) {
		if r.Record != "" {
			recorded[r.Record] = true
		}
	}
	agentOnly := func(name string) bool {
		for _, r := range table {
			if r.agent && !r.worker && documented([]metricRow{r}, name) {
				return true
			}
		}
		return false
	}
	testVars := d.TestVars("1m")
	ids := map[int]bool{}
	var boxes []panelBox
	used := map[string]bool{}
	for _, p := range d.AllPanels() {
		assert.NotEmpty(t, p.Title, "panel %d has a title", p.ID)
		assert.False(t, ids[p.ID], "panel id %d twice", p.ID)
		ids[p.ID] = true
		if assert.NotNil(t, p.GridPos, "panel %q has a place", p.Title) {
			g := p.GridPos
			assert.True(t, g.W > 0 && g.H > 0 && g.X >= 0 && g.X+g.W <= 24, "panel %q: %+v within the 24 columns", p.Title, *g)
			boxes = append(boxes, panelBox{p.Title, g.X, g.Y, g.W, g.H})
		}
		if p.Type == "row" {
			assert.Empty(t, p.Targets, "row %q", p.Title)
			continue
		}
		assert.Equal(t, &ds, p.Datasource, "panel %q: the dashboard's data source", p.Title)
		if !assert.NotEmpty(t, p.Targets, "panel %q has no query", p.Title) {
			continue
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			assert.False(t, refs[tg.RefID], "panel %q: refId %q twice", p.Title, tg.RefID)
			refs[tg.RefID] = true
			assert.Equal(t, &ds, tg.Datasource, "panel %q target %s: the dashboard's data source", p.Title, tg.RefID)
			if !assert.NotEmpty(t, strings.TrimSpace(tg.Expr), "panel %q target %s: no expr", p.Title, tg.RefID) {
				continue
			}
			for _, s := range selectors(tg.Expr) {
				if agentOnly(s.name) {
					assert.Contains(t, s.matchers, `host_id=~"$host_id"`, "panel %q target %s: %s is an agent's, filtered by the host variable", p.Title, tg.RefID, s.name)
				}
			}
			expr, err := promtest.Substitute(tg.Expr, testVars)
			if !assert.NoError(t, err, "panel %q target %s", p.Title, tg.RefID) {
				continue
			}
			names := promtest.MetricNames(expr)
			assert.NotEmpty(t, names, "panel %q target %s selects nothing? %s", p.Title, tg.RefID, expr)
			for _, m := range names {
				used[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_count"), "_sum")] = true
				switch {
				case slices.Contains(prometheusOwn, m), recorded[m]:
				default:
					assert.True(t, documented(table, m), "panel %q target %s reads %s, which README.md's metrics table does not list: no binary serves it", p.Title, tg.RefID, m)
				}
			}
		}
	}
	assertNoOverlap(t, boxes)

	// What an operator opens first (issue 33) is there.
	for _, m := range []string{"vmflow_instances", "ALERTS", "vmflow_lease_release_failures_total", "vmflow_lease_release_duration_seconds",
		"vmflow_stop_duration_seconds", "vmflow_exit_detect_seconds", "vmflow_leases", "vmflow_gpu_devices", "up",
		"vmflow_temporal_connected", "temporal_activity_execution_latency_seconds", "temporal_request_latency_seconds"} {
		assert.True(t, used[m], "no panel reads %s", m)
	}
}

// selector is one series selector of an expression: a metric name and
// its matchers' text.
type selector struct{ name, matchers string }

var selectorRE = regexp.MustCompile(`([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}`)

func selectors(expr string) []selector {
	var out []selector
	for _, m := range selectorRE.FindAllStringSubmatch(expr, -1) {
		out = append(out, selector{m[1], m[2]})
	}
	return out
}

type panelBox struct {
	title      string
	x, y, w, h int
}

func assertNoOverlap(t *testing.T, boxes []panelBox) {
	t.Helper()
	for i, a := range boxes {
		for _, b := range boxes[i+1:] {
			overlap := a.x < b.x+b.w && b.x < a.x+a.w && a.y < b.y+b.h && b.y < a.y+a.h
			assert.False(t, overlap, "panels %q and %q overlap", a.title, b.title)
		}
	}
}

func TestSelectors(t *testing.T) {
	assert.Equal(t, []selector{{"x_bucket", `a="b", host_id=~"$host_id"`}, {"up", `job="j"`}},
		selectors(`histogram_quantile(0.9, sum by (le) (rate(x_bucket{a="b", host_id=~"$host_id"}[1m]))) and up{job="j"}`))
	assert.Equal(t, fmt.Sprint([]selector(nil)), fmt.Sprint(selectors(`sum(up)`)))
}
