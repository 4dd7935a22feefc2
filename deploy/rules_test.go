package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/yuin/goldmark"
	"github.com/yuin/goldmark/ast"
	"github.com/yuin/goldmark/parser"
	"github.com/yuin/goldmark/text"
	"go.yaml.in/yaml/v3"

	"vmflow/testsupport/promtest"
)

const (
	rulesFile     = "prometheus/vmflow-rules.yml"
	rulesTestFile = "prometheus/vmflow-rules.test.yml"
	promConfig    = "prometheus/prometheus.yml"
	// runbookBase is where every alert's runbook_url points, before the
	// section's anchor; deployers replace it (the rules file says how).
	runbookBase = "https://vmflow.example/deploy/RUNBOOK.md"
)

// promRule is one rule of a Prometheus rules file.
type promRule struct {
	Record      string            `yaml:"record"`
	Alert       string            `yaml:"alert"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

// loadRules reads a rules file's rules, every group's.
func loadRules(t *testing.T, path string) []promRule {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var f struct {
		Groups []struct {
			Name  string     `yaml:"name"`
			Rules []promRule `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(b, &f), path)
	var rules []promRule
	for _, g := range f.Groups {
		rules = append(rules, g.Rules...)
	}
	require.NotEmpty(t, rules, path)
	return rules
}

func alerts(rules []promRule) []promRule {
	var out []promRule
	for _, r := range rules {
		if r.Alert != "" {
			out = append(out, r)
		}
	}
	return out
}

// TestRulesNameOnlyServedMetrics: every metric a rule selects is in
// README.md's metrics table (which TestBinariesServeMetrics ties to what
// the binaries serve), is Prometheus's own up, or is recorded by a rule
// of the file: a rule on a metric nobody serves would never fire.
func TestRulesNameOnlyServedMetrics(t *testing.T) {
	rules := loadRules(t, rulesFile)
	table := metricsTable(t)
	recorded := map[string]bool{}
	for _, r := range rules {
		if r.Record != "" {
			recorded[r.Record] = true
		}
	}
	for _, r := range rules {
		name := r.Alert + r.Record
		names := promtest.MetricNames(r.Expr)
		assert.NotEmpty(t, names, "%s selects nothing?", name)
		for _, m := range names {
			switch {
			case m == "up", recorded[m]:
			case strings.Contains(m, ":"):
				t.Errorf("%s reads %s, which no rule of %s records", name, m, rulesFile)
			default:
				assert.True(t, documented(table, m), "%s reads %s, which README.md's metrics table does not list: no binary serves it", name, m)
			}
		}
	}
}

// TestAlertsAreComplete: each alert has a severity, a summary naming its
// host and instance, a description, and a runbook_url to its own section's
// anchor.
func TestAlertsAreComplete(t *testing.T) {
	as := alerts(loadRules(t, rulesFile))
	require.GreaterOrEqual(t, len(as), 10)
	seen := map[string]bool{}
	for _, a := range as {
		assert.False(t, seen[a.Alert], "%s twice", a.Alert)
		seen[a.Alert] = true
		assert.Regexp(t, `^Vmflow[A-Z][A-Za-z]+$`, a.Alert)
		assert.Contains(t, []string{"critical", "warning"}, a.Labels["severity"], "%s: severity", a.Alert)
		assert.Contains(t, a.Annotations["summary"], "{{ $labels.host_id }}", "%s: the summary names the host", a.Alert)
		assert.Contains(t, a.Annotations["summary"], "{{ $labels.instance }}", "%s: the summary names the agent", a.Alert)
		assert.NotEmpty(t, a.Annotations["description"], a.Alert)
		assert.Equal(t, runbookBase+"#"+strings.ToLower(a.Alert), a.Annotations["runbook_url"], "%s: runbook_url", a.Alert)
		if a.For != "" {
			_, err := promtest.Duration(a.For)
			assert.NoError(t, err, "%s: for", a.Alert)
		}
	}
}

// runbookAlert is one alert's section of RUNBOOK.md's "Alerts".
type runbookAlert struct {
	name, id string
	subs     []string // its #### headings, in order
	code     map[string]int
}

// runbookAlerts reads the ### sections of RUNBOOK.md's "## 10. Alerts"
// with the anchors GitHub and goldmark give them.
func runbookAlerts(t *testing.T) []runbookAlert {
	t.Helper()
	src, err := os.ReadFile("RUNBOOK.md")
	require.NoError(t, err)
	md := goldmark.New(goldmark.WithParserOptions(parser.WithAutoHeadingID()))
	doc := md.Parser().Parse(text.NewReader(src))
	var out []runbookAlert
	inAlerts := false
	sub := ""
	for n := doc.FirstChild(); n != nil; n = n.NextSibling() {
		switch n := n.(type) {
		case *ast.Heading:
			title := headingText(n, src)
			switch n.Level {
			case 1, 2:
				inAlerts = n.Level == 2 && strings.HasSuffix(title, ". Alerts")
			case 3:
				if inAlerts {
					id, _ := n.AttributeString("id")
					out = append(out, runbookAlert{name: title, id: string(id.([]byte)), code: map[string]int{}})
					sub = ""
				}
			case 4:
				if inAlerts && len(out) > 0 {
					sub = title
					out[len(out)-1].subs = append(out[len(out)-1].subs, title)
				}
			}
		case *ast.FencedCodeBlock:
			if inAlerts && len(out) > 0 {
				out[len(out)-1].code[sub]++
			}
		}
	}
	require.NotEmpty(t, out, "RUNBOOK.md has no alert sections")
	return out
}

func headingText(h *ast.Heading, src []byte) string {
	var b strings.Builder
	for c := h.FirstChild(); c != nil; c = c.NextSibling() {
		_ = ast.Walk(c, func(n ast.Node, entering bool) (ast.WalkStatus, error) {
			if t, ok := n.(*ast.Text); ok && entering {
				b.Write(t.Segment.Value(src))
			}
			return ast.WalkContinue, nil
		})
	}
	return b.String()
}

// TestAlertsHaveRunbookSections: every alert has its own section in
// RUNBOOK.md, in KubeVirt's form (Meaning, Impact, Diagnosis with a block
// of commands, Mitigation), whose anchor its runbook_url names, and every
// section there is an alert's.
func TestAlertsHaveRunbookSections(t *testing.T) {
	as := alerts(loadRules(t, rulesFile))
	sections := map[string]runbookAlert{}
	for _, s := range runbookAlerts(t) {
		assert.NotContains(t, sections, s.name, "two sections for %s", s.name)
		sections[s.name] = s
	}
	for _, a := range as {
		s, ok := sections[a.Alert]
		if !assert.True(t, ok, "alert %s has no section in RUNBOOK.md's Alerts", a.Alert) {
			continue
		}
		assert.Equal(t, runbookBase+"#"+s.id, a.Annotations["runbook_url"], "%s: runbook_url names its section's anchor", a.Alert)
		assert.Equal(t, []string{"Meaning", "Impact", "Diagnosis", "Mitigation"}, s.subs, "%s: the section's parts", a.Alert)
		assert.Positive(t, s.code["Diagnosis"], "%s: Diagnosis shows the commands", a.Alert)
		delete(sections, a.Alert)
	}
	for name := range sections {
		t.Errorf("RUNBOOK.md has a section for %s, which no rule of %s alerts on", name, rulesFile)
	}
}

// promtool is the path of Prometheus's promtool; the test is skipped
// without it.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not found: `make prometheus` installs it (Debian's prometheus package: apt-get install prometheus); `make test` does so first")
	}
	return p
}

func runPromtool(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	return string(out)
}

// TestRulesPromtool: promtool accepts the rules and the example
// configuration, and the rules' unit tests pass, with a case where each
// alert fires and one where it does not.
func TestRulesPromtool(t *testing.T) {
	runPromtool(t, "check", "rules", rulesFile)
	runPromtool(t, "check", "config", promConfig)
	runPromtool(t, "test", "rules", rulesTestFile)

	b, err := os.ReadFile(rulesTestFile)
	require.NoError(t, err)
	var tests struct {
		RuleFiles []string `yaml:"rule_files"`
		Tests     []struct {
			AlertRuleTest []struct {
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	require.NoError(t, yaml.Unmarshal(b, &tests))
	assert.Equal(t, []string{filepath.Base(rulesFile)}, tests.RuleFiles)
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, at := range tc.AlertRuleTest {
			if len(at.ExpAlerts) > 0 {
				fires[at.Alertname] = true
			} else {
				quiet[at.Alertname] = true
			}
		}
	}
	for _, a := range alerts(loadRules(t, rulesFile)) {
		assert.True(t, fires[a.Alert], "%s: no case in %s where it fires", a.Alert, rulesTestFile)
		assert.True(t, quiet[a.Alert], "%s: no case in %s where it does not", a.Alert, rulesTestFile)
	}
}

// TestExampleConfigLabelsEveryAgent: the example configuration scrapes
// the jobs the rules select and gives every agent target its host_id (the
// rules' summaries and VmflowAgentDown name the host by it), and no worker
// one.
func TestExampleConfigLabelsEveryAgent(t *testing.T) {
	b, err := os.ReadFile(promConfig)
	require.NoError(t, err)
	var cfg struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			StaticConfigs []struct {
				Targets []string          `yaml:"targets"`
				Labels  map[string]string `yaml:"labels"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	require.NoError(t, yaml.Unmarshal(b, &cfg))
	assert.Equal(t, []string{filepath.Base(rulesFile)}, cfg.RuleFiles)
	jobs := map[string]int{}
	for _, sc := range cfg.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			jobs[sc.JobName] += len(st.Targets)
			if sc.JobName == "vmflow-hostagent" {
				assert.Len(t, st.Targets, 1, "one agent per host_id")
				assert.Regexp(t, `^[a-z0-9][a-z0-9-]{0,62}$`, st.Labels["host_id"], "agent %v: host_id, as --host-id takes it", st.Targets)
			} else {
				assert.NotContains(t, st.Labels, "host_id", "%s is no host's", sc.JobName)
			}
		}
	}
	assert.Positive(t, jobs["vmflow-hostagent"])
	assert.Positive(t, jobs["vmflow-worker"])
	for _, r := range loadRules(t, rulesFile) {
		for _, job := range regexp.MustCompile(`job="([^"]*)"`).FindAllStringSubmatch(r.Expr, -1) {
			assert.Contains(t, jobs, job[1], "%s%s selects a job the configuration does not scrape", r.Alert, r.Record)
		}
	}
}

// TestRulesDurationsScale: every duration in a rule is one the scaling
// finds (a `for:` or a range selector; no offset, subquery step or other
// duration in an expression), and the file scaled from hours to minutes
// is still valid rules.
func TestRulesDurationsScale(t *testing.T) {
	rules := loadRules(t, rulesFile)
	for _, r := range rules {
		assert.Empty(t, promtest.UnscaledDurations(r.Expr), "%s%s: a duration the scaling would miss: %s", r.Alert, r.Record, r.Expr)
	}
	b, err := os.ReadFile(rulesFile)
	require.NoError(t, err)
	scaled, err := promtest.ScaleRuleDurations(b, 1.0/60)
	require.NoError(t, err)
	assert.Contains(t, string(scaled), "for: 60s", "an hour's for: becomes a minute")
	assert.Contains(t, string(scaled), "[15s]", "a 15-minute window becomes 15 s")
	assert.NotRegexp(t, `for: [0-9]+[mhd]\b`, string(scaled))
	assert.NotRegexp(t, `\[[0-9]+[mhd]\]`, string(scaled))
	dir := t.TempDir()
	p := filepath.Join(dir, "scaled-rules.yml")
	require.NoError(t, os.WriteFile(p, scaled, 0o644))
	runPromtool(t, "check", "rules", p)
}
