package devserver

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
	"vmflow/internal/tclient/tclienttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/client"

	"vmflow/internal/tclient"
	"vmflow/platform"
)

// tlsProxy terminates TLS on a loopback port and forwards the bytes to the
// dev server (which serves no TLS), so the envconfig TLS settings get a real
// handshake. It returns the proxy's address and the CA PEM to trust.
func tlsProxy(t *testing.T, backend string) (addr string, caPEM []byte) {
	t.Helper()
	caPEM, keyPEM := tclienttest.SelfSigned(t)
	cert, err := tls.X509KeyPair(caPEM, keyPEM)
	require.NoError(t, err)

	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{cert},
		NextProtos:   []string{"h2"}, // gRPC insists on ALPN h2
		MinVersion:   tls.VersionTLS12,
	})
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	track := func(c net.Conn) { mu.Lock(); conns = append(conns, c); mu.Unlock() }
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return // listener closed
			}
			out, err := net.DialTimeout("tcp", backend, 5*time.Second)
			if err != nil {
				_ = in.Close()
				continue
			}
			track(in)
			track(out)
			wg.Add(2)
			go func() { defer wg.Done(); _, _ = io.Copy(out, in); _ = out.Close() }()
			go func() { defer wg.Done(); _, _ = io.Copy(in, out); _ = in.Close() }()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String(), caPEM
}

type mapEnv = tclienttest.Env

func TestDialTLSThroughProxy(t *testing.T) {
	s := Shared(t)
	addr, caPEM := tlsProxy(t, s.Address())

	base := s.TClientOptions()
	base.HostPort = "" // from the environment this time
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	opts := base
	opts.Env = mapEnv{
		"TEMPORAL_ADDRESS":                 addr,
		"TEMPORAL_NAMESPACE":               s.Namespace(),
		"TEMPORAL_TLS":                     "true",
		"TEMPORAL_TLS_SERVER_CA_CERT_DATA": string(caPEM),
		"TEMPORAL_TLS_SERVER_NAME":         "temporal.test",
	}
	c, err := platform.Dial(ctx, opts)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.CheckHealth(ctx, &client.CheckHealthRequest{})
	require.NoError(t, err)

	// Real attribute creation through the operator service, over TLS: a
	// test-only attribute, created once, then a no-op.
	attrs := map[string]enumspb.IndexedValueType{"VmflowTestOnly": enumspb.INDEXED_VALUE_TYPE_KEYWORD}
	require.NoError(t, tclient.EnsureSearchAttributes(ctx, c, s.Namespace(), attrs))
	require.NoError(t, tclient.EnsureSearchAttributes(ctx, c, s.Namespace(), attrs))
	err = tclient.EnsureSearchAttributes(ctx, c, s.Namespace(), map[string]enumspb.IndexedValueType{"VmStage": enumspb.INDEXED_VALUE_TYPE_BOOL})
	assert.ErrorContains(t, err, "VmStage is Keyword, vmflow needs Bool")

	// Without the CA the handshake fails, and Dial says so rather than
	// connecting in the clear: a short deadline ends the retries. Each
	// attempt has time for a handshake on a loaded machine (with 500 ms
	// one CI run saw no handshake finish, only deadlines).
	opts.Env = mapEnv{"TEMPORAL_ADDRESS": addr, "TEMPORAL_TLS": "true", "TEMPORAL_TLS_SERVER_NAME": "temporal.test"}
	opts.AttemptTimeout = 2 * time.Second
	short, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	_, err = platform.Dial(short, opts)
	require.Error(t, err)
	assert.True(t, errors.Is(err, context.DeadlineExceeded), err.Error())
	assert.Contains(t, err.Error(), "certificate")
}
