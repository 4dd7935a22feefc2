package service

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
)

// notifySocket listens where NOTIFY_SOCKET points and returns what arrives.
func notifySocket(t *testing.T) <-chan string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	t.Setenv("NOTIFY_SOCKET", path)
	out := make(chan string, 100)
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := conn.Read(buf)
			if err != nil {
				return
			}
			out <- string(buf[:n])
		}
	}()
	return out
}

// TestWatchdogPingsOnlyWhileAlive: a ping says the service works, so a
// probe that fails or hangs stops the pings (systemd then restarts the
// service), and they resume when it answers again.
func TestWatchdogPingsOnlyWhileAlive(t *testing.T) {
	msgs := notifySocket(t)
	t.Setenv("WATCHDOG_USEC", "200000") // 200 ms: a ping every 100 ms
	var healthy = make(chan bool, 1)
	healthy <- false
	alive := func(ctx context.Context) error {
		ok := <-healthy
		healthy <- ok
		if !ok {
			<-ctx.Done() // wedged: never answers
			return ctx.Err()
		}
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = Watchdog(ctx, zap.NewNop(), alive) }()

	pings := func(d time.Duration) int {
		n := 0
		deadline := time.After(d)
		for {
			select {
			case m := <-msgs:
				if strings.Contains(m, "WATCHDOG=1") {
					n++
				}
			case <-deadline:
				return n
			}
		}
	}
	assert.Zero(t, pings(600*time.Millisecond), "no ping while the service does not answer")
	<-healthy
	healthy <- true
	assert.Positive(t, pings(600*time.Millisecond), "pings resume once it answers")
}

func TestProbe(t *testing.T) {
	assert.NoError(t, probe(context.Background(), time.Second, nil))
	assert.ErrorIs(t, probe(context.Background(), time.Second, func(context.Context) error { return errors.ErrUnsupported }), errors.ErrUnsupported)
	err := probe(context.Background(), 20*time.Millisecond, func(context.Context) error { select {} })
	assert.ErrorIs(t, err, context.DeadlineExceeded)
}
