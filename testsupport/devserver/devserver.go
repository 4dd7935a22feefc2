// Package devserver runs the real Temporal dev server (`bin/temporal server
// start-dev`, CLI v1.5.1) for tests: on free loopback ports, with an SQLite
// file so a restart keeps every workflow, and with vmflow's search
// attributes registered. Tests that need Temporal call Start (a server of
// their own, e.g. to restart it) or Shared (one server per test binary).
//
// The same shape runs the production backend: StartPostgres and
// SharedPostgres run the self-hosted Temporal server (bin/temporal-server,
// go.temporal.io/server v1.29.1) on a PostgreSQL cluster of their own,
// configured and set up by the files under deploy/ an operator uses. Both
// satisfy Temporal, so a test can run on either.
//
// The SDK's testsuite.StartDevServer would download a CLI, which this
// machine cannot; this package only ever runs the binaries `make tools` built.
package devserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.temporal.io/api/operatorservice/v1"
	"go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/sdk/client"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"vmflow/internal/tclient"
	"vmflow/internal/tclient/tclienttest"
	"vmflow/platform"
)

// EnvBinary overrides where the temporal CLI is found.
const EnvBinary = "VMFLOW_TEMPORAL"

// Options configure Start.
type Options struct {
	// DBFile is the SQLite file; empty means a new file in a temporary
	// folder. Either way Restart reuses it.
	DBFile string
	// UI serves the Web UI (on UIAddress); otherwise the server is headless,
	// which starts faster.
	UI bool
	// Namespace defaults to "default" (created by start-dev itself); another
	// name is created with --namespace.
	Namespace string
	// StartTimeout bounds each start (default 90 s: the first start of a
	// fresh SQLite file takes a few seconds, and CI machines are slow).
	StartTimeout time.Duration
	// ExtraArgs are appended to start-dev's arguments
	// (e.g. --dynamic-config-value).
	ExtraArgs []string
	// Metrics serves the server's Prometheus metrics (--metrics-port, on
	// MetricsAddress), among them its own billing counter `action`
	// (see Actions).
	Metrics bool
}

// Server is one running dev server process.
type Server struct {
	bin    string
	opts   Options
	dir    string // log file (and DB file when not given) live here
	ip     string
	port   int
	uiPort int
	// metricsPort is 0 unless Options.Metrics.
	metricsPort int

	mu   sync.Mutex
	proc *child // nil before the first start
}

// Binary finds the temporal CLI: $VMFLOW_TEMPORAL, or bin/temporal in the module
// root above the working directory.
func Binary() (string, error) {
	if p := os.Getenv(EnvBinary); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("%s=%s: %w", EnvBinary, p, err)
		}
		return p, nil
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("find temporal CLI: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			p := filepath.Join(dir, "bin", "temporal")
			if _, err := os.Stat(p); err != nil {
				return "", fmt.Errorf("temporal CLI not at %s: %w", p, err)
			}
			return p, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("temporal CLI: no go.mod above the working directory")
		}
		dir = parent
	}
}

// RequireBinary returns the CLI's path, or skips t when it is missing (the
// only reason to skip: everything else that goes wrong fails the test).
func RequireBinary(t testing.TB) string {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Skipf("Temporal CLI not found (%v): `make tools` builds bin/temporal, or set %s", err, EnvBinary)
	}
	return bin
}

// Start runs a dev server for t and stops it when t ends.
func Start(t testing.TB, o Options) *Server {
	t.Helper()
	bin := RequireBinary(t)
	s, err := start(bin, o, t.TempDir())
	if err != nil {
		t.Fatalf("devserver: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("devserver stop: %v", err)
		}
	})
	return s
}

var shared struct {
	once sync.Once
	srv  *Server
	err  error
	dir  string
}

// Shared returns one headless server for the test binary, started on first use;
// tests sharing it use their own ids and queues. StopShared (from TestMain)
// stops it, else it dies with the binary.
func Shared(t testing.TB) *Server {
	t.Helper()
	bin := RequireBinary(t)
	shared.once.Do(func() {
		shared.dir, shared.err = os.MkdirTemp("", "vmflow-devserver-")
		if shared.err != nil {
			return
		}
		shared.srv, shared.err = start(bin, Options{}, shared.dir)
	})
	if shared.err != nil {
		t.Fatalf("devserver (shared): %v", shared.err)
	}
	return shared.srv
}

// StopShared stops the shared servers started and removes their files; for
// TestMain, after m.Run.
func StopShared() error {
	var errs []error
	if shared.srv != nil {
		errs = append(errs, shared.srv.Stop())
		if err := os.RemoveAll(shared.dir); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", shared.dir, err))
		}
	}
	if sharedPG.srv != nil {
		errs = append(errs, sharedPG.srv.Stop())
		if err := os.RemoveAll(sharedPG.srv.dir); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", sharedPG.srv.dir, err))
		}
	}
	return errors.Join(errs...)
}

func start(bin string, o Options, dir string) (*Server, error) {
	if o.StartTimeout <= 0 {
		o.StartTimeout = 90 * time.Second
	}
	if o.Namespace == "" {
		o.Namespace = client.DefaultNamespace
	}
	if o.DBFile == "" {
		o.DBFile = filepath.Join(dir, "temporal.db")
	}
	s := &Server{bin: bin, opts: o, dir: dir, ip: "127.0.0.1"}
	// Free ports are taken by binding :0 and closing, so another process can
	// grab one before the server binds it; a start that fails that way is
	// retried on new ports.
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		var err error
		if s.port, err = freePort(s.ip); err != nil {
			return nil, err
		}
		if s.uiPort, err = freePort(s.ip); err != nil {
			return nil, err
		}
		if o.Metrics {
			if s.metricsPort, err = freePort(s.ip); err != nil {
				return nil, err
			}
		}
		if lastErr = s.launch(); lastErr == nil {
			return s, nil
		}
	}
	return nil, lastErr
}

func freePort(ip string) (int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func (s *Server) args() []string {
	args := []string{
		"server", "start-dev",
		"--ip", s.ip,
		"--port", strconv.Itoa(s.port),
		"--db-filename", s.opts.DBFile,
		"--log-level", "warn",
	}
	if !slices.Contains(s.opts.ExtraArgs, "--sqlite-pragma") {
		// SQLite's default journal syncs every history write and admits one
		// writer at a time; make bench measured the dev server, not vmflow,
		// as the bottleneck at scale (100 VMs: 43 s default, 20 s WAL).
		// A caller that passes its own pragmas (the bench's baseline) wins.
		args = append(args, "--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal")
	}
	if s.opts.UI {
		args = append(args, "--ui-port", strconv.Itoa(s.uiPort))
	} else {
		args = append(args, "--headless")
	}
	if s.metricsPort != 0 {
		args = append(args, "--metrics-port", strconv.Itoa(s.metricsPort))
	}
	if s.opts.Namespace != client.DefaultNamespace {
		args = append(args, "--namespace", s.opts.Namespace)
	}
	attrs := tclient.SearchAttributes()
	for _, name := range slices.Sorted(maps.Keys(attrs)) {
		args = append(args, "--search-attribute", name+"="+tclient.IndexedTypeName(attrs[name]))
	}
	return append(args, s.opts.ExtraArgs...)
}

// launch starts the process and waits until it serves: health check, the
// namespace, and the search attributes all answer.
func (s *Server) launch() error {
	begin := time.Now()
	// startChild reaps the process in one goroutine (no zombie even if a
	// test forgets Stop), and it dies with the test binary.
	c, err := startChild("dev server", exec.Command(s.bin, s.args()...), s.LogFile(), nil)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.proc = c
	s.mu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), s.opts.StartTimeout)
	defer cancel()
	if err := s.waitReady(ctx, c.exited()); err != nil {
		stopErr := s.Stop()
		return errors.Join(fmt.Errorf("dev server on %s not ready after %s: %w\n--- server log ---\n%s",
			s.Address(), time.Since(begin).Round(time.Millisecond), err, s.logTail()), stopErr)
	}
	return nil
}

// waitReady polls until the server answers, the process exits, or ctx ends.
func (s *Server) waitReady(ctx context.Context, exited <-chan struct{}) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		if last = s.ready(ctx); last == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("server exited: %v (last check: %w)", s.waitErr(), last)
		case <-ctx.Done():
			return fmt.Errorf("%w (last check: %w)", ctx.Err(), last)
		case <-tick.C:
		}
	}
}

func (s *Server) ready(ctx context.Context) error {
	return checkReady(ctx, s.Address(), s.opts.Namespace)
}

// checkReady: the server at addr answers its health check, knows namespace
// and has vmflow's search attributes in it.
func checkReady(ctx context.Context, addr, namespace string) error {
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	c, err := client.DialContext(cctx, client.Options{
		HostPort:  addr,
		Namespace: namespace,
		Logger:    tclient.NewZapLogger(nil),
	})
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	defer c.Close()
	if _, err := c.CheckHealth(cctx, &client.CheckHealthRequest{}); err != nil {
		return fmt.Errorf("health: %w", err)
	}
	if _, err := c.WorkflowService().DescribeNamespace(cctx, &workflowservice.DescribeNamespaceRequest{Namespace: namespace}); err != nil {
		return fmt.Errorf("namespace %s: %w", namespace, err)
	}
	resp, err := c.OperatorService().ListSearchAttributes(cctx, &operatorservice.ListSearchAttributesRequest{Namespace: namespace})
	if err != nil {
		return fmt.Errorf("search attributes: %w", err)
	}
	for name := range tclient.SearchAttributes() {
		if _, ok := resp.GetCustomAttributes()[name]; !ok {
			return fmt.Errorf("search attribute %s not registered yet", name)
		}
	}
	return nil
}

// Address is the frontend's host:port.
func (s *Server) Address() string { return net.JoinHostPort(s.ip, strconv.Itoa(s.port)) }

// UIAddress is the Web UI's base URL, or "" for a headless server.
func (s *Server) UIAddress() string {
	if !s.opts.UI {
		return ""
	}
	return "http://" + net.JoinHostPort(s.ip, strconv.Itoa(s.uiPort))
}

// Namespace is the namespace tests should use.
func (s *Server) Namespace() string { return s.opts.Namespace }

// DBFile is the SQLite file holding the server's state.
func (s *Server) DBFile() string { return s.opts.DBFile }

// BinaryPath is the temporal CLI this server runs, for tests that drive the
// CLI itself.
func (s *Server) BinaryPath() string { return s.bin }

// LogFile is where the server's stdout and stderr go.
func (s *Server) LogFile() string { return filepath.Join(s.dir, "temporal.log") }

// Backend is "dev".
func (s *Server) Backend() string { return "dev" }

// TClientOptions are platform.Options that reach this server, for tests that
// dial with their own logger or metrics.
func (s *Server) TClientOptions() platform.Options {
	return tclientOptions(s.Address(), s.opts.Namespace, s.dir)
}

// tclientOptions reach addr and namespace; dir holds the (absent) config
// file the client is pointed at.
func tclientOptions(addr, namespace, dir string) platform.Options {
	return platform.Options{
		HostPort:  addr,
		Namespace: namespace,
		Logger:    testLogger(),
		// An empty fake environment: a developer's TEMPORAL_* variables or
		// config file must not send tests elsewhere.
		Env:          tclienttest.Env{},
		ConfigFile:   filepath.Join(dir, "no-temporal-config.toml"),
		RetryInitial: 100 * time.Millisecond,
		RetryMax:     time.Second,
	}
}

// Client returns a client with vmflow's converter, closed when t ends.
func (s *Server) Client(t testing.TB) client.Client {
	t.Helper()
	return dialClient(t, s.TClientOptions())
}

func dialClient(t testing.TB, o platform.Options) client.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := platform.Dial(ctx, o)
	if err != nil {
		t.Fatalf("devserver client: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// CLI runs the temporal CLI against this server (address and namespace
// added) and returns its combined output.
func (s *Server) CLI(ctx context.Context, args ...string) ([]byte, error) {
	return runCLI(ctx, s.bin, s.dir, s.Address(), s.opts.Namespace, args)
}

func runCLI(ctx context.Context, bin, dir, addr, namespace string, args []string) ([]byte, error) {
	args = append(args, "--address", addr, "--namespace", namespace)
	cmd := exec.CommandContext(ctx, bin, args...)
	// TEMPORAL_* from the developer's shell would override nothing we pass,
	// but a config file profile could add TLS: point the CLI at none.
	cmd.Env = append(os.Environ(), "TEMPORAL_CONFIG_FILE="+filepath.Join(dir, "no-temporal-config.toml"))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("temporal %v: %w\n%s", args, err, out.Bytes())
	}
	return out.Bytes(), nil
}

// Stop ends the server: SIGTERM, then SIGKILL if it has not exited within
// 15 s, and waits until it is reaped. Stopping a stopped server is a no-op.
func (s *Server) Stop() error { return s.signal(syscall.SIGTERM) }

// Kill ends the server with SIGKILL, as a crash or the OOM killer would
// (no shutdown of its own), and waits until it is reaped.
func (s *Server) Kill() error { return s.signal(syscall.SIGKILL) }

func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	c := s.proc
	s.mu.Unlock()
	if c == nil {
		return nil
	}
	return c.stop(sig, 15*time.Second)
}

// Restart SIGKILLs the server (a crash, not a shutdown) and starts it on the
// same ports and DB, so workflows continue; a start on a port taken meanwhile
// is retried until Options.StartTimeout.
func (s *Server) Restart() error {
	if err := s.Kill(); err != nil {
		return err
	}
	deadline := time.Now().Add(s.opts.StartTimeout)
	for {
		err := s.launch()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(time.Second) // between attempts of a deadline-bounded retry
	}
}

// Running reports whether the server process is alive.
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc != nil && s.proc.running()
}

func (s *Server) waitErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return nil
	}
	return s.proc.waitErr()
}

// logTail is the end of the server's log, for start failures.
func (s *Server) logTail() string { return logTail(s.LogFile()) }

// testLogger logs warnings and errors to stderr (shown for a failing package),
// safe, unlike zaptest, from SDK goroutines outliving a test.
func testLogger() *zap.Logger {
	cfg := zap.NewDevelopmentEncoderConfig()
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(cfg), zapcore.Lock(os.Stderr), zapcore.WarnLevel)
	return zap.New(core)
}

// MetricsAddress is host:port of the Prometheus metrics, "" unless
// Options.Metrics.
func (s *Server) MetricsAddress() string {
	if s.metricsPort == 0 {
		return ""
	}
	return net.JoinHostPort(s.ip, strconv.Itoa(s.metricsPort))
}

// ErrNoMetrics: the server was started without Options.Metrics.
var ErrNoMetrics = errors.New("devserver: started without metrics (Options.Metrics)")

// Actions sums the server's own `action` counter, which Cloud billing mirrors,
// per action_type over namespace ("" for all), the server's own work included.
func (s *Server) Actions(ctx context.Context, namespace string) (map[string]float64, error) {
	if s.metricsPort == 0 {
		return nil, ErrNoMetrics
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+s.MetricsAddress()+"/metrics", nil)
	if err != nil {
		return nil, fmt.Errorf("metrics request: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("read metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("read metrics: %s", resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("read metrics: %w", err)
	}
	return parseActions(string(body), namespace), nil
}

// parseActions sums the Prometheus text lines of the counter `action` by
// their action_type label.
func parseActions(text, namespace string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, "action{") {
			continue
		}
		end := strings.LastIndexByte(line, '}')
		if end < 0 {
			continue
		}
		labels, value := line[len("action{"):end], strings.TrimSpace(line[end+1:])
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			continue
		}
		typ := ""
		skip := false
		for _, kv := range strings.Split(labels, ",") {
			k, val, ok := strings.Cut(kv, "=")
			if !ok {
				continue
			}
			val = strings.Trim(val, `"`)
			switch k {
			case "action_type":
				typ = val
			case "namespace":
				skip = namespace != "" && val != namespace
			}
		}
		if !skip {
			out[typ] += v
		}
	}
	return out
}
