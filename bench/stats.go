package bench

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Summary is the distribution of one measured quantity.
type Summary struct {
	N           int
	Median, P99 time.Duration
	Min, Max    time.Duration
}

// Summarize picks the nearest-rank median and p99 of ds (p99 is the maximum
// under 100 samples: the report says N).
func Summarize(ds []time.Duration) Summary {
	if len(ds) == 0 {
		return Summary{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return Summary{N: len(s), Median: rank(s, 0.50), P99: rank(s, 0.99), Min: s[0], Max: s[len(s)-1]}
}

// rank is the nearest-rank percentile of sorted s: the smallest value with
// at least q of the samples at or below it.
func rank(s []time.Duration, q float64) time.Duration {
	i := int(float64(len(s))*q+0.999999999) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// MS formats d in milliseconds with a precision that suits its size.
func MS(d time.Duration) string {
	ms := float64(d) / float64(time.Millisecond)
	switch a := max(ms, -ms); {
	case a < 1:
		return fmt.Sprintf("%.3f", ms)
	case a < 100:
		return fmt.Sprintf("%.1f", ms)
	default:
		return fmt.Sprintf("%.0f", ms)
	}
}

// Ratio formats a/b ("12.3×"); "n/a" when b is zero.
func Ratio(a, b time.Duration) string {
	if b <= 0 {
		return "n/a"
	}
	r := float64(a) / float64(b)
	if r >= 100 {
		return fmt.Sprintf("%.0f×", r)
	}
	return fmt.Sprintf("%.2f×", r)
}

// Table is a markdown table.
type Table struct {
	Header []string
	Rows   [][]string
}

// Add appends a row of cells.
func (t *Table) Add(cells ...string) { t.Rows = append(t.Rows, cells) }

// Markdown renders the table; a pipe in a cell is escaped.
func (t *Table) Markdown() string {
	var b strings.Builder
	row := func(cells []string) {
		b.WriteString("|")
		for _, c := range cells {
			b.WriteString(" " + strings.ReplaceAll(c, "|", `\|`) + " |")
		}
		b.WriteString("\n")
	}
	row(t.Header)
	sep := make([]string, len(t.Header))
	for i := range sep {
		sep[i] = "---"
	}
	row(sep)
	for _, r := range t.Rows {
		row(r)
	}
	return b.String()
}
