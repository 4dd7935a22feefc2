package promtest

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

func TestMetricNames(t *testing.T) {
	assert.Equal(t, []string{"vmflow_a_total", "up", "x:y:z"}, MetricNames(
		`sum by (job, instance) (increase(vmflow_a_total{errno="EBUSY",x=~"a|b"}[15m])) > 0 and on (job) up == 0 or x:y:z > 1e9`))
	assert.Equal(t, []string{"vmflow_b"}, MetricNames(`max without (state) (vmflow_b) < bool 4194304`))
	assert.Equal(t, []string{"vmflow_c_seconds_bucket"}, MetricNames(
		`histogram_quantile(0.99, sum by (le, step) (rate(vmflow_c_seconds_bucket{host_id=~".*"}[1m])))`))
}

func TestDuration(t *testing.T) {
	for in, want := range map[string]time.Duration{"30s": 30 * time.Second, "15m": 15 * time.Minute, "1h": time.Hour, "2d": 48 * time.Hour, "1w": 7 * 24 * time.Hour} {
		got, err := Duration(in)
		assert.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, bad := range []string{"", "1h30m", "1.5h", "5ms", "m"} {
		_, err := Duration(bad)
		assert.Error(t, err, bad)
	}
}

func TestScaleRuleDurations(t *testing.T) {
	rules := "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: increase(x_total[15m]) > 0\n        for: 1h\n      - alert: B\n        expr: y > 0\n        for: 5m\n"
	out, err := ScaleRuleDurations([]byte(rules), 1.0/60)
	require.NoError(t, err)
	assert.Contains(t, string(out), "increase(x_total[15s])")
	assert.Contains(t, string(out), "for: 60s")
	assert.Contains(t, string(out), "for: 5s")
	out, err = ScaleRuleDurations([]byte(rules), 1.0/3600)
	require.NoError(t, err)
	assert.Contains(t, string(out), "for: 1s", "never below a second")
	_, err = ScaleRuleDurations([]byte("      - alert: C\n        for: 1h30m\n"), 0.5)
	assert.Error(t, err, "a duration it cannot scale is an error, not left as it is")
}

func TestUnscaledDurations(t *testing.T) {
	assert.Empty(t, UnscaledDurations(`sum(increase(x[15m])) > 0`))
	assert.Equal(t, []string{"1h", "5m"}, UnscaledDurations(`max_over_time(x[1h:5m])`), "a subquery is no range selector the scaling reads")
	assert.Equal(t, []string{"1h", "offset"}, UnscaledDurations(`x offset 1h`))
}

func TestSubstitute(t *testing.T) {
	vars := map[string]string{"__rate_interval": "1m", "host_id": ".*"}
	got, err := Substitute(`rate(x{host_id=~"$host_id", y=~"${host_id:regex}", z=~"[[host_id]]", w=~"a$"}[$__rate_interval])`, vars)
	require.NoError(t, err)
	assert.Equal(t, `rate(x{host_id=~".*", y=~".*", z=~".*", w=~"a$"}[1m])`, got)
	_, err = Substitute(`x{a="$nobody"}`, vars)
	assert.ErrorContains(t, err, "$nobody")
}

func TestLabelValuesQuery(t *testing.T) {
	sel, label, ok := LabelValuesQuery(`label_values(up{job="vmflow-hostagent"}, host_id)`)
	assert.True(t, ok)
	assert.Equal(t, `up{job="vmflow-hostagent"}`, sel)
	assert.Equal(t, "host_id", label)
	_, _, ok = LabelValuesQuery(`query_result(up)`)
	assert.False(t, ok)
}

func TestConfigFrom(t *testing.T) {
	example := []byte(`global:
  scrape_interval: 15s
  evaluation_interval: 30s
  external_labels: {site: a}
rule_files: [rules.yml]
scrape_configs:
  - job_name: agents
    scrape_timeout: 5s
    static_configs:
      - targets: ["10.0.0.5:9464"]
        labels: {host_id: gpu-host-1}
  - job_name: workers
    static_configs:
      - targets: ["10.0.1.10:9465"]
`)
	out, err := ConfigFrom(example, ConfigOptions{
		ScrapeInterval: "1s", EvaluationInterval: "1s", RuleFiles: []string{"scaled.yml"},
		Jobs: map[string][]ScrapeTarget{
			"agents":  {{Addr: "127.0.0.1:1", Labels: map[string]string{"host_id": "h1"}}},
			"workers": {{Addr: "127.0.0.1:2"}},
		},
	})
	require.NoError(t, err)
	var cfg struct {
		Global        map[string]any `yaml:"global"`
		RuleFiles     []string       `yaml:"rule_files"`
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			ScrapeTimeout string `yaml:"scrape_timeout"`
			StaticConfigs []struct {
				Targets []string          `yaml:"targets"`
				Labels  map[string]string `yaml:"labels"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	require.NoError(t, yaml.Unmarshal(out, &cfg), string(out))
	assert.Equal(t, "1s", cfg.Global["scrape_interval"])
	assert.Equal(t, map[string]any{"site": "a"}, cfg.Global["external_labels"], "the rest of the example is kept")
	assert.Equal(t, []string{"scaled.yml"}, cfg.RuleFiles)
	require.Len(t, cfg.ScrapeConfigs, 2)
	assert.Equal(t, "5s", cfg.ScrapeConfigs[0].ScrapeTimeout)
	assert.Equal(t, []string{"127.0.0.1:1"}, cfg.ScrapeConfigs[0].StaticConfigs[0].Targets)
	assert.Equal(t, map[string]string{"host_id": "h1"}, cfg.ScrapeConfigs[0].StaticConfigs[0].Labels)
	assert.Nil(t, cfg.ScrapeConfigs[1].StaticConfigs[0].Labels)

	_, err = ConfigFrom(example, ConfigOptions{Jobs: map[string][]ScrapeTarget{"agents": nil}})
	assert.ErrorContains(t, err, `"workers"`, "a job of the example without targets")
	_, err = ConfigFrom(example, ConfigOptions{Jobs: map[string][]ScrapeTarget{"agents": nil, "workers": nil, "other": nil}})
	assert.ErrorContains(t, err, `"other"`, "a job the example lacks")
}

// TestServer: Start runs the real server, which scrapes itself with a
// target label, evaluates a rule, and answers each API call the tests
// make; a bad query is an error.
func TestServer(t *testing.T) {
	files := map[string][]byte{"rules.yml": []byte(`groups:
  - name: g
    rules:
      - alert: SelfUp
        expr: up{job="self"} == 1
        for: 1s
`)}
	s := startSelf(t, files)
	deadline := time.Now().Add(time.Minute)
	var last string
	for {
		alerts, err := s.Alerts()
		require.NoError(t, err)
		if len(alerts) == 1 && alerts[0].State == "firing" {
			assert.Equal(t, "SelfUp", alerts[0].Labels["alertname"])
			assert.Equal(t, "me", alerts[0].Labels["who"], "the target's label is on the alert")
			break
		}
		last = fmt.Sprint(alerts)
		require.False(t, time.Now().After(deadline), "SelfUp never fired; last: %s", last)
		time.Sleep(100 * time.Millisecond) // the poll of a deadline-bounded wait
	}
	targets, err := s.Targets()
	require.NoError(t, err)
	require.Len(t, targets, 1)
	assert.Equal(t, "up", targets[0].Health)
	assert.Equal(t, "me", targets[0].Labels["who"])

	res, err := s.Query(`sum by (who) (up)`, time.Now())
	require.NoError(t, err)
	require.Len(t, res, 1)
	assert.Equal(t, Sample{Metric: map[string]string{"who": "me"}, Value: "1"}, res[0])
	res, err = s.Query(`scalar(up)`, time.Now())
	require.NoError(t, err)
	assert.Equal(t, []Sample{{Value: "1"}}, res)
	_, err = s.Query(`sum(up`, time.Now())
	assert.ErrorContains(t, err, "bad_data", "a query that does not parse")

	names, err := s.LabelValues("__name__")
	require.NoError(t, err)
	assert.Contains(t, names, "up")
	assert.Contains(t, names, "ALERTS")
	assert.Contains(t, names, "thing", "the exporter's metric, scraped")
	whos, err := s.LabelValues("who", `up{job="self"}`)
	require.NoError(t, err)
	assert.Equal(t, []string{"me"}, whos)
}

// startSelf starts a server that scrapes, every second as job "self"
// with the label who="me", an exporter of one gauge served by the test;
// its configuration made by ConfigFrom.
func startSelf(t *testing.T, files map[string][]byte) *Server {
	t.Helper()
	Binary(t)
	exporter := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "# TYPE thing gauge\nthing 1\n")
	}))
	t.Cleanup(exporter.Close)
	example := []byte("scrape_configs:\n  - job_name: self\n    static_configs:\n      - targets: [\"example:1\"]\n")
	cfg, err := ConfigFrom(example, ConfigOptions{ScrapeInterval: "1s", EvaluationInterval: "1s", RuleFiles: []string{"rules.yml"},
		Jobs: map[string][]ScrapeTarget{"self": {{Addr: strings.TrimPrefix(exporter.URL, "http://"), Labels: map[string]string{"who": "me"}}}}})
	require.NoError(t, err)
	files[ConfigFile] = cfg
	return Start(t, files)
}
