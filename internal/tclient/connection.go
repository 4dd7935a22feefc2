package tclient

import (
	"context"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// Connection follows the state of the gRPC connection a Temporal client
// dials, for vmflow_temporal_connected: a gRPC stats handler the client's
// dial options carry (DialOption). It only watches: the connection's own
// events (a transport made, a transport closed, which the SDK's keepalive
// also ends when the server stops answering) and the outcome of the calls
// the SDK makes anyway. It adds no call to Temporal.
type Connection struct {
	// open counts the transports established and not yet closed.
	open atomic.Int64
	// refused: the last call that ended did so Unauthenticated (an
	// expired or wrong API key or certificate); a call that succeeds
	// clears it.
	refused atomic.Bool
}

// DialOptions are the gRPC dial options that make c follow a client's
// connection (client.ConnectionOptions.DialOptions).
func (c *Connection) DialOptions() []grpc.DialOption {
	return []grpc.DialOption{grpc.WithStatsHandler(connStats{c})}
}

// Connected reports whether a connection to the server is open and the
// server has not refused the client's credentials at the last call.
func (c *Connection) Connected() bool { return c.open.Load() > 0 && !c.refused.Load() }

// connStats is c as a stats.Handler.
type connStats struct{ c *Connection }

func (connStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context   { return ctx }
func (connStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (s connStats) HandleRPC(_ context.Context, st stats.RPCStats) {
	end, ok := st.(*stats.End)
	if !ok || !end.IsClient() {
		return
	}
	switch status.Code(end.Error) {
	case codes.OK:
		s.c.refused.Store(false)
	case codes.Unauthenticated:
		s.c.refused.Store(true)
	}
}

func (s connStats) HandleConn(_ context.Context, st stats.ConnStats) {
	if !st.IsClient() {
		return
	}
	switch st.(type) {
	case *stats.ConnBegin:
		s.c.open.Add(1)
	case *stats.ConnEnd:
		s.c.open.Add(-1)
	}
}
