package promtest

import (
	"regexp"
	"slices"
	"strings"
)

var (
	promString    = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'`)
	promMatchers  = regexp.MustCompile(`\{[^}]*\}`)
	promRange     = regexp.MustCompile(`\[[^\]]*\]`)
	promLabelList = regexp.MustCompile(`\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	promNumber    = regexp.MustCompile(`(^|[^a-zA-Z0-9_:])[0-9][0-9.]*(?:e[+-]?[0-9]+)?`)
	promIdent     = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*(\s*\()?`)
	// PromQL's keywords and aggregation operators (which may take their
	// `by` before the parenthesis): never a metric.
	promWords = []string{"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
		"bool", "offset", "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
		"bottomk", "topk", "quantile", "inf", "nan"}
)

// MetricNames are the metrics (and recorded series) a PromQL expression
// selects, each once, in order: what is left of it without its strings,
// label matchers, ranges, label lists, numbers, keywords and calls. A
// histogram's series keep their suffix (x_bucket).
func MetricNames(expr string) []string {
	s := promString.ReplaceAllString(expr, "")
	s = promMatchers.ReplaceAllString(s, " ")
	s = promRange.ReplaceAllString(s, " ")
	s = promLabelList.ReplaceAllString(s, " ")
	s = promNumber.ReplaceAllString(s, "$1 ")
	var names []string
	for _, m := range promIdent.FindAllStringSubmatch(s, -1) {
		if m[1] != "" || slices.Contains(promWords, strings.ToLower(m[0])) {
			continue // a function or aggregation called, or a keyword
		}
		if !slices.Contains(names, m[0]) {
			names = append(names, m[0])
		}
	}
	return names
}
