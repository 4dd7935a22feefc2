package probe

import (
	"bufio"
	"context"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/guest"
)

// serve runs Serve on a loopback port for the test and returns its address.
func serve(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		assert.ErrorIs(t, <-done, context.Canceled)
	})
	return ln.Addr().String()
}

// closedPort is a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// ask sends request with the host side's client and returns the reply.
func ask(t *testing.T, addr, request string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp4", addr, 5*time.Second)
	require.NoError(t, err)
	defer c.Close()
	reply, err := guest.Probe(c, request, time.Now().Add(10*time.Second))
	require.NoError(t, err)
	return reply
}

func TestProbe(t *testing.T) {
	addr := serve(t)
	target, err := net.Listen("tcp4", "127.0.0.1:0")
	require.NoError(t, err)
	defer target.Close()
	refused := closedPort(t)

	targetAddr := netip.MustParseAddrPort(target.Addr().String())
	for _, tc := range []struct{ name, request, reply string }{
		{"dial a listener", guest.DialRequest(targetAddr), "ok"},
		{"dial nobody", "dial " + refused, "fail dial tcp4 " + refused + ": connect: connection refused"},
		{"unknown", "ping", "fail unknown command"},
		{"empty", "", "fail unknown command"},
		{"bad address", "dial nowhere", "fail bad address: want <ipv4>:<port>"},
		{"IPv6", "dial [::1]:22", "fail bad address: want <ipv4>:<port>"},
		{"port 0", "dial 127.0.0.1:0", "fail bad address: want <ipv4>:<port>"},
		{"longest line", "dial " + strings.Repeat(" ", MaxLine-5-len(targetAddr.String())) + targetAddr.String(), "ok"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.reply, ask(t, addr, tc.request))
		})
	}
	// What the client refuses to send, written raw.
	for _, tc := range []struct{ name, raw, reply string }{
		{"CRLF", "dial " + targetAddr.String() + "\r\n", "ok"},
		{"too long", strings.Repeat("x", MaxLine+1) + "\n", "fail line longer than 256 bytes"},
		{"no newline", "dial", "fail no request line"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hello, reply := askRaw(t, addr, tc.raw)
			assert.Equal(t, guest.ProbeHello, hello)
			assert.Equal(t, tc.reply, reply)
		})
	}
}

// askRaw sends raw bytes and closes the writing side, as a client that
// ends without a newline does.
func askRaw(t *testing.T, addr, request string) (hello, reply string) {
	t.Helper()
	c, err := net.DialTimeout("tcp4", addr, 5*time.Second)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	br := bufio.NewReader(c)
	hello, err = br.ReadString('\n')
	require.NoError(t, err)
	_, err = c.Write([]byte(request))
	require.NoError(t, err)
	require.NoError(t, c.(*net.TCPConn).CloseWrite())
	reply, err = br.ReadString('\n')
	require.NoError(t, err)
	return strings.TrimSuffix(hello, "\n"), strings.TrimSuffix(reply, "\n")
}

// TestProbeBoundsConnections holds MaxConns connections open and checks
// that one more is closed unanswered, and that a freed slot serves again.
func TestProbeBoundsConnections(t *testing.T) {
	addr := serve(t)
	var held []net.Conn
	for range MaxConns {
		c, err := net.DialTimeout("tcp4", addr, 5*time.Second)
		require.NoError(t, err)
		defer c.Close()
		require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
		hello, err := bufio.NewReader(c).ReadString('\n')
		require.NoError(t, err, "each of the first %d is greeted (it holds a slot from then on)", MaxConns)
		assert.Equal(t, guest.ProbeHello+"\n", hello)
		held = append(held, c)
	}
	extra, err := net.DialTimeout("tcp4", addr, 5*time.Second)
	require.NoError(t, err)
	defer extra.Close()
	require.NoError(t, extra.SetDeadline(time.Now().Add(10*time.Second)))
	_, err = bufio.NewReader(extra).ReadString('\n')
	assert.Error(t, err, "one over the bound is closed without a greeting")

	// Ending one held connection frees its slot once the server has
	// answered it; then a new client is served.
	_, err = held[0].Write([]byte("ping\n"))
	require.NoError(t, err)
	reply, err := bufio.NewReader(held[0]).ReadString('\n')
	require.NoError(t, err)
	assert.Equal(t, "fail unknown command\n", reply)
	require.Eventually(t, func() bool {
		c, err := net.DialTimeout("tcp4", addr, time.Second)
		if err != nil {
			return false
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		hello, err := bufio.NewReader(c).ReadString('\n')
		return err == nil && hello == guest.ProbeHello+"\n"
	}, 10*time.Second, 20*time.Millisecond)
}

func TestAnswerHonoursContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	// With the context already over the dial fails at once, even to a
	// listener.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	reply := Answer(ctx, "dial "+ln.Addr().String())
	assert.True(t, strings.HasPrefix(reply, "fail "), reply)
}
