package platform

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/client"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"vmflow/internal/tclient"
	"vmflow/internal/tclient/tclienttest"
)

// fakeEnv is an environment for envconfig that is not the process's.
type fakeEnv = tclienttest.Env

// env returns e with TEMPORAL_CONFIG_FILE pointing at a file that does not
// exist, so the developer's own ~/.config/temporalio is never read.
func env(t *testing.T, e fakeEnv) fakeEnv {
	t.Helper()
	if _, ok := e["TEMPORAL_CONFIG_FILE"]; !ok {
		e["TEMPORAL_CONFIG_FILE"] = filepath.Join(t.TempDir(), "absent.toml")
	}
	return e
}

func TestClientOptionsFromEnv(t *testing.T) {
	certPEM, keyPEM := tclienttest.SelfSigned(t)
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "client.pem"), filepath.Join(dir, "client.key")
	require.NoError(t, os.WriteFile(certFile, certPEM, 0o600))
	require.NoError(t, os.WriteFile(keyFile, keyPEM, 0o600))

	for _, tc := range []struct {
		name      string
		env       fakeEnv
		opts      Options
		address   string
		namespace string
		tls       bool
		check     func(t *testing.T, o client.Options)
	}{
		{
			name: "nothing set: local dev server, no TLS", env: fakeEnv{},
			address: "localhost:7233", namespace: "default", tls: false,
		},
		{
			name:    "address and namespace (plaintext to a remote host needs --insecure)",
			env:     fakeEnv{"TEMPORAL_ADDRESS": "temporal.internal:7233", "TEMPORAL_NAMESPACE": "vmflow"},
			opts:    Options{Insecure: true},
			address: "temporal.internal:7233", namespace: "vmflow", tls: false,
		},
		{
			name:    "TLS switched on",
			env:     fakeEnv{"TEMPORAL_ADDRESS": "t:7233", "TEMPORAL_TLS": "true", "TEMPORAL_TLS_SERVER_NAME": "temporal.test"},
			address: "t:7233", namespace: "default", tls: true,
			check: func(t *testing.T, o client.Options) {
				assert.Equal(t, "temporal.test", o.ConnectionOptions.TLS.ServerName)
			},
		},
		{
			name:    "TLS switched off explicitly",
			env:     fakeEnv{"TEMPORAL_TLS": "false"},
			address: "localhost:7233", namespace: "default", tls: false,
			check: func(t *testing.T, o client.Options) { assert.True(t, o.ConnectionOptions.TLSDisabled) },
		},
		{
			name: "mTLS with client cert, key and server CA",
			env: fakeEnv{
				"TEMPORAL_ADDRESS":                 "ns.tmprl.cloud:7233",
				"TEMPORAL_NAMESPACE":               "ns.acct",
				"TEMPORAL_TLS_CLIENT_CERT_PATH":    certFile,
				"TEMPORAL_TLS_CLIENT_KEY_PATH":     keyFile,
				"TEMPORAL_TLS_SERVER_CA_CERT_DATA": string(certPEM),
			},
			address: "ns.tmprl.cloud:7233", namespace: "ns.acct", tls: true,
			check: func(t *testing.T, o client.Options) {
				assert.Len(t, o.ConnectionOptions.TLS.Certificates, 1)
				assert.NotNil(t, o.ConnectionOptions.TLS.RootCAs)
				assert.False(t, o.ConnectionOptions.TLS.InsecureSkipVerify)
			},
		},
		{
			name:    "API key turns TLS on by default",
			env:     fakeEnv{"TEMPORAL_ADDRESS": "x:7233", "TEMPORAL_API_KEY": "secret"},
			address: "x:7233", namespace: "default", tls: true,
			check: func(t *testing.T, o client.Options) { assert.NotNil(t, o.Credentials) },
		},
		{
			name:    "flags override the environment",
			env:     fakeEnv{"TEMPORAL_ADDRESS": "env:7233", "TEMPORAL_NAMESPACE": "env"},
			opts:    Options{HostPort: "flag:7233", Namespace: "flag", Identity: "hostagent@h1", Insecure: true},
			address: "flag:7233", namespace: "flag",
			check: func(t *testing.T, o client.Options) { assert.Equal(t, "hostagent@h1", o.Identity) },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := tc.opts
			o.Env = env(t, tc.env)
			got, err := ClientOptions(o)
			require.NoError(t, err)
			assert.Equal(t, tc.address, got.HostPort)
			assert.Equal(t, tc.namespace, got.Namespace)
			tlsOn := got.ConnectionOptions.TLS != nil && !got.ConnectionOptions.TLSDisabled
			assert.Equal(t, tc.tls, tlsOn, "TLS")
			assert.Same(t, DataConverter(), got.DataConverter)
			assert.IsType(t, &tclient.ZapLogger{}, got.Logger)
			if tc.check != nil {
				tc.check(t, got)
			}
		})
	}
}

func TestClientOptionsProfileFile(t *testing.T) {
	certPEM, _ := tclienttest.SelfSigned(t)
	dir := t.TempDir()
	caFile := filepath.Join(dir, "ca.pem")
	require.NoError(t, os.WriteFile(caFile, certPEM, 0o600))
	conf := filepath.Join(dir, "temporal.toml")
	require.NoError(t, os.WriteFile(conf, []byte(`
[profile.default]
address = "localhost:7233"

[profile.prod]
address = "temporal.prod:7233"
namespace = "vmflow-prod"
[profile.prod.tls]
server_ca_cert_path = "`+caFile+`"
server_name = "temporal.test"
[profile.prod.grpc_meta]
x-team = "vm"
`), 0o600))

	got, err := ClientOptions(Options{Env: fakeEnv{"TEMPORAL_CONFIG_FILE": conf, "TEMPORAL_PROFILE": "prod"}})
	require.NoError(t, err)
	assert.Equal(t, "temporal.prod:7233", got.HostPort)
	assert.Equal(t, "vmflow-prod", got.Namespace)
	require.NotNil(t, got.ConnectionOptions.TLS)
	assert.NotNil(t, got.ConnectionOptions.TLS.RootCAs)
	assert.NotNil(t, got.HeadersProvider)

	// The environment overrides the file.
	got, err = ClientOptions(Options{Env: fakeEnv{"TEMPORAL_CONFIG_FILE": conf, "TEMPORAL_PROFILE": "prod", "TEMPORAL_NAMESPACE": "other"}})
	require.NoError(t, err)
	assert.Equal(t, "other", got.Namespace)

	// Options.Profile and ConfigFile win over the environment's.
	got, err = ClientOptions(Options{ConfigFile: conf, Profile: "default", Env: fakeEnv{"TEMPORAL_PROFILE": "prod"}})
	require.NoError(t, err)
	assert.Equal(t, "localhost:7233", got.HostPort)

	// A named profile that does not exist is an error, not a silent default.
	_, err = ClientOptions(Options{ConfigFile: conf, Profile: "staging", Env: fakeEnv{}})
	assert.ErrorContains(t, err, "staging")

	// A typo in the file is an error too.
	bad := filepath.Join(dir, "bad.toml")
	require.NoError(t, os.WriteFile(bad, []byte("[profile.default]\nadress = \"x:1\"\n"), 0o600))
	_, err = ClientOptions(Options{ConfigFile: bad, Env: fakeEnv{}})
	assert.ErrorContains(t, err, "adress")

	// Half an mTLS pair is refused.
	_, err = ClientOptions(Options{Env: env(t, fakeEnv{"TEMPORAL_TLS_CLIENT_CERT_PATH": caFile})})
	assert.ErrorContains(t, err, "TLS")
}

func TestDialRetriesUntilContextDone(t *testing.T) {
	// A port nothing listens on: take one and close it.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())

	core, logs := observer.New(zapcore.DebugLevel)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	c, err := Dial(ctx, Options{
		Logger: zap.New(core), Env: env(t, fakeEnv{"TEMPORAL_ADDRESS": addr}),
		RetryInitial: 50 * time.Millisecond, RetryMax: 200 * time.Millisecond, AttemptTimeout: 300 * time.Millisecond,
	})
	require.Error(t, err)
	assert.Nil(t, c)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), addr)
	assert.Less(t, time.Since(start), 5*time.Second, "Dial returns soon after ctx is done")

	retries := logs.FilterMessage("temporal not reachable yet; retrying").AllUntimed()
	require.GreaterOrEqual(t, len(retries), 2, "several attempts within 2 s")
	for i, e := range retries {
		m := e.ContextMap()
		assert.Equal(t, int64(i+1), m["attempt"], "one line per attempt, in order")
		assert.Equal(t, addr, m["address"])
		assert.NotEmpty(t, m["error"])
	}
}

func TestDialConfigErrorIsImmediate(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	_, err := Dial(ctx, Options{Profile: "nope", Env: env(t, fakeEnv{})})
	require.Error(t, err)
	assert.True(t, strings.Contains(err.Error(), "nope"), err.Error())
	assert.Less(t, time.Since(start), 5*time.Second)
}

func TestPermanentErrors(t *testing.T) {
	assert.True(t, permanent(fmt.Errorf("wrapped: %w", serviceerror.NewPermissionDenied("no", ""))))
	assert.True(t, permanent(status.Error(codes.Unauthenticated, "bad key")))
	assert.True(t, permanent(serviceerror.NewInvalidArgument("bad")))
	assert.False(t, permanent(serviceerror.NewUnavailable("down")))
	assert.False(t, permanent(serviceerror.NewNamespaceNotFound("vmflow")))
	assert.False(t, permanent(errors.New("connection refused")))
	assert.False(t, permanent(context.DeadlineExceeded))
}

// TestClientOptionsRefusesInsecureTransport: what envconfig accepted as
// given (an API key over plaintext, skip-verify, plaintext to a remote
// host) is refused unless --insecure says so; loopback plaintext without
// credentials (make dev) stays allowed. Fails if the client connects
// with only an info line.
func TestClientOptionsRefusesInsecureTransport(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  fakeEnv
		risk string // "" : allowed without --insecure
	}{
		{"loopback plaintext (make dev)", fakeEnv{"TEMPORAL_ADDRESS": "127.0.0.1:7233"}, ""},
		{"localhost plaintext", fakeEnv{}, ""},
		{"remote with TLS and an API key", fakeEnv{"TEMPORAL_ADDRESS": "ns.tmprl.cloud:7233", "TEMPORAL_API_KEY": "k"}, ""},
		{"API key over plaintext, even to loopback", fakeEnv{"TEMPORAL_API_KEY": "k", "TEMPORAL_TLS": "false"}, "API key) over plaintext"},
		{"skip-verify", fakeEnv{"TEMPORAL_ADDRESS": "t:7233", "TEMPORAL_TLS": "true", "TEMPORAL_TLS_DISABLE_HOST_VERIFICATION": "true"}, "skip-verify"},
		{"plaintext to a remote host", fakeEnv{"TEMPORAL_ADDRESS": "10.1.2.3:7233"}, "not a loopback address"},
		{"plaintext to a name", fakeEnv{"TEMPORAL_ADDRESS": "temporal.internal:7233"}, "not a loopback address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ClientOptions(Options{Env: env(t, tc.env)})
			if tc.risk == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, tclient.ErrInsecureTransport)
			assert.ErrorContains(t, err, tc.risk)
			assert.ErrorContains(t, err, "--insecure")
			_, err = Dial(context.Background(), Options{Env: env(t, tc.env), RetryInitial: time.Millisecond})
			assert.ErrorIs(t, err, tclient.ErrInsecureTransport, "Dial refuses without dialing")

			_, err = ClientOptions(Options{Env: env(t, tc.env), Insecure: true})
			assert.NoError(t, err, "--insecure allows it")
		})
	}
}
