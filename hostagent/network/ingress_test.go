package network_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/store"
)

// The ingress guard (issue 32): every frame a guest writes into its TAP is
// judged at the TAP's ingress, before the bridge, link-local ones
// included. Each test writes raw frames into TAPs as a guest's QEMU would,
// in a namespace of the test's own.

// lldpSeen is a packet socket for LLDP frames on a guest's TAP, on the
// host's side: what the bridge hands up to the host's stack on that port.
// It is bound to the LLDP ethertype, not to every one: a socket for every
// ethertype is a tap, which the kernel feeds before the TAP's ingress hook
// (so it would see what the chain then drops); one for an ethertype is fed
// only after the ingress hook and the bridge's handler have passed the
// frame on.
type lldpSeen struct{ fd int }

func (e *env) lldpSeen(t *testing.T, tap string) *lldpSeen {
	t.Helper()
	l := e.link(t, tap)
	require.NotNil(t, l)
	s := &lldpSeen{fd: -1}
	require.NoError(t, nettest.In(t, e.ns, func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_LLDP)))
		if err != nil {
			return err
		}
		s.fd = fd
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_LLDP), Ifindex: l.Attrs().Index}); err != nil {
			return err
		}
		tv := unix.NsecToTimeval((200 * time.Millisecond).Nanoseconds())
		return unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	}))
	t.Cleanup(func() { unix.Close(s.fd) })
	return s
}

// until reads LLDP frames until the one tagged marker, and returns the
// tags of those before it. The marker must come: it is the port's own.
func (s *lldpSeen) until(t *testing.T, marker string) []string {
	t.Helper()
	buf := make([]byte, 65536)
	var before []string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		n, _, err := unix.Recvfrom(s.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		require.NoError(t, err)
		_, rest, found := bytes.Cut(buf[:n], []byte("vmflow-guard:"))
		if !found {
			continue
		}
		tag, _, _ := bytes.Cut(rest, []byte(";"))
		if string(tag) == marker {
			return before
		}
		before = append(before, string(tag))
	}
	t.Fatalf("LLDP marker %s never came up the port", marker)
	return nil
}

// TestForgedLLDPStopsAtTheTAP: an LLDP frame (to 01:80:c2:00:00:0e, which
// passes no bridge hook) with a forged source, a neighbour's MAC or any
// other, is dropped at the attacker's TAP and counted: the bridge never
// sees it (it neither hands it up on the port nor learns its source, even
// where a hand turned the port's learning on), while the guest's own LLDP
// frame still passes.
func TestForgedLLDPStopsAtTheTAP(t *testing.T) {
	e, victim, attacker, _ := twoGuests(t)
	seen := e.lldpSeen(t, attacker.name)
	// A hand lets the attacker's port learn: whatever reaches the bridge
	// from it would be learnt.
	require.NoError(t, e.h.LinkSetLearning(e.link(t, attacker.name), true))
	forged := randomMAC(t)
	before, err := e.net.FilterDropped()
	require.NoError(t, err)
	ingressBefore, _ := network.IngressDropped(t, e.net)

	attacker.send(t, lldp(victim.mac, "as-victim"))
	attacker.send(t, lldp(forged, "as-anyone"))
	attacker.send(t, lldp(attacker.mac, "own"))

	assert.Empty(t, seen.until(t, "own"), "no forged LLDP frame came up the port; the guest's own did")
	ingressAfter, _ := network.IngressDropped(t, e.net)
	assert.Equal(t, uint64(2), ingressAfter-ingressBefore, "both forged frames counted at the TAP")
	after, err := e.net.FilterDropped()
	require.NoError(t, err)
	assert.Equal(t, uint64(2), after.Spoofed-before.Spoofed, "and in the filter's drop count")
	assert.Empty(t, e.fdbPorts(t, forged), "the bridge learnt no forged source")
	assert.Equal(t, []string{victim.name}, e.fdbPorts(t, victim.mac), "the victim's entry stays on its port")
}

// TestLLDPFloodIsCutAtTheTAP: link-local frames pass no bridge hook, so
// the bridge's per-port meter never counted them: a guest could send
// LLDP as fast as its QEMU could write. The TAP's ingress chain bounds
// them to the port's rate (here 1 frame a second, 5 at once) and counts
// the rest.
func TestLLDPFloodIsCutAtTheTAP(t *testing.T) {
	e := newEnvConfig(t, subnet, func(c *network.Config) { c.PortPPS = 1 })
	a := e.attachOpen(t, "vm-a", 1_900_000_001)
	before, err := e.net.FilterDropped()
	require.NoError(t, err)
	const flood = 1000
	for i := range flood {
		a.send(t, lldp(a.mac, fmt.Sprintf("flood-%d", i)))
	}
	after, err := e.net.FilterDropped()
	require.NoError(t, err)
	// At most the burst and a frame per second pass: 100 would take the
	// writes 95 s.
	assert.GreaterOrEqual(t, after.OverRate-before.OverRate, uint64(flood-100), "the LLDP flood is cut and counted")
	assert.Equal(t, before.Spoofed, after.Spoofed, "its own MAC: none is judged spoofed")
}

// TestIngressChainMadeAgainByTheScanRound: a chain a hand deleted, or
// opened in place keeping its comments, is made again whole by the next
// scan round, which leaves whole ones alone; the drop counts go on across
// it.
func TestIngressChainMadeAgainByTheScanRound(t *testing.T) {
	e, a, b, _ := twoGuests(t)
	ctx := context.Background()
	require.Equal(t, []string{network.IngressChain(a.name, a.mac), network.IngressChain(b.name, b.mac)}, network.IngressChains(t, e.net))
	handles := network.IngressRuleHandles(t, e.net, a.name)
	_, err := e.net.ReconcileTAPs(ctx)
	require.NoError(t, err)
	require.Equal(t, handles, network.IngressRuleHandles(t, e.net, a.name), "a whole chain is left as it is")

	seen := e.lldpSeen(t, a.name)
	a.send(t, lldp(randomMAC(t), "forged-1"))
	require.Empty(t, seen.until(t, sendOwn(t, a, "own-1")))
	spoofed, _ := network.IngressDropped(t, e.net)
	require.Equal(t, uint64(1), spoofed)

	network.DropIngressChain(t, e.net, a.name)
	network.OpenIngressChain(t, e.net, b.name)
	require.False(t, network.IngressWhole(t, e.net, a.name, a.mac))
	require.False(t, network.IngressWhole(t, e.net, b.name, b.mac))
	// Control: without its chain, A's forged LLDP comes up the port.
	a.send(t, lldp(randomMAC(t), "forged-unguarded"))
	require.Equal(t, []string{"forged-unguarded"}, seen.until(t, sendOwn(t, a, "own-2")))

	_, err = e.net.ReconcileTAPs(ctx)
	require.NoError(t, err)
	assert.True(t, network.IngressWhole(t, e.net, a.name, a.mac), "A's chain made again")
	assert.True(t, network.IngressWhole(t, e.net, b.name, b.mac), "B's chain made again")
	a.send(t, lldp(randomMAC(t), "forged-2"))
	assert.Empty(t, seen.until(t, sendOwn(t, a, "own-3")))
	spoofed, _ = network.IngressDropped(t, e.net)
	assert.Equal(t, uint64(2), spoofed, "the count went on across the chain made again")
}

// sendOwn sends g's own LLDP frame tagged tag, and returns tag.
func sendOwn(t *testing.T, g guestPort, tag string) string {
	t.Helper()
	g.send(t, lldp(g.mac, tag))
	return tag
}

// TestReleasedLeaseLeavesNoIngressChain: a released lease's chain goes
// with it (a kernel since 6.16 keeps a chain whose device is gone, and
// would hook it to the next TAP of that name), and only its: the next
// lease of the address, whose TAP has the same name, keeps the chain it
// made. A chain no held lease names (a crash's) goes at the next rebuild.
func TestReleasedLeaseLeavesNoIngressChain(t *testing.T) {
	e := newEnv(t, subnet)
	a := e.attachOpen(t, "vm-a", 1_900_000_001)
	b := e.attachOpen(t, "vm-b", 1_900_000_002)
	require.Equal(t, []string{network.IngressChain(a.name, a.mac), network.IngressChain(b.name, b.mac)}, network.IngressChains(t, e.net))
	a.tap.Close()
	e.beginDelete(t, "vm-a")
	_, _, err := e.net.Release(context.Background(), "vm-a")
	require.NoError(t, err)
	assert.Equal(t, []string{network.IngressChain(b.name, b.mac)}, network.IngressChains(t, e.net), "A's chain went with its lease")

	// The next lease of A's address, then A's removal again, late.
	c := e.attachOpen(t, "vm-c", 1_900_000_003)
	require.Equal(t, a.name, c.name, "the freed address, so the same TAP name")
	rec, err := e.st.Get("vm-a")
	require.NoError(t, err)
	require.NoError(t, network.UnguardPort(e.net, "vm-a", store.Network(rec).GetNetwork()))
	assert.ElementsMatch(t, []string{network.IngressChain(b.name, b.mac), network.IngressChain(c.name, c.mac)}, network.IngressChains(t, e.net),
		"C's chain stays")

	// A crash left a chain of an address no one holds.
	stale := network.TAPName(netip.MustParseAddr("10.88.0.99"))
	network.MakeIngressChain(t, e.net, stale, randomMAC(t))
	require.NoError(t, e.net.RebuildGuard(context.Background()))
	assert.ElementsMatch(t, []string{network.IngressChain(b.name, b.mac), network.IngressChain(c.name, c.mac)}, network.IngressChains(t, e.net))
}

// TestIngressChainsAcrossAgentRestart: an agent started again keeps the
// chains and their counts as they are; one started with another
// --net-port-pps makes each chain again with it.
func TestIngressChainsAcrossAgentRestart(t *testing.T) {
	e := newEnv(t, subnet)
	a := e.attachOpen(t, "vm-a", 1_900_000_001)
	a.send(t, lldp(randomMAC(t), "forged"))
	spoofed, _ := network.IngressDropped(t, e.net)
	require.Equal(t, uint64(1), spoofed)
	handles := network.IngressRuleHandles(t, e.net, a.name)

	restart := func(pps uint32) *network.Net {
		t.Helper()
		again, err := network.New(network.Config{Subnet: subnet, NetNS: e.ns, Store: e.st, PortPPS: pps})
		require.NoError(t, err)
		t.Cleanup(again.Close)
		require.NoError(t, again.RebuildGuard(context.Background()))
		return again
	}
	again := restart(0)
	assert.Equal(t, handles, network.IngressRuleHandles(t, again, a.name), "the same chain")
	spoofed, _ = network.IngressDropped(t, again)
	assert.Equal(t, uint64(1), spoofed, "its count kept")

	again = restart(5000)
	assert.NotEqual(t, handles, network.IngressRuleHandles(t, again, a.name), "made again")
	assert.True(t, network.IngressWhole(t, again, a.name, a.mac), "with the new rate")
	spoofed, _ = network.IngressDropped(t, again)
	assert.Equal(t, uint64(1), spoofed, "its count kept")
}
