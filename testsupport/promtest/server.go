package promtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// ConfigFile is the name Start gives the configuration among its files.
const ConfigFile = "prometheus.yml"

// callTimeout bounds each call to the server's API.
const callTimeout = 10 * time.Second

// Binary is the path of Debian's Prometheus server. Without it t is
// skipped, saying how to get it, unless it runs in CI ($CI set), where
// `make test` has installed it and its absence is a failure.
func Binary(t testing.TB) string {
	t.Helper()
	p, err := exec.LookPath("prometheus")
	if err == nil {
		return p
	}
	const how = "`make prometheus` (part of `make tools`, which `make test` runs) installs Debian's prometheus"
	if os.Getenv("CI") != "" {
		t.Fatalf("prometheus server not found in CI: %v; %s", err, how)
	}
	t.Skipf("prometheus server not found (%v): %s", err, how)
	return ""
}

// Server is a Prometheus server run for one test: its own process, port
// and storage in temporary folders, stopped when the test ends. It never
// touches the package's service, its :9090 or /var/lib/prometheus. Its
// methods call the HTTP API (/api/v1), each call with a deadline.
type Server struct {
	// URL is the server's base URL (http://127.0.0.1:port).
	URL string
	// Log is the file the server's output goes to.
	Log string
}

// Start runs Prometheus with files (the configuration as ConfigFile and
// the rule files it names, by name) until t ends, and returns once it is
// ready. A port taken between its probe and the server's bind is tried
// again with another.
func Start(t testing.TB, files map[string][]byte) *Server {
	t.Helper()
	bin := Binary(t)
	if _, ok := files[ConfigFile]; !ok {
		t.Fatalf("promtest: no %s among the files", ConfigFile)
	}
	dir := t.TempDir()
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatalf("promtest: %v", err)
		}
	}
	const attempts = 5
	for attempt := 1; ; attempt++ {
		s, retry, err := start(t, bin, dir, attempt)
		if err == nil {
			return s
		}
		if !retry || attempt == attempts {
			t.Fatalf("promtest: %v", err)
		}
		t.Logf("promtest: %v; another port", err)
	}
}

// start is one attempt of Start; retry says the port was taken.
func start(t testing.TB, bin, dir string, attempt int) (s *Server, retry bool, err error) {
	addr, err := FreeAddr()
	if err != nil {
		return nil, false, err
	}
	s = &Server{URL: "http://" + addr, Log: filepath.Join(dir, fmt.Sprintf("prometheus-%d.log", attempt))}
	logf, err := os.Create(s.Log)
	if err != nil {
		return nil, false, fmt.Errorf("log: %w", err)
	}
	defer logf.Close() // the child holds its own copy
	cmd := exec.Command(bin,
		"--config.file="+filepath.Join(dir, ConfigFile),
		"--storage.tsdb.path="+filepath.Join(dir, fmt.Sprintf("data-%d", attempt)),
		"--web.listen-address="+addr,
		// Debian's defaults name /etc/prometheus; nothing of the
		// package's is read or written.
		"--web.console.templates="+dir,
		"--web.console.libraries="+dir,
		"--log.level=info")
	cmd.Stdout, cmd.Stderr = logf, logf
	// A crashed or timed-out test binary takes the server with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, false, fmt.Errorf("start %s: %w", bin, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	stop := func() error {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err := <-done:
			return err
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			return errors.New("ignored SIGTERM for 30 s: killed")
		}
	}
	deadline := time.Now().Add(time.Minute)
	for {
		select {
		case err := <-done:
			out := tail(s.Log)
			return nil, strings.Contains(out, "address already in use"), fmt.Errorf("prometheus exited before it was ready (%v):\n%s", err, out)
		default:
		}
		if s.ready() {
			break
		}
		if time.Now().After(deadline) {
			_ = stop()
			return nil, false, fmt.Errorf("prometheus not ready on %s within a minute:\n%s", addr, tail(s.Log))
		}
		time.Sleep(100 * time.Millisecond) // the poll of a deadline-bounded wait
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("stop prometheus: %v\n%s", err, tail(s.Log))
		}
		if t.Failed() {
			t.Logf("--- %s (tail) ---\n%s", s.Log, tail(s.Log))
		}
	})
	return s, false, nil
}

// ready reports whether the server answers /-/ready with 200.
func (s *Server) ready() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/-/ready", nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// FreeAddr is a loopback address nothing listened on a moment ago: for
// the server, or a target it scrapes.
func FreeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// tail is the end of a log file, for messages.
func tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// get calls GET path?query of the server's HTTP API with a deadline and
// decodes its data into out, or returns the error it answers.
func (s *Server) get(path string, query url.Values, out any) error {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	u := s.URL + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	// The API's envelope: status "success" with data, or "error" with
	// errorType and error (a bad query is 400, a timeout 503).
	var env struct {
		Status    string          `json:"status"`
		Data      json.RawMessage `json:"data"`
		ErrorType string          `json:"errorType"`
		Error     string          `json:"error"`
		Warnings  []string        `json:"warnings"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&env); err != nil {
		return fmt.Errorf("GET %s: %s, body not the API's JSON: %w", path, resp.Status, err)
	}
	if env.Status != "success" {
		return fmt.Errorf("GET %s: %s: %s: %s", path, resp.Status, env.ErrorType, env.Error)
	}
	if len(env.Warnings) > 0 {
		return fmt.Errorf("GET %s: warnings %v", path, env.Warnings)
	}
	if err := json.Unmarshal(env.Data, out); err != nil {
		return fmt.Errorf("GET %s: data: %w", path, err)
	}
	return nil
}

// Sample is one series of an instant vector, its value as Prometheus
// writes it ("1", "NaN", "+Inf").
type Sample struct {
	Metric map[string]string
	Value  string
}

// Query evaluates expr at time at (an instant query): its series, or a
// scalar's as one series without labels.
func (s *Server) Query(expr string, at time.Time) ([]Sample, error) {
	var data struct {
		ResultType string          `json:"resultType"`
		Result     json.RawMessage `json:"result"`
	}
	q := url.Values{"query": {expr}, "time": {strconv.FormatFloat(float64(at.UnixMilli())/1000, 'f', 3, 64)}}
	if err := s.get("/api/v1/query", q, &data); err != nil {
		return nil, err
	}
	switch data.ResultType {
	case "vector":
		var vec []struct {
			Metric map[string]string `json:"metric"`
			Value  [2]any            `json:"value"`
		}
		if err := json.Unmarshal(data.Result, &vec); err != nil {
			return nil, fmt.Errorf("query %s: vector: %w", expr, err)
		}
		out := make([]Sample, 0, len(vec))
		for _, v := range vec {
			out = append(out, Sample{Metric: v.Metric, Value: fmt.Sprint(v.Value[1])})
		}
		return out, nil
	case "scalar":
		var sc [2]any
		if err := json.Unmarshal(data.Result, &sc); err != nil {
			return nil, fmt.Errorf("query %s: scalar: %w", expr, err)
		}
		return []Sample{{Value: fmt.Sprint(sc[1])}}, nil
	default:
		return nil, fmt.Errorf("query %s: a %s, not an instant vector or scalar", expr, data.ResultType)
	}
}

// Alert is an active alert of the server's rules (/api/v1/alerts).
type Alert struct {
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
	State       string            `json:"state"` // pending or firing
	ActiveAt    time.Time         `json:"activeAt"`
	Value       string            `json:"value"`
}

// Alerts are the active alerts (pending and firing) of the server's rules;
// a resolved alert is not among them.
func (s *Server) Alerts() ([]Alert, error) {
	var data struct {
		Alerts []Alert `json:"alerts"`
	}
	if err := s.get("/api/v1/alerts", nil, &data); err != nil {
		return nil, err
	}
	return data.Alerts, nil
}

// LabelValues are the values label has in the series matching the
// selectors (every series without), over all the data the server holds,
// sorted.
func (s *Server) LabelValues(label string, selectors ...string) ([]string, error) {
	var out []string
	if err := s.get("/api/v1/label/"+url.PathEscape(label)+"/values", url.Values{"match[]": selectors}, &out); err != nil {
		return nil, err
	}
	slices.Sort(out)
	return out, nil
}

// ActiveTarget is a target the server scrapes (/api/v1/targets).
type ActiveTarget struct {
	Labels    map[string]string `json:"labels"` // after relabelling: job, instance and the target's own
	ScrapeURL string            `json:"scrapeUrl"`
	Health    string            `json:"health"` // up, down or unknown
	LastError string            `json:"lastError"`
}

// Targets are the server's active scrape targets.
func (s *Server) Targets() ([]ActiveTarget, error) {
	var data struct {
		Active []ActiveTarget `json:"activeTargets"`
	}
	if err := s.get("/api/v1/targets", url.Values{"state": {"active"}}, &data); err != nil {
		return nil, err
	}
	return data.Active, nil
}
