package guest_test

import (
	"bufio"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/guest"
)

// fakeProbe answers one connection of a net.Pipe with greeting, then
// reply, and reports the request line it read.
func fakeProbe(t *testing.T, greeting, reply string) (net.Conn, <-chan string) {
	t.Helper()
	client, server := net.Pipe()
	t.Cleanup(func() { client.Close(); server.Close() })
	got := make(chan string, 1)
	go func() {
		defer server.Close()
		_ = server.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := server.Write([]byte(greeting + "\n")); err != nil {
			got <- "write failed: " + err.Error()
			return
		}
		line, err := bufio.NewReader(server).ReadString('\n')
		if err != nil {
			got <- "read failed: " + err.Error()
			return
		}
		got <- line
		_, _ = server.Write([]byte(reply + "\n"))
	}()
	return client, got
}

func TestProbeClient(t *testing.T) {
	target := netip.MustParseAddrPort("10.88.0.1:8080")
	assert.Equal(t, "dial 10.88.0.1:8080", guest.DialRequest(target))

	c, got := fakeProbe(t, guest.ProbeHello, "ok")
	reply, err := guest.Probe(c, guest.DialRequest(target), time.Now().Add(5*time.Second))
	require.NoError(t, err)
	assert.Equal(t, guest.ProbeOK, reply)
	assert.Equal(t, "dial 10.88.0.1:8080\n", <-got)

	c, _ = fakeProbe(t, guest.ProbeHello, "fail dial tcp4 10.88.0.1:8080: connect: connection refused")
	reply, err = guest.Probe(c, guest.DialRequest(target), time.Now().Add(5*time.Second))
	require.NoError(t, err, "a fail reply is an answer, not an error")
	assert.True(t, strings.HasPrefix(reply, guest.ProbeFail))

	c, _ = fakeProbe(t, "SSH-2.0-OpenSSH", "ok")
	_, err = guest.Probe(c, "x", time.Now().Add(5*time.Second))
	assert.ErrorContains(t, err, "greeting", "another server on the port")

	c, _ = fakeProbe(t, guest.ProbeHello, "maybe")
	_, err = guest.Probe(c, "x", time.Now().Add(5*time.Second))
	assert.ErrorContains(t, err, "neither ok nor fail")

	for _, bad := range []string{"dial a\nb", "x\r", strings.Repeat("x", guest.ProbeMaxLine+1)} {
		c, _ = fakeProbe(t, guest.ProbeHello, "ok")
		_, err = guest.Probe(c, bad, time.Now().Add(5*time.Second))
		assert.Error(t, err, "%q is not one request line", bad)
	}

	// A server that never greets: the deadline ends the wait.
	client, server := net.Pipe()
	defer server.Close()
	defer client.Close()
	_, err = guest.Probe(client, "x", time.Now().Add(50*time.Millisecond))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
}
