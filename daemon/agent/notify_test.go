package agent

import (
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"vmflow/daemon"
	"vmflow/hostagent/admission"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/devserver"
)

// notifySocket is what systemd hands a Type=notify service: a datagram
// socket named in NOTIFY_SOCKET, here with a 200 ms watchdog. t.Setenv: the
// agent reads the process environment, as under systemd.
func notifySocket(t *testing.T) *net.UnixConn {
	t.Helper()
	p := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: p, Net: "unixgram"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	t.Setenv("NOTIFY_SOCKET", p)
	t.Setenv("WATCHDOG_USEC", "200000")
	return conn
}

// nextState reads datagrams until one is state, or fails at the deadline.
// It returns what was read before it.
func nextState(t *testing.T, conn *net.UnixConn, state string, timeout time.Duration) []string {
	t.Helper()
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(timeout)))
	var before []string
	buf := make([]byte, 4096)
	for {
		n, err := conn.Read(buf)
		require.NoError(t, err, "waiting for %s; read so far: %q", state, before)
		msg := strings.TrimSpace(string(buf[:n]))
		if msg == state {
			return before
		}
		before = append(before, msg)
	}
}

// freeAddr is a local TCP address nothing listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// waitHTTP polls url until it answers code, with a deadline.
func waitHTTP(t *testing.T, url string, code int, timeout time.Duration) string {
	t.Helper()
	var body string
	require.Eventually(t, func() bool {
		var got int
		got, body = get(url)
		return got == code
	}, timeout, 20*time.Millisecond, "%s never answered %d; last: %q", url, code, body)
	return body
}

func get(url string) (int, string) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b := make([]byte, 4096)
	n, _ := resp.Body.Read(b)
	return resp.StatusCode, string(b[:n])
}

// TestNotifyReadyAfterReattach: under Type=notify the agent says READY=1
// once re-attach is done, and only then, whatever Temporal's state and with
// a record that cannot be read (supervising is what "started" means for
// systemd; invariant 12); WATCHDOG=1 follows every half WATCHDOG_USEC, and
// STOPPING=1 on SIGTERM. /healthz answers throughout; /readyz only once the
// Temporal worker polls too. Before, the agent sent nothing: a Type=notify
// unit would have timed out its start and restarted it forever.
func TestNotifyReadyAfterReattach(t *testing.T) {
	for _, tc := range []struct {
		name        string
		temporalUp  bool
		unreadable  bool
		readyzAfter int
	}{
		{name: "temporal up", temporalUp: true, readyzAfter: http.StatusOK},
		{name: "temporal down, unreadable record", unreadable: true, readyzAfter: http.StatusServiceUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			st, err := store.New(dir)
			require.NoError(t, err)
			if tc.unreadable {
				req := &vmflowv1.SpawnRequest{InstanceId: "torn", Vcpus: 1, MemoryMib: 64, Machine: "none"}
				_, err = st.Create(context.Background(), &vmflowv1.InstanceRecord{Id: "torn", Spec: admission.RecordSpec(req)})
				require.NoError(t, err)
				p, err := st.Paths("torn")
				require.NoError(t, err)
				require.NoError(t, os.WriteFile(p.Record, []byte(`{"id": "torn", "sp`), 0o600))
			}
			address, namespace := freeAddr(t), "default" // Temporal down: nothing listens
			if tc.temporalUp {
				srv := devserver.Start(t, devserver.Options{})
				address, namespace = srv.Address(), srv.Namespace()
			}
			conn := notifySocket(t)
			metricsAddr := freeAddr(t)
			core, logs := observer.New(zapcore.InfoLevel)
			cfg := Config{
				HostID: "h-notify", StateDir: dir, VGPUDriver: "none", TaskQueue: "vmflow", ReconcileEvery: time.Hour,
				GracefulTimeout: time.Second, GroupExitCap: time.Second,
				Flags: daemon.Flags{Address: address, Namespace: namespace, LogLevel: "info", MetricsAddr: metricsAddr,
					StopTimeout: time.Second, Logger: zap.New(core)},
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- Run(ctx, cfg) }()

			before := nextState(t, conn, "READY=1", 30*time.Second)
			assert.NotContains(t, before, "READY=1")
			require.Equal(t, 1, logs.FilterMessage("supervising").Len(), "READY=1 comes after re-attach")
			if tc.unreadable {
				assert.Equal(t, 1, logs.FilterMessageSnippet("record unreadable").Len())
			}
			// At least two pings after READY=1: a loop, not one message.
			nextState(t, conn, "WATCHDOG=1", 5*time.Second)
			nextState(t, conn, "WATCHDOG=1", 5*time.Second)

			base := "http://" + metricsAddr
			waitHTTP(t, base+"/healthz", http.StatusOK, 10*time.Second)
			body := waitHTTP(t, base+"/readyz", tc.readyzAfter, 30*time.Second)
			if tc.readyzAfter != http.StatusOK {
				assert.Contains(t, body, "temporal: the Temporal worker is not polling yet")
				assert.NotContains(t, body, "reattach")
			}

			cancel()
			nextState(t, conn, "STOPPING=1", 10*time.Second)
			select {
			case err := <-done:
				assert.NoError(t, err)
			case <-time.After(20 * time.Second):
				t.Fatal("the agent did not stop")
			}
		})
	}
}
