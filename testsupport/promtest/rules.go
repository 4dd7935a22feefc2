package promtest

import (
	"fmt"
	"regexp"
	"strconv"
	"time"
)

var (
	forLine       = regexp.MustCompile(`(?m)^(\s*for:\s*)(\S+)\s*$`)
	rangeSelector = regexp.MustCompile(`\[([0-9]+[a-z]+)\]`)
	durationWord  = regexp.MustCompile(`\b[0-9]+(ms|s|m|h|d|w|y)\b`)
	oneDuration   = regexp.MustCompile(`^([0-9]+)([smhdw])$`)
	offsetWord    = regexp.MustCompile(`(?i)\boffset\b`)
	durationUnits = map[string]time.Duration{"s": time.Second, "m": time.Minute, "h": time.Hour, "d": 24 * time.Hour, "w": 7 * 24 * time.Hour}
)

// Duration parses a Prometheus duration of one number and one unit (15m,
// 1h, 30s, 2d, 1w), as vmflow's rules write them.
func Duration(s string) (time.Duration, error) {
	m := oneDuration.FindStringSubmatch(s)
	if m == nil {
		return 0, fmt.Errorf("duration %q: not a number and one unit (s, m, h, d, w)", s)
	}
	n, err := strconv.Atoi(m[1])
	if err != nil {
		return 0, fmt.Errorf("duration %q: %w", s, err)
	}
	return time.Duration(n) * durationUnits[m[2]], nil
}

// ScaleRuleDurations is a rules file with every duration (each rule's
// `for:`, each range selector's [N<unit>]) multiplied by factor, at least
// a second: what an end-to-end test loads so that an hour's rule fires in
// a minute. The rules must write no other duration (UnscaledDurations).
func ScaleRuleDurations(rules []byte, factor float64) ([]byte, error) {
	var errs []error
	scale := func(d string) string {
		v, err := Duration(d)
		if err != nil {
			errs = append(errs, err)
			return d
		}
		return fmt.Sprintf("%ds", max(1, int(v.Seconds()*factor)))
	}
	out := forLine.ReplaceAllStringFunc(string(rules), func(line string) string {
		m := forLine.FindStringSubmatch(line)
		return m[1] + scale(m[2])
	})
	out = rangeSelector.ReplaceAllStringFunc(out, func(r string) string {
		return "[" + scale(rangeSelector.FindStringSubmatch(r)[1]) + "]"
	})
	if len(errs) > 0 {
		return nil, fmt.Errorf("scale rule durations: %w", errs[0])
	}
	return []byte(out), nil
}

// UnscaledDurations lists what in a rule's expression stands for a time
// that ScaleRuleDurations would leave as it is: a duration outside a range
// selector (a subquery's step, a function's argument) or an offset.
func UnscaledDurations(expr string) []string {
	rest := rangeSelector.ReplaceAllString(expr, "")
	out := durationWord.FindAllString(rest, -1)
	if offsetWord.MatchString(rest) {
		out = append(out, "offset")
	}
	return out
}
