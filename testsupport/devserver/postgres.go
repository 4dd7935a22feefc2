package devserver

import (
	"context"
	"debug/buildinfo"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.temporal.io/sdk/client"

	"vmflow/internal/tclient"
	"vmflow/platform"
	"vmflow/testsupport/stacktest"
)

// Temporal is a running Temporal server for tests, whichever backend
// serves it: the dev server on SQLite (Start, Shared) or the self-hosted
// server on PostgreSQL (StartPostgres, SharedPostgres). A test written
// against it runs on either.
type Temporal interface {
	// Backend names the backend ("dev", "postgres"), e.g. for subtests.
	Backend() string
	// Address is the frontend's host:port.
	Address() string
	// Namespace is the namespace tests should use, with vmflow's search
	// attributes registered.
	Namespace() string
	// BinaryPath is the temporal CLI that reaches this server.
	BinaryPath() string
	// TClientOptions are platform.Options that reach this server.
	TClientOptions() platform.Options
	// Client returns a client with vmflow's converter, closed when t ends.
	Client(t testing.TB) client.Client
	// CLI runs the temporal CLI against this server.
	CLI(ctx context.Context, args ...string) ([]byte, error)
	// Stop ends the server (and whatever it runs on).
	Stop() error
}

var (
	_ Temporal = (*Server)(nil)
	_ Temporal = (*PostgresServer)(nil)
)

// Environment overrides for the PostgreSQL backend.
const (
	// EnvServerBinary is the temporal-server binary (temporal-sql-tool is
	// looked for beside it); default bin/temporal-server.
	EnvServerBinary = "VMFLOW_TEMPORAL_SERVER"
	// EnvPostgresBin is the folder with PostgreSQL's initdb and postgres;
	// default the newest /usr/lib/postgresql/*/bin (Debian's layout).
	EnvPostgresBin = "VMFLOW_POSTGRES_BIN"
)

// Files under deploy/ the PostgreSQL backend runs, the same ones an operator
// runs: the server's config template, the databases' setup and the
// namespace's setup.
const (
	configDir          = "deploy/temporal"
	configEnv          = "postgresql" // deploy/temporal/postgresql.yaml
	setupPostgresPath  = "deploy/temporal/setup-postgres.sh"
	setupTemporalPath  = "deploy/setup-temporal.sh"
	postgresSuperuser  = "temporal"
	postgresReadyLine  = "database system is ready to accept connections"
	searchAttrCacheTTL = 60 * time.Second // go.temporal.io/server common/searchattribute cacheRefreshInterval
)

// ErrNoPostgres says what is missing to run the PostgreSQL backend.
var ErrNoPostgres = errors.New("postgres backend unavailable")

// PostgresOptions configure StartPostgres.
type PostgresOptions struct {
	// Namespace defaults to "default"; deploy/setup-temporal.sh creates it.
	Namespace string
	// NoSetup leaves the server without a namespace: no setup-temporal.sh
	// (for the test of that script).
	NoSetup bool
	// Production runs PostgreSQL with its durable defaults (fsync,
	// synchronous commit) and the server without the test dynamic config
	// (search attributes are cached for up to a minute, as in production:
	// the start waits that minute out). Tests leave it false: fsync off, and
	// search attributes read through on every lookup, as the dev server does.
	Production bool
	// HistoryShards is the server's numHistoryShards (default 4).
	HistoryShards int
	// StartTimeout bounds the whole start (default 3 minutes).
	StartTimeout time.Duration
}

// PostgresServer is a Temporal server (go.temporal.io/server, all services
// in one process, config deploy/temporal/postgresql.yaml) on its own
// PostgreSQL cluster, both on free loopback ports, both stopped by Stop.
type PostgresServer struct {
	cli, server, sqlTool, schemaDir, pgBin, root string
	opts                                         PostgresOptions
	dir                                          string
	cred                                         *syscall.Credential

	pgPort int
	ports  map[string]int // TEMPORAL_*_PORT variables of postgresql.yaml

	mu      sync.Mutex
	pg, srv *child
}

// postgresBinaries finds temporal-server and temporal-sql-tool
// (`make temporal-server` builds both into bin/).
func postgresBinaries() (server, sqlTool string, err error) {
	server = os.Getenv(EnvServerBinary)
	if server == "" {
		root, err := stacktest.ModuleRoot()
		if err != nil {
			return "", "", fmt.Errorf("%w: %w", ErrNoPostgres, err)
		}
		server = filepath.Join(root, "bin", "temporal-server")
	}
	sqlTool = filepath.Join(filepath.Dir(server), "temporal-sql-tool")
	for _, p := range []string{server, sqlTool} {
		if _, err := os.Stat(p); err != nil {
			return "", "", fmt.Errorf("%w: %w", ErrNoPostgres, err)
		}
	}
	return server, sqlTool, nil
}

// postgresBinDir finds PostgreSQL's server programs.
func postgresBinDir() (string, error) {
	dirs := []string{os.Getenv(EnvPostgresBin)}
	if dirs[0] == "" {
		found, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
		// Newest major version first ("9" < "15" as strings: compare numbers).
		slices.SortFunc(found, func(a, b string) int {
			va, _ := strconv.Atoi(filepath.Base(filepath.Dir(a)))
			vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(b)))
			return vb - va
		})
		dirs = found
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "postgres")); err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", fmt.Errorf("%w: no initdb and postgres in %v (%s)", ErrNoPostgres, dirs, EnvPostgresBin)
}

// schemaDirOf is the server module's schema/postgresql/v12 in the module cache,
// its version read from the binary, so the Makefile alone names it.
func schemaDirOf(server string) (string, error) {
	info, err := buildinfo.ReadFile(server)
	if err != nil {
		return "", fmt.Errorf("%w: read build info of %s: %w", ErrNoPostgres, server, err)
	}
	out, err := exec.Command("go", "env", "GOMODCACHE").Output()
	if err != nil {
		return "", fmt.Errorf("%w: go env GOMODCACHE: %w", ErrNoPostgres, err)
	}
	dir := filepath.Join(strings.TrimSpace(string(out)), info.Main.Path+"@"+info.Main.Version, "schema", "postgresql", "v12")
	if _, err := os.Stat(dir); err != nil {
		return "", fmt.Errorf("%w: schema of %s %s: %w", ErrNoPostgres, info.Main.Path, info.Main.Version, err)
	}
	return dir, nil
}

// RequirePostgres skips t without a server build or PostgreSQL (`make tools`
// provides both, so CI never skips).
func RequirePostgres(t testing.TB) {
	t.Helper()
	if _, err := newPostgres(PostgresOptions{}); err != nil {
		t.Skipf("%v: `make tools` builds bin/temporal-server and installs Debian's postgresql", err)
	}
}

func newPostgres(o PostgresOptions) (*PostgresServer, error) {
	cli, err := Binary()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoPostgres, err)
	}
	server, sqlTool, err := postgresBinaries()
	if err != nil {
		return nil, err
	}
	pgBin, err := postgresBinDir()
	if err != nil {
		return nil, err
	}
	schema, err := schemaDirOf(server)
	if err != nil {
		return nil, err
	}
	root, err := stacktest.ModuleRoot()
	if err != nil {
		return nil, err
	}
	if o.Namespace == "" {
		o.Namespace = client.DefaultNamespace
	}
	if o.HistoryShards <= 0 {
		o.HistoryShards = 4
	}
	if o.StartTimeout <= 0 {
		o.StartTimeout = 3 * time.Minute
	}
	return &PostgresServer{cli: cli, server: server, sqlTool: sqlTool, schemaDir: schema, pgBin: pgBin, root: root, opts: o}, nil
}

// StartPostgres runs PostgreSQL and a Temporal server on it for t, set up by
// deploy/setup-temporal.sh unless NoSetup, and stops both when t ends.
func StartPostgres(t testing.TB, o PostgresOptions) *PostgresServer {
	t.Helper()
	RequirePostgres(t)
	s, err := startPostgres(o)
	if err != nil {
		t.Fatalf("postgres backend: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("postgres backend stop: %v", err)
		}
		if t.Failed() {
			t.Logf("postgres backend files kept for inspection: %s", s.dir)
		} else if err := os.RemoveAll(s.dir); err != nil {
			t.Errorf("remove %s: %v", s.dir, err)
		}
	})
	return s
}

var sharedPG struct {
	once sync.Once
	srv  *PostgresServer
	err  error
}

// SharedPostgres is Shared for the PostgreSQL backend: one server per test
// binary, stopped by StopShared.
func SharedPostgres(t testing.TB) *PostgresServer {
	t.Helper()
	RequirePostgres(t)
	sharedPG.once.Do(func() { sharedPG.srv, sharedPG.err = startPostgres(PostgresOptions{}) })
	if sharedPG.err != nil {
		t.Fatalf("postgres backend (shared): %v", sharedPG.err)
	}
	return sharedPG.srv
}

func startPostgres(o PostgresOptions) (*PostgresServer, error) {
	s, err := newPostgres(o)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.StartTimeout)
	defer cancel()
	if err := s.start(ctx); err != nil {
		// The error carries the logs' tails: nothing else is worth keeping.
		err = errors.Join(err, s.Stop())
		if s.dir != "" {
			err = errors.Join(err, os.RemoveAll(s.dir))
		}
		return nil, err
	}
	return s, nil
}

func (s *PostgresServer) start(ctx context.Context) error {
	// PostgreSQL refuses to run as root: initdb and postgres run as the
	// package's `postgres` user (or nobody), in a folder that user owns.
	// t.TempDir is 0700 root's, so the folder is made here.
	var err error
	if s.dir, err = os.MkdirTemp("", "vmflow-pg-"); err != nil {
		return fmt.Errorf("postgres dir: %w", err)
	}
	if os.Geteuid() == 0 {
		if s.cred, err = unprivileged(); err != nil {
			return err
		}
		if err := os.Chown(s.dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("chown %s: %w", s.dir, err)
		}
	}
	if err := s.initdb(ctx); err != nil {
		return err
	}
	if err := s.retryPorts(s.launchPostgres); err != nil {
		return err
	}
	if err := s.setupDatabases(ctx); err != nil {
		return err
	}
	if !s.opts.Production {
		if err := os.WriteFile(s.dynamicConfigFile(), []byte(testDynamicConfig), 0o644); err != nil {
			return fmt.Errorf("dynamic config: %w", err)
		}
	}
	if err := s.retryPorts(func() error { return s.launchServer(ctx) }); err != nil {
		return err
	}
	began := time.Now()
	if s.opts.NoSetup {
		return nil
	}
	if err := s.setupNamespace(ctx, s.opts.Namespace); err != nil {
		return err
	}
	if err := waitFor(ctx, s.srv.exited(), func(ctx context.Context) error { return checkReady(ctx, s.Address(), s.opts.Namespace) }); err != nil {
		return fmt.Errorf("temporal-server on %s not ready: %w\n--- server log ---\n%s", s.Address(), err, logTail(s.ServerLog()))
	}
	if s.opts.Production {
		// Without the test dynamic config, the history service sees new
		// search attributes when its cache expires: a workflow upserting
		// them before that fails its tasks and retries.
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the search-attribute cache: %w", ctx.Err())
		case <-time.After(time.Until(began.Add(searchAttrCacheTTL + time.Second))):
		}
	}
	return nil
}

// testDynamicConfig is the dev server's own default (CLI v1.5.1
// defaultDynamicConfigValues): new search attributes usable at once, with
// the persistence QPS raised for the extra reads that costs.
const testDynamicConfig = `system.forceSearchAttributesCacheRefreshOnRead:
  - value: true
frontend.persistenceMaxQPS:
  - value: 10000
history.persistenceMaxQPS:
  - value: 45000
`

func (s *PostgresServer) dynamicConfigFile() string {
	return filepath.Join(s.dir, "dynamicconfig.yaml")
}

// unprivileged is the user PostgreSQL runs as when the tests run as root.
func unprivileged() (*syscall.Credential, error) {
	var errs []error
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err := errors.Join(err1, err2); err != nil {
			errs = append(errs, fmt.Errorf("user %s: %w", name, err))
			continue
		}
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
	}
	return nil, fmt.Errorf("no unprivileged user for PostgreSQL: %w", errors.Join(errs...))
}

// retryPorts runs launch up to three times: free ports are found by binding
// :0 and closing, so another process can take one before we bind it.
func (s *PostgresServer) retryPorts(launch func() error) error {
	var err error
	for range 3 {
		if err = launch(); err == nil {
			return nil
		}
	}
	return err
}

func (s *PostgresServer) initdb(ctx context.Context) error {
	cmd := exec.CommandContext(ctx, filepath.Join(s.pgBin, "initdb"),
		"-D", s.dataDir(), "-U", postgresSuperuser, "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync")
	cmd.Dir = s.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %w\n%s", err, out)
	}
	return nil
}

func (s *PostgresServer) dataDir() string { return filepath.Join(s.dir, "data") }

// PostgresLog is PostgreSQL's log.
func (s *PostgresServer) PostgresLog() string { return filepath.Join(s.dir, "postgres.log") }

// ServerLog is the Temporal server's log.
func (s *PostgresServer) ServerLog() string { return filepath.Join(s.dir, "temporal-server.log") }

func (s *PostgresServer) launchPostgres() error {
	var err error
	if s.pgPort, err = freePort("127.0.0.1"); err != nil {
		return err
	}
	args := []string{"-D", s.dataDir(), "-p", strconv.Itoa(s.pgPort), "-k", s.dir,
		"-c", "listen_addresses=127.0.0.1",
		// Temporal opens a pool per service and store (postgresql.yaml:
		// TEMPORAL_PG_MAX_CONNS); 100, the default, is too few for 1,000 VMs.
		"-c", "max_connections=300"}
	if !s.opts.Production {
		// Tests do not survive a power cut either: skip the fsyncs.
		args = append(args, "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
	}
	cmd := exec.Command(filepath.Join(s.pgBin, "postgres"), args...)
	cmd.Dir = s.dir
	pg, err := startChild("postgres", cmd, s.PostgresLog(), s.cred)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.pg = pg
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = waitFor(ctx, pg.exited(), func(context.Context) error {
		b, err := os.ReadFile(s.PostgresLog())
		if err != nil {
			return err
		}
		// The log is appended to across attempts: only a line after this
		// start's own "starting PostgreSQL" counts.
		text := string(b)
		if i := strings.LastIndex(text, "starting PostgreSQL"); i >= 0 && strings.Contains(text[i:], postgresReadyLine) {
			return nil
		}
		return errors.New("not ready yet")
	})
	if err != nil {
		stopErr := pg.stop(syscall.SIGINT, 15*time.Second)
		return errors.Join(fmt.Errorf("postgres on port %d: %w (exit: %v)\n--- log ---\n%s", s.pgPort, err, pg.waitErr(), logTail(s.PostgresLog())), stopErr)
	}
	return nil
}

// setupDatabases runs deploy/temporal/setup-postgres.sh, as an operator
// would, with this build's temporal-sql-tool and schema.
func (s *PostgresServer) setupDatabases(ctx context.Context) error {
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(s.root, setupPostgresPath))
	cmd.Env = append(os.Environ(),
		"SQL_TOOL="+s.sqlTool, "SCHEMA_DIR="+s.schemaDir,
		"SQL_HOST=127.0.0.1", "SQL_PORT="+strconv.Itoa(s.pgPort), "SQL_USER="+postgresSuperuser)
	logPath := filepath.Join(s.dir, "setup-postgres.log")
	out, err := cmd.CombinedOutput()
	if werr := os.WriteFile(logPath, out, 0o644); werr != nil && err == nil {
		err = werr
	}
	if err != nil {
		return fmt.Errorf("%s: %w\n%s", setupPostgresPath, err, tail(out, 4000))
	}
	return nil
}

// serverPortVars are postgresql.yaml's port variables.
var serverPortVars = []string{
	"TEMPORAL_FRONTEND_PORT", "TEMPORAL_FRONTEND_HTTP_PORT", "TEMPORAL_FRONTEND_MEMBERSHIP_PORT",
	"TEMPORAL_HISTORY_PORT", "TEMPORAL_HISTORY_MEMBERSHIP_PORT",
	"TEMPORAL_MATCHING_PORT", "TEMPORAL_MATCHING_MEMBERSHIP_PORT",
	"TEMPORAL_WORKER_PORT", "TEMPORAL_WORKER_MEMBERSHIP_PORT",
	"TEMPORAL_METRICS_PORT",
}

// maxMembershipPort: the server records each service's membership port in
// cluster_membership.rpc_port, a SMALLINT in schema/postgresql/v12, so a port
// from the kernel's ephemeral range (32768 and up) makes the start fail
// ("value out of range for type smallint"). Every port is taken below it.
const maxMembershipPort = 32767

// listenBelow listens on a free loopback port in [10000, max], tried in
// random order.
func listenBelow(max int) (net.Listener, error) {
	const lowest = 10000
	var last error
	for range 200 {
		port := lowest + rand.IntN(max-lowest+1)
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err == nil {
			return ln, nil
		}
		last = err
	}
	return nil, fmt.Errorf("no free port in [%d, %d]: %w", lowest, max, last)
}

func (s *PostgresServer) launchServer(ctx context.Context) error {
	s.ports = map[string]int{}
	// Listening on all of them until every port is chosen keeps them
	// distinct from each other.
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for _, v := range serverPortVars {
		ln, err := listenBelow(maxMembershipPort)
		if err != nil {
			return err
		}
		lns = append(lns, ln)
		s.ports[v] = ln.Addr().(*net.TCPAddr).Port
	}
	for _, l := range lns {
		l.Close()
	}
	lns = nil
	env := []string{
		"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"),
		"TEMPORAL_PG_HOST=127.0.0.1", "TEMPORAL_PG_PORT=" + strconv.Itoa(s.pgPort),
		"TEMPORAL_PG_USER=" + postgresSuperuser,
		"TEMPORAL_NUM_HISTORY_SHARDS=" + strconv.Itoa(s.opts.HistoryShards),
		"TEMPORAL_BIND_IP=127.0.0.1",
		"TEMPORAL_METRICS_ADDRESS=127.0.0.1:" + strconv.Itoa(s.ports["TEMPORAL_METRICS_PORT"]),
		"TEMPORAL_LOG_LEVEL=warn",
	}
	for _, v := range serverPortVars {
		env = append(env, v+"="+strconv.Itoa(s.ports[v]))
	}
	if !s.opts.Production {
		env = append(env, "TEMPORAL_DYNAMIC_CONFIG_FILE="+s.dynamicConfigFile())
	}
	cmd := exec.Command(s.server, "--root", "/", "--config", filepath.Join(s.root, configDir), "--env", configEnv, "--allow-no-auth", "start")
	cmd.Env = env
	cmd.Dir = s.dir
	srv, err := startChild("temporal-server", cmd, s.ServerLog(), nil)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	if err := waitFor(ctx, srv.exited(), s.serving); err != nil {
		stopErr := srv.stop(syscall.SIGTERM, 15*time.Second)
		return errors.Join(fmt.Errorf("temporal-server on %s not serving: %w (exit: %v)\n--- server log ---\n%s", s.Address(), err, srv.waitErr(), logTail(s.ServerLog())), stopErr)
	}
	return nil
}

// serving: the frontend answers its health check and GetSystemInfo (which
// needs no namespace).
func (s *PostgresServer) serving(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	c, err := client.DialContext(cctx, client.Options{HostPort: s.Address(), Logger: tclient.NewZapLogger(nil)})
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	defer c.Close()
	if _, err := c.CheckHealth(cctx, &client.CheckHealthRequest{}); err != nil {
		return fmt.Errorf("health: %w", err)
	}
	return nil
}

// setupNamespace runs deploy/setup-temporal.sh against this server for
// namespace, returning its error with its output.
func (s *PostgresServer) setupNamespace(ctx context.Context, namespace string) error {
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(s.root, setupTemporalPath))
	cmd.Env = append(os.Environ(),
		"TEMPORAL="+s.cli,
		"TEMPORAL_ADDRESS="+s.Address(),
		"TEMPORAL_NAMESPACE="+namespace,
		"TEMPORAL_CONFIG_FILE="+filepath.Join(s.dir, "no-temporal-config.toml"))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s for namespace %s: %w\n%s", setupTemporalPath, namespace, err, out)
	}
	return nil
}

// Backend is "postgres".
func (s *PostgresServer) Backend() string { return "postgres" }

// Address is the frontend's host:port.
func (s *PostgresServer) Address() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.ports["TEMPORAL_FRONTEND_PORT"]))
}

// MetricsAddress is host:port of the server's Prometheus metrics.
func (s *PostgresServer) MetricsAddress() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.ports["TEMPORAL_METRICS_PORT"]))
}

// Namespace is the namespace set up for tests.
func (s *PostgresServer) Namespace() string { return s.opts.Namespace }

// BinaryPath is the temporal CLI (bin/temporal), which reaches this server
// like any other.
func (s *PostgresServer) BinaryPath() string { return s.cli }

// TClientOptions are platform.Options that reach this server.
func (s *PostgresServer) TClientOptions() platform.Options {
	return tclientOptions(s.Address(), s.opts.Namespace, s.dir)
}

// Client returns a client with vmflow's converter, closed when t ends.
func (s *PostgresServer) Client(t testing.TB) client.Client {
	t.Helper()
	return dialClient(t, s.TClientOptions())
}

// CLI runs the temporal CLI against this server.
func (s *PostgresServer) CLI(ctx context.Context, args ...string) ([]byte, error) {
	return runCLI(ctx, s.cli, s.dir, s.Address(), s.opts.Namespace, args)
}

// ServerPid is the Temporal server's process id (for CPU accounting).
func (s *PostgresServer) ServerPid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv == nil {
		return 0
	}
	return s.srv.pid()
}

// PostgresPid is the postmaster's process id: every PostgreSQL process of
// this cluster is its child (for CPU accounting).
func (s *PostgresServer) PostgresPid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pg == nil {
		return 0
	}
	return s.pg.pid()
}

// Stop ends Temporal (SIGTERM), then PostgreSQL (SIGINT, fast shutdown), each
// SIGKILLed after 15 s; the files stay.
func (s *PostgresServer) Stop() error {
	s.mu.Lock()
	srv, pg := s.srv, s.pg
	s.mu.Unlock()
	var errs []error
	if srv != nil {
		errs = append(errs, srv.stop(syscall.SIGTERM, 15*time.Second))
	}
	if pg != nil {
		errs = append(errs, pg.stop(syscall.SIGINT, 15*time.Second))
	}
	return errors.Join(errs...)
}

// waitFor polls check every 100 ms until it returns nil, the process exits
// or ctx ends.
func waitFor(ctx context.Context, exited <-chan struct{}, check func(context.Context) error) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		if last = check(ctx); last == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("process exited (last check: %w)", last)
		case <-ctx.Done():
			return fmt.Errorf("%w (last check: %w)", ctx.Err(), last)
		case <-tick.C:
		}
	}
}

func logTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return tail(b, 4000)
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
