package promtest

import (
	"fmt"
	"slices"

	"go.yaml.in/yaml/v3"
)

// ScrapeTarget is one static scrape target and the labels Prometheus adds to
// every series scraped from it.
type ScrapeTarget struct {
	Addr   string
	Labels map[string]string
}

// ConfigOptions say how a test's configuration differs from an example's.
type ConfigOptions struct {
	// ScrapeInterval and EvaluationInterval replace the global ones
	// (seconds-scale for a test).
	ScrapeInterval, EvaluationInterval string
	// RuleFiles replace the example's rule_files.
	RuleFiles []string
	// Jobs replace each named job's static_configs with these targets; a
	// job the example does not scrape is an error, and so is one of the
	// example's that Jobs leaves out.
	Jobs map[string][]ScrapeTarget
}

// ConfigFrom is an example Prometheus configuration (prometheus.yml)
// made a test's: the same jobs, with the test's targets, rules and
// intervals. Everything else in the example is kept, so the test runs the
// jobs and target labels the example shows operators.
func ConfigFrom(example []byte, o ConfigOptions) ([]byte, error) {
	var cfg map[string]any
	if err := yaml.Unmarshal(example, &cfg); err != nil {
		return nil, fmt.Errorf("example configuration: %w", err)
	}
	global, _ := cfg["global"].(map[string]any)
	if global == nil {
		global = map[string]any{}
	}
	global["scrape_interval"] = o.ScrapeInterval
	global["evaluation_interval"] = o.EvaluationInterval
	cfg["global"] = global
	cfg["rule_files"] = o.RuleFiles
	scrapes, _ := cfg["scrape_configs"].([]any)
	var seen []string
	for _, sc := range scrapes {
		job, _ := sc.(map[string]any)
		name, _ := job["job_name"].(string)
		targets, ok := o.Jobs[name]
		if !ok {
			return nil, fmt.Errorf("example configuration scrapes job %q, which the test has no targets for", name)
		}
		var statics []map[string]any
		for _, tg := range targets {
			s := map[string]any{"targets": []string{tg.Addr}}
			if len(tg.Labels) > 0 {
				s["labels"] = tg.Labels
			}
			statics = append(statics, s)
		}
		job["static_configs"] = statics
		seen = append(seen, name)
	}
	for name := range o.Jobs {
		if !slices.Contains(seen, name) {
			return nil, fmt.Errorf("example configuration has no job %q", name)
		}
	}
	out, err := yaml.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("test configuration: %w", err)
	}
	return out, nil
}
