// Package servicetest reads what a /metrics endpoint serves, for tests that
// check histogram buckets by their text, as Prometheus scrapes them.
package servicetest

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// bucketLine is one cumulative bucket of the text format:
// name_bucket{labels,le="0.25"} 3
var bucketLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)_bucket\{(.*)\} ([0-9.e+-]+|NaN)$`)

var leLabel = regexp.MustCompile(`(?:^|,)le="([^"]+)"`)

// Histograms parses the text format: histogram family -> upper bound ->
// cumulative count (summed over label sets). +Inf is left out.
func Histograms(body string) (map[string]map[float64]float64, error) {
	out := map[string]map[float64]float64{}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		m := bucketLine.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		le := leLabel.FindStringSubmatch(m[2])
		if le == nil {
			return nil, fmt.Errorf("bucket without le: %q", sc.Text())
		}
		if le[1] == "+Inf" {
			continue
		}
		bound, err := strconv.ParseFloat(le[1], 64)
		if err != nil {
			return nil, fmt.Errorf("le %q: %w", le[1], err)
		}
		n, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			return nil, fmt.Errorf("count %q: %w", m[3], err)
		}
		if out[m[1]] == nil {
			out[m[1]] = map[float64]float64{}
		}
		out[m[1]][bound] += n
	}
	return out, sc.Err()
}

// Get fetches url with a deadline and returns the status and body.
func Get(t testing.TB, url string) (int, string) {
	t.Helper()
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: read body: %v", url, err)
	}
	return resp.StatusCode, string(b)
}
