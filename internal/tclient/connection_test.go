package tclient

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
)

// connectedGauge is vmflow_temporal_connected as m serves it.
func connectedGauge(t *testing.T, m *Metrics) string {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		if strings.HasPrefix(line, "vmflow_temporal_connected ") {
			return strings.TrimPrefix(line, "vmflow_temporal_connected ")
		}
	}
	t.Fatalf("no vmflow_temporal_connected in /metrics:\n%s", rec.Body.String())
	return ""
}

// TestConnectedFollowsTheConnection: vmflow_temporal_connected is 0 before
// any dial, 1 once a call went through a connection, 0 while the server
// refuses the credentials, 1 again once a call succeeds, and 0 once the
// server is gone (its transport closed). A real gRPC server answers the
// calls; the gauge never makes one of its own (calls counts them).
func TestConnectedFollowsTheConnection(t *testing.T) {
	m, err := NewMetrics()
	require.NoError(t, err)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	assert.Equal(t, "0", connectedGauge(t, m), "before a dial")

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var refuse atomic.Bool
	var calls atomic.Int32
	srv := grpc.NewServer(grpc.UnknownServiceHandler(func(_ any, ss grpc.ServerStream) error {
		calls.Add(1)
		if refuse.Load() {
			return status.Error(codes.Unauthenticated, "API key expired")
		}
		var in emptypb.Empty
		if err := ss.RecvMsg(&in); err != nil {
			return err
		}
		return ss.SendMsg(&emptypb.Empty{})
	}))
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	conn, err := grpc.NewClient(lis.Addr().String(), append(m.Connection.DialOptions(),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	require.NoError(t, err)
	defer conn.Close()
	call := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return conn.Invoke(ctx, "/temporal.api.workflowservice.v1.WorkflowService/GetSystemInfo", &emptypb.Empty{}, &emptypb.Empty{})
	}
	require.NoError(t, call())
	assert.Equal(t, "1", connectedGauge(t, m), "a call went through")

	refuse.Store(true)
	assert.Equal(t, codes.Unauthenticated, status.Code(call()))
	assert.Equal(t, "0", connectedGauge(t, m), "credentials refused, the connection open")
	refuse.Store(false)
	require.NoError(t, call())
	assert.Equal(t, "1", connectedGauge(t, m), "accepted again")

	before := calls.Load()
	for range 3 {
		connectedGauge(t, m)
	}
	assert.Equal(t, before, calls.Load(), "a scrape makes no call")

	srv.Stop()
	require.Eventually(t, func() bool { return connectedGauge(t, m) == "0" }, 10*time.Second, 10*time.Millisecond,
		"the server is gone")
}
