package deploy_test

import (
	"bufio"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// metricRow is one row of README.md's metrics table.
type metricRow struct {
	name   string   // vmflow_instances; a family with * (temporal_*) is a pattern
	labels []string // the labels its series carry, sorted
	agent  bool     // served by vmflow-hostagent
	worker bool     // served by vmflow-worker
}

// metricsTable reads the metrics table of README.md's "## Metrics"
// section: the one list of what the binaries serve.
func metricsTable(t *testing.T) []metricRow {
	t.Helper()
	f, err := os.Open("README.md")
	require.NoError(t, err)
	defer f.Close()
	var rows []metricRow
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "## ") {
			in = line == "## Metrics"
			continue
		}
		if !in || !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		require.GreaterOrEqual(t, len(cells), 5, "README.md metrics row: %s", line)
		row := metricRow{name: strings.Trim(cells[0], "`")}
		for _, l := range strings.Split(cells[2], ",") {
			if l = strings.Trim(strings.TrimSpace(l), "`"); l != "" {
				row.labels = append(row.labels, l)
			}
		}
		slices.Sort(row.labels)
		row.agent = strings.Contains(cells[3], "agent")
		row.worker = strings.Contains(cells[3], "worker")
		require.True(t, row.agent || row.worker, "README.md metrics row served by no one: %s", line)
		rows = append(rows, row)
	}
	require.NoError(t, sc.Err())
	require.GreaterOrEqual(t, len(rows), 20, "README.md lost its metrics table?")
	return rows
}

// servedBy is the table's rows served by the agent (agent) or the worker.
func servedBy(rows []metricRow, agent bool) []metricRow {
	var out []metricRow
	for _, r := range rows {
		if (agent && r.agent) || (!agent && r.worker) {
			out = append(out, r)
		}
	}
	return out
}

// documented says whether name (a metric, or a histogram's or summary's
// _bucket, _count or _sum) is in rows, by name or by a row's pattern.
func documented(rows []metricRow, name string) bool {
	for _, r := range rows {
		if prefix, ok := strings.CutSuffix(r.name, "*"); ok {
			if strings.HasPrefix(name, prefix) {
				return true
			}
			continue
		}
		if name == r.name {
			return true
		}
		for _, suffix := range []string{"_bucket", "_count", "_sum"} {
			if name == r.name+suffix {
				return true
			}
		}
	}
	return false
}

var (
	sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? `)
	labelPair  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"`)
	typeLine   = regexp.MustCompile(`^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) `)
)

// exposedLabels is, for each metric family of the exposition, the names of
// the labels its samples carry (a histogram's le not counted), sorted.
func exposedLabels(exposition string) map[string][]string {
	families := map[string]bool{}
	for _, line := range strings.Split(exposition, "\n") {
		if m := typeLine.FindStringSubmatch(line); m != nil {
			families[m[1]] = true
		}
	}
	out := map[string][]string{}
	for f := range families {
		out[f] = nil
	}
	for _, line := range strings.Split(exposition, "\n") {
		m := sampleLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		family := m[1]
		if !families[family] {
			for _, suffix := range []string{"_bucket", "_count", "_sum"} {
				if f, ok := strings.CutSuffix(family, suffix); ok && families[f] {
					family = f
				}
			}
		}
		for _, p := range labelPair.FindAllStringSubmatch(m[2], -1) {
			if p[1] != "le" && !slices.Contains(out[family], p[1]) {
				out[family] = append(out[family], p[1])
			}
		}
	}
	for f := range out {
		slices.Sort(out[f])
	}
	return out
}

// TestMetricsTableParses: the table names its labels and who serves each
// metric; this fails when a row loses a column.
func TestMetricsTableParses(t *testing.T) {
	rows := metricsTable(t)
	byName := map[string]metricRow{}
	for _, r := range rows {
		assert.NotContains(t, byName, r.name, "%s has two rows", r.name)
		byName[r.name] = r
	}
	assert.Equal(t, []string{"kind", "phase"}, byName["vmflow_leases"].labels)
	assert.True(t, byName["vmflow_temporal_connected"].agent)
	assert.True(t, byName["vmflow_temporal_connected"].worker)
	assert.False(t, byName["vmflow_instances"].worker)
	assert.True(t, documented(rows, "vmflow_stop_duration_seconds_bucket"))
	assert.True(t, documented(rows, "temporal_request_total"))
	assert.False(t, documented(rows, "vmflow_nobody_serves_this"))
}
