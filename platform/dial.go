package platform

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/client"
	"go.temporal.io/sdk/contrib/envconfig"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"vmflow/internal/tclient"
)

// Options configure ClientOptions and Dial. The connection itself (address,
// namespace, TLS, API key, gRPC headers) comes from the SDK's envconfig: a
// profile in the TOML config file, overridden by TEMPORAL_* environment
// variables, so production, the dev stack and CI configure both binaries the
// same way the temporal CLI is configured.
type Options struct {
	// Logger receives vmflow's dial messages and the SDK's own logs. Nil
	// logs nothing.
	Logger *zap.Logger
	// MetricsHandler, when set, is where the SDK reports its metrics (the
	// vmflow binaries pass their Prometheus registry's handler).
	MetricsHandler client.MetricsHandler
	// Identity names this process in the server's view (pollers, history);
	// empty lets the SDK use pid@hostname.
	Identity string
	// Tracing, when set (StartTracing, with an OTLP endpoint in the
	// environment), traces the client's workflow starts and, for a worker
	// built on it, its workflow and activity tasks. Nil: no interceptor.
	Tracing *Tracing
	// GRPCDialOptions are added to the SDK's own gRPC dial options (the
	// vmflow binaries add a stats handler that follows the connection for
	// vmflow_temporal_connected).
	GRPCDialOptions []grpc.DialOption

	// ConfigFile overrides TEMPORAL_CONFIG_FILE (default
	// ~/.config/temporalio/temporal.toml; a missing file is fine).
	ConfigFile string
	// Profile overrides TEMPORAL_PROFILE; a named profile must exist.
	Profile string
	// Env replaces the process environment (tests); nil reads os.Environ.
	Env envconfig.EnvLookup

	// HostPort and Namespace, when set, override what envconfig found
	// (command-line flags win over the environment).
	HostPort  string
	Namespace string

	// Insecure allows what tclient.TransportRisks names (an API key over
	// plaintext, TLS skip-verify, plaintext to a non-loopback address): the
	// binaries' --insecure flag. Without it ClientOptions and Dial refuse
	// such a connection with tclient.ErrInsecureTransport.
	Insecure bool

	// Dial retry schedule: the first wait is RetryInitial (default 500 ms),
	// doubling up to RetryMax (default 30 s). Each attempt gets
	// AttemptTimeout (default 10 s).
	RetryInitial   time.Duration
	RetryMax       time.Duration
	AttemptTimeout time.Duration
}

// ClientOptions builds the SDK client options from envconfig and o with
// vmflow's converter, logger, metrics and tracing, without connecting; an insecure
// transport without o.Insecure wraps tclient.ErrInsecureTransport.
func ClientOptions(o Options) (client.Options, error) {
	copts, err := envconfig.LoadClientOptions(envconfig.LoadClientOptionsRequest{
		ConfigFilePath:    o.ConfigFile,
		ConfigFileProfile: o.Profile,
		// A typo in the config file should stop the binary, not be ignored.
		ConfigFileStrict: true,
		EnvLookup:        o.Env,
	})
	if err != nil {
		return client.Options{}, fmt.Errorf("temporal client config: %w", err)
	}
	if o.HostPort != "" {
		copts.HostPort = o.HostPort
	}
	if o.Namespace != "" {
		copts.Namespace = o.Namespace
	}
	if copts.HostPort == "" {
		copts.HostPort = client.DefaultHostPort
	}
	if copts.Namespace == "" {
		copts.Namespace = client.DefaultNamespace
	}
	if err := tclient.CheckTransport(copts, o.Insecure); err != nil {
		return client.Options{}, err
	}
	if risks := tclient.TransportRisks(copts); len(risks) > 0 && o.Logger != nil {
		o.Logger.Warn("insecure Temporal transport allowed by --insecure", zap.String("address", copts.HostPort),
			zap.Strings("risks", risks))
	}
	// IncludeRemoteCodec stays false: a remote codec would replace our
	// converter with the SDK default, and workers would call it on every
	// replay. vmflow payloads are not encrypted.
	copts.DataConverter = DataConverter()
	copts.Logger = tclient.NewZapLogger(o.Logger)
	if o.MetricsHandler != nil {
		copts.MetricsHandler = o.MetricsHandler
	}
	copts.Identity = o.Identity
	if o.Tracing != nil {
		copts.Interceptors = append(copts.Interceptors, o.Tracing.interceptors...)
	}
	copts.ConnectionOptions.DialOptions = append(copts.ConnectionOptions.DialOptions, o.GRPCDialOptions...)
	return copts, nil
}

// Dial connects to Temporal, retrying with backoff until it answers or ctx is
// done (the agent starts before Temporal); configuration errors and refused
// credentials return at once.
func Dial(ctx context.Context, o Options) (client.Client, error) {
	copts, err := ClientOptions(o)
	if err != nil {
		return nil, err
	}
	log := o.Logger
	if log == nil {
		log = zap.NewNop()
	}
	initial, maxWait, attemptTimeout := o.RetryInitial, o.RetryMax, o.AttemptTimeout
	if initial <= 0 {
		initial = 500 * time.Millisecond
	}
	if maxWait <= 0 {
		maxWait = 30 * time.Second
	}
	if maxWait < initial {
		maxWait = initial
	}
	if attemptTimeout <= 0 {
		attemptTimeout = 10 * time.Second
	}
	tlsOn := copts.ConnectionOptions.TLS != nil && !copts.ConnectionOptions.TLSDisabled

	wait := initial
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, attemptTimeout)
		c, err := client.DialContext(actx, copts)
		cancel()
		if err == nil {
			log.Info("connected to temporal",
				zap.String("address", copts.HostPort), zap.String(tclient.KeyNamespace, copts.Namespace),
				zap.Bool("tls", tlsOn), zap.Int("attempt", attempt))
			return c, nil
		}
		if permanent(err) {
			return nil, fmt.Errorf("dial temporal at %s (namespace %s): %w", copts.HostPort, copts.Namespace, err)
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("dial temporal at %s: gave up after %d attempts: %w (last error: %w)",
				copts.HostPort, attempt, ctx.Err(), err)
		}
		log.Warn("temporal not reachable yet; retrying",
			zap.String("address", copts.HostPort), zap.String(tclient.KeyNamespace, copts.Namespace),
			zap.Int("attempt", attempt), zap.Duration("retry_in", wait), zap.Error(err))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("dial temporal at %s: gave up after %d attempts: %w (last error: %w)",
				copts.HostPort, attempt, ctx.Err(), err)
		case <-t.C:
		}
		wait = min(wait*2, maxWait)
	}
}

// permanent reports errors retrying never fixes (credentials, bad requests);
// "namespace not found" is retried, as a setup script may be creating it.
func permanent(err error) bool {
	code := codes.Unknown
	var svc serviceerror.ServiceError
	if errors.As(err, &svc) {
		code = svc.Status().Code()
	} else if st, ok := status.FromError(err); ok {
		code = st.Code()
	}
	switch code {
	case codes.Unauthenticated, codes.PermissionDenied, codes.InvalidArgument:
		return true
	}
	return false
}
