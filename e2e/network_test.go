package e2e

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"

	"vmflow/guest"
	"vmflow/hostagent/admission"
	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// netGateway is netSubnet's gateway, the bridge's address.
var netGateway = netip.MustParseAddr("10.77.0.1")

// guestNetSpawn is the real guest (TCG, q35) with a network.
func (e *env) guestNetSpawn(id string) *vmflowv1.SpawnRequest {
	r := e.guestSpawn(id, false)
	r.Network = admission.NetworkDefault
	return r
}

// netProbe connects from inside the agent's namespace to the guest's probe
// port at addr and returns its reply to request. One connection, bounded.
func (e *env) netProbe(t *testing.T, addr netip.Addr, request string) string {
	t.Helper()
	var c net.Conn
	require.NoError(t, nettest.In(t, e.netns, func() (err error) {
		// The socket is made in the namespace and stays there.
		c, err = net.DialTimeout("tcp4", net.JoinHostPort(addr.String(), strconv.Itoa(guest.ProbePort)), 10*time.Second)
		return err
	}), "TCP to %s:%d from inside %s", addr, guest.ProbePort, e.netns)
	defer c.Close()
	// The guest's own dial is bounded by ~3 s; TCG adds its slowness.
	reply, err := guest.Probe(c, request, time.Now().Add(30*time.Second))
	require.NoError(t, err)
	return reply
}

// netPing sends one ICMP echo to addr from inside the agent's namespace
// and waits (bounded) for its reply.
func (e *env) netPing(t *testing.T, addr netip.Addr) {
	t.Helper()
	var pc *icmp.PacketConn
	require.NoError(t, nettest.In(t, e.netns, func() (err error) {
		pc, err = icmp.ListenPacket("ip4:icmp", "0.0.0.0")
		return err
	}))
	defer pc.Close()
	id := os.Getpid() & 0xffff
	msg := icmp.Message{Type: ipv4.ICMPTypeEcho, Body: &icmp.Echo{ID: id, Seq: 1, Data: []byte("vmflow-e2e")}}
	b, err := msg.Marshal(nil)
	require.NoError(t, err)
	_, err = pc.WriteTo(b, &net.IPAddr{IP: addr.AsSlice()})
	require.NoError(t, err)
	require.NoError(t, pc.SetReadDeadline(time.Now().Add(20*time.Second)))
	buf := make([]byte, 1500)
	for {
		n, from, err := pc.ReadFrom(buf)
		require.NoError(t, err, "echo reply from %s", addr)
		m, err := icmp.ParseMessage(1, buf[:n])
		if err != nil || m.Type != ipv4.ICMPTypeEchoReply || from.String() != addr.String() {
			continue // another ICMP message of the namespace
		}
		if echo, ok := m.Body.(*icmp.Echo); ok && echo.ID == id {
			return
		}
	}
}

// TestGuestNetworking: two real guests on one host's network, inside the
// namespace the harness made for the agent. Each answers a ping and a TCP
// connection to its probe port on its leased address; neither reaches the
// other (isolated bridge ports) nor a listener on the gateway (the
// host-path filter), while the host's own connections to them work; a delete removes the TAP and frees the address, which the next spawn
// gets.
func TestGuestNetworking(t *testing.T) {
	timeTest(t)
	e := newEnv(t, envOptions{network: true})
	a, b := "e2e-net-a-"+suffix(t), "e2e-net-b-"+suffix(t)
	resA := e.spawn(e.guestNetSpawn(a))
	resB := e.spawn(e.guestNetSpawn(b))
	t.Logf("guest A %s %s, guest B %s %s", resA.GetIp(), resA.GetMac(), resB.GetIp(), resB.GetMac())
	require.NotEmpty(t, resA.GetIp(), "the spawn reports the address")
	require.NotEmpty(t, resA.GetMac())
	assert.NotEqual(t, resA.GetIp(), resB.GetIp())
	addrA := netip.MustParsePrefix(resA.GetIp()).Addr()
	addrB := netip.MustParsePrefix(resB.GetIp()).Addr()
	for id, addr := range map[string]netip.Addr{a: addrA, b: addrB} {
		e.openConsole(id).wait(t, guest.NetUpPrefix+netip.PrefixFrom(addr, 24).String(), 3*time.Minute)
	}

	for _, addr := range []netip.Addr{addrA, addrB} {
		e.netPing(t, addr)
		// The greeting alone proves the TCP connection, the host's own.
	}
	// No path to the host: a guest's own dial of a listener on the
	// gateway fails (issue 32, finding 4).
	gw, peers := nettest.Listen(t, e.netns, netGateway)
	for _, addr := range []netip.Addr{addrA, addrB} {
		reply := e.netProbe(t, addr, guest.DialRequest(gw))
		assert.True(t, strings.HasPrefix(reply, guest.ProbeFail), "guest %s must not reach the host's listener: %q", addr, reply)
	}
	select {
	case peer := <-peers:
		t.Errorf("the gateway listener saw a connection from %s", peer)
	default:
	}
	// Isolation: A cannot open B's probe port, nor B A's.
	replyAB := e.netProbe(t, addrA, guest.DialRequest(netip.AddrPortFrom(addrB, guest.ProbePort)))
	assert.True(t, strings.HasPrefix(replyAB, guest.ProbeFail), "A must not reach B: %q", replyAB)
	replyBA := e.netProbe(t, addrB, guest.DialRequest(netip.AddrPortFrom(addrA, guest.ProbePort)))
	assert.True(t, strings.HasPrefix(replyBA, guest.ProbeFail), "B must not reach A: %q", replyBA)

	// Delete A: its TAP goes and its address comes back.
	tapA := network.TAPName(addrA)
	require.Contains(t, e.taps(), tapA)
	require.NoError(t, e.startDelete(a, 30).Get(e.ctx(3*time.Minute), nil))
	assert.NotContains(t, e.taps(), tapA, "the delete removed the TAP")
	assert.Nil(t, e.record(a))
	c := "e2e-net-c-" + suffix(t)
	resC := e.spawn(e.netSpawn(c, false))
	assert.Equal(t, resA.GetIp(), resC.GetIp(), "the freed address is the next spawn's")
	recC := e.record(c)
	require.NotNil(t, recC)
	assert.True(t, store.LeaseHeld(store.Network(recC)))
	require.NoError(t, e.startDelete(c, 1).Get(e.ctx(3*time.Minute), nil))
	require.NoError(t, e.startDelete(b, 30).Get(e.ctx(3*time.Minute), nil))
	assert.Empty(t, e.taps(), fmt.Sprintf("no TAP left in %s", e.netns))
}
