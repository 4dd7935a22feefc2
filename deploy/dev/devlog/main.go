// Command vmflow-devlog turns one process's output into lines of `make dev`'s
// single log stream: each line gets a fixed-width, coloured source prefix,
// and zap JSON lines (the worker's and the agent's) become
// "15:04:05.000 INFO  message key=value ..." so a human can follow them.
// Anything that is not a JSON object passes through unchanged.
//
// Usage: vmflow-devlog PREFIX < output
//
// It ignores SIGINT and SIGTERM on purpose: dev.sh stops the processes in
// order on Ctrl-C, and their last words (shutdown logs) must still reach the
// terminal. It exits when its input closes, i.e. when the process has.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"
)

// dropped are zap fields that add noise, not information, in a dev stream.
var dropped = map[string]bool{"ts": true, "level": true, "msg": true, "caller": true, "stacktrace": true, "logger": true}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: vmflow-devlog PREFIX < output")
		os.Exit(2)
	}
	signal.Ignore(syscall.SIGINT, syscall.SIGTERM)
	color := isTerminal(os.Stdout) && os.Getenv("NO_COLOR") == ""
	prefix := fmt.Sprintf("%-9s|", os.Args[1])
	if color {
		prefix = fmt.Sprintf("\x1b[%dm%s\x1b[0m", 31+hash(os.Args[1])%6, prefix)
	}
	if err := run(os.Stdin, os.Stdout, prefix); err != nil {
		fmt.Fprintf(os.Stderr, "vmflow-devlog %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func run(in io.Reader, out io.Writer, prefix string) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	w := bufio.NewWriter(out)
	for sc.Scan() {
		// One write per line, flushed at once: the stream is shared with the
		// other processes' prefixers and must not tear lines.
		fmt.Fprintf(w, "%s %s\n", prefix, format(sc.Text()))
		if err := w.Flush(); err != nil {
			return err
		}
	}
	return sc.Err()
}

// format renders a zap JSON line; other lines are returned as they are.
func format(line string) string {
	if !strings.HasPrefix(line, "{") {
		return line
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(line), &m); err != nil {
		return line
	}
	var b strings.Builder
	if ts, ok := m["ts"].(string); ok {
		if t, err := time.Parse(time.RFC3339Nano, ts); err == nil {
			ts = t.Local().Format("15:04:05.000")
		}
		b.WriteString(ts + " ")
	}
	level, _ := m["level"].(string)
	fmt.Fprintf(&b, "%-5s %v", strings.ToUpper(level), m["msg"])
	keys := make([]string, 0, len(m))
	for k := range m {
		if !dropped[k] {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := m[k]
		s, ok := v.(string)
		if !ok {
			j, err := json.Marshal(v)
			if err != nil {
				continue
			}
			s = string(j)
		}
		if strings.ContainsAny(s, " \t") {
			s = fmt.Sprintf("%q", s)
		}
		fmt.Fprintf(&b, " %s=%s", k, s)
	}
	return b.String()
}

func hash(s string) uint32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return h.Sum32()
}

func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
