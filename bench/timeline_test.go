package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
)

// launchTimelines reads the "VM running" lines of an agent's log and
// returns, for each instance id prefix in prefixes, the timelines of its
// launches (segment → time), and the segments in the order a launch
// passes them.
func launchTimelines(logPath string, prefixes ...string) (map[string]map[string][]time.Duration, []string, error) {
	f, err := os.Open(logPath)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	out := map[string]map[string][]time.Duration{}
	var order []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Bytes()
		if !strings.Contains(string(line), `"timeline_ms"`) {
			continue
		}
		var e struct {
			Msg        string          `json:"msg"`
			InstanceID string          `json:"instance_id"`
			Timeline   json.RawMessage `json:"timeline_ms"`
		}
		if json.Unmarshal(line, &e) != nil || e.Msg != "VM running" {
			continue
		}
		i := slices.IndexFunc(prefixes, func(p string) bool { return strings.HasPrefix(e.InstanceID, p) })
		if i < 0 {
			continue
		}
		names, ms, err := orderedMS(e.Timeline)
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", logPath, err)
		}
		if out[prefixes[i]] == nil {
			out[prefixes[i]] = map[string][]time.Duration{}
		}
		for j, n := range names {
			if !slices.Contains(order, n) {
				order = append(order, n)
			}
			out[prefixes[i]][n] = append(out[prefixes[i]][n], time.Duration(ms[j]*float64(time.Millisecond)))
		}
	}
	return out, order, sc.Err()
}

// orderedMS decodes a JSON object of numbers keeping its keys' order.
func orderedMS(raw json.RawMessage) ([]string, []float64, error) {
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	if _, err := dec.Token(); err != nil { // {
		return nil, nil, err
	}
	var names []string
	var vals []float64
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			return nil, nil, err
		}
		var v float64
		if err := dec.Decode(&v); err != nil {
			return nil, nil, err
		}
		names, vals = append(names, fmt.Sprint(k)), append(vals, v)
	}
	return names, vals, nil
}
