package network_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/store"
)

// guestPort is a guest's end of its TAP: what its QEMU would write.
type guestPort struct {
	id   string
	tap  *os.File
	name string
	mac  net.HardwareAddr
	addr netip.Addr
}

// attachOpen attaches id as a launch does and keeps the TAP's queue open,
// as its QEMU would (the TAP has carrier only while a queue is attached).
func (e *env) attachOpen(t *testing.T, id string, uid uint32) guestPort {
	t.Helper()
	e.record(t, id)
	l, err := e.st.Lock(context.Background(), id)
	require.NoError(t, err)
	defer l.Unlock()
	a, err := e.net.AttachLocked(context.Background(), l, uid)
	require.NoError(t, err)
	t.Cleanup(func() { a.TAP.Close() })
	mac, err := net.ParseMAC(a.MAC)
	require.NoError(t, err)
	return guestPort{id: id, tap: a.TAP, name: network.TAPName(a.Address.Addr()), mac: mac, addr: a.Address.Addr()}
}

func (g guestPort) element() string { return network.GuardElement(g.name, g.mac.String(), g.addr) }

// send writes frame into the TAP behind an empty virtio-net header (the
// TAP is opened with IFF_VNET_HDR, as QEMU's virtio-net wants).
func (g guestPort) send(t *testing.T, frame []byte) {
	t.Helper()
	_, err := g.tap.Write(append(make([]byte, 10), frame...))
	require.NoError(t, err)
}

// own is an IPv4 frame g may send, carrying tag.
func (g guestPort) own(tag string) []byte {
	return ether(g.mac, unix.ETH_P_IP, ipv4UDP(g.addr, netip.MustParseAddr("10.88.0.1"), tagged(tag)))
}

var broadcast = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

func tagged(tag string) []byte { return []byte("vmflow-guard:" + tag + ";") }

// ether is a broadcast frame (the bridge passes it up to its own device,
// whatever the bridge's MAC is) from src.
func ether(src net.HardwareAddr, typ uint16, body []byte) []byte {
	f := append(append([]byte{}, broadcast...), src...)
	f = binary.BigEndian.AppendUint16(f, typ)
	return append(f, body...)
}

func ipv4UDP(src, dst netip.Addr, payload []byte) []byte {
	h := make([]byte, 20)
	h[0], h[8], h[9] = 0x45, 64, unix.IPPROTO_UDP
	binary.BigEndian.PutUint16(h[2:], uint16(20+8+len(payload)))
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(h[i:]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(h[10:], ^uint16(sum))
	udp := binary.BigEndian.AppendUint16(nil, 40000)
	udp = binary.BigEndian.AppendUint16(udp, 40001)
	udp = binary.BigEndian.AppendUint16(udp, uint16(8+len(payload)))
	udp = append(udp, 0, 0) // no checksum
	return append(append(h, udp...), payload...)
}

// ipv6 is an IPv6 packet from fe80::1 to all nodes (ff02::1) with no
// next header, carrying payload: a valid one, so that the bridge's
// multicast snooping passes it.
func ipv6(payload []byte) []byte {
	h := make([]byte, 40)
	h[0], h[6], h[7] = 0x60, 59, 255
	binary.BigEndian.PutUint16(h[4:], uint16(len(payload)))
	src, dst := netip.MustParseAddr("fe80::1").As16(), netip.MustParseAddr("ff02::1").As16()
	copy(h[8:], src[:])
	copy(h[24:], dst[:])
	return append(h, payload...)
}

// arpRequest is an ARP request from sha/spa for the gateway, trailed by tag
// (padding after the ARP body, as short frames have).
func arpRequest(sha net.HardwareAddr, spa netip.Addr, tag string) []byte {
	b := []byte{0x00, 0x01, 0x08, 0x00, 0x06, 0x04, 0x00, 0x01}
	s, tpa := spa.As4(), netip.MustParseAddr("10.88.0.1").As4()
	b = append(append(b, sha...), s[:]...)
	b = append(append(b, make([]byte, 6)...), tpa[:]...)
	return append(b, tagged(tag)...)
}

// sniffer is a packet socket on the bridge: every frame the bridge passes
// up to its own device (the gateway's side).
type sniffer struct{ fd int }

func (e *env) sniff(t *testing.T) *sniffer {
	t.Helper()
	br := e.link(t, network.DefaultBridge)
	require.NotNil(t, br)
	proto := int(htons(unix.ETH_P_ALL))
	s := &sniffer{fd: -1}
	require.NoError(t, nettest.In(t, e.ns, func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
		if err != nil {
			return err
		}
		s.fd = fd
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: br.Attrs().Index}); err != nil {
			return err
		}
		// A bound on each read, so that a dropped frame is waited for
		// until the next one, never for ever.
		tv := unix.NsecToTimeval((200 * time.Millisecond).Nanoseconds())
		return unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	}))
	t.Cleanup(func() { unix.Close(s.fd) })
	return s
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// await reads frames until one tagged want arrives or within passes; it
// returns the tags of the frames before it and whether it came.
func (s *sniffer) await(t *testing.T, want string, within time.Duration) (before []string, ok bool) {
	t.Helper()
	buf := make([]byte, 65536)
	for deadline := time.Now().Add(within); time.Now().Before(deadline); {
		n, from, err := unix.Recvfrom(s.fd, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		require.NoError(t, err)
		if ll, isLL := from.(*unix.SockaddrLinklayer); isLL && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		_, rest, found := bytes.Cut(buf[:n], []byte("vmflow-guard:"))
		if !found {
			continue
		}
		tag, _, _ := bytes.Cut(rest, []byte(";"))
		if string(tag) == want {
			return before, true
		}
		before = append(before, string(tag))
	}
	return before, false
}

// forwarding waits until g's own frames reach the bridge: the port
// forwards once the kernel has seen the queue's carrier (asynchronously,
// by its link watch).
func (s *sniffer) forwarding(t *testing.T, g guestPort) {
	t.Helper()
	for i, deadline := 0, time.Now().Add(10*time.Second); time.Now().Before(deadline); i++ {
		tag := fmt.Sprintf("ready-%d", i)
		g.send(t, g.own(tag))
		if _, ok := s.await(t, tag, 300*time.Millisecond); ok {
			return
		}
	}
	t.Fatalf("%s's own frames never reached the bridge", g.name)
}

// passed sends frame from g, then g's own frame as a marker, and reports
// whether frame (tagged tag) reached the bridge before the marker. The
// marker must arrive: g's own frames pass.
func (s *sniffer) passed(t *testing.T, g guestPort, tag string, frame []byte) bool {
	t.Helper()
	g.send(t, frame)
	marker := "marker-" + tag
	g.send(t, g.own(marker))
	before, ok := s.await(t, marker, 10*time.Second)
	require.True(t, ok, "%s's own frame must reach the bridge", g.name)
	for _, b := range before {
		if b == tag {
			return true
		}
	}
	return false
}

// twoGuests are two guests' ports, both forwarding, and a sniffer on their
// bridge.
func twoGuests(t *testing.T) (*env, guestPort, guestPort, *sniffer) {
	t.Helper()
	e := newEnv(t, subnet)
	a := e.attachOpen(t, "vm-a", 1_900_000_001)
	b := e.attachOpen(t, "vm-b", 1_900_000_002)
	s := e.sniff(t)
	s.forwarding(t, a)
	s.forwarding(t, b)
	return e, a, b, s
}

var spoofed = net.HardwareAddr{0x02, 0xde, 0xad, 0xbe, 0xef, 0x01}

func TestGuardPassesOnlyTheLeasesFrames(t *testing.T) {
	_, a, b, s := twoGuests(t)
	other := netip.MustParseAddr("10.88.0.77")
	vlan := binary.BigEndian.AppendUint16([]byte{0x00, 0x05}, unix.ETH_P_IP)
	for _, c := range []struct {
		name  string
		frame func(tag string) []byte
		pass  bool
	}{
		{"own IPv4", a.own, true},
		{"own ARP", func(tag string) []byte { return ether(a.mac, unix.ETH_P_ARP, arpRequest(a.mac, a.addr, tag)) }, true},
		{"spoofed source address", func(tag string) []byte {
			return ether(a.mac, unix.ETH_P_IP, ipv4UDP(other, netip.MustParseAddr("10.88.0.1"), tagged(tag)))
		}, false},
		{"unspecified source address", func(tag string) []byte {
			return ether(a.mac, unix.ETH_P_IP, ipv4UDP(netip.IPv4Unspecified(), netip.MustParseAddr("10.88.0.1"), tagged(tag)))
		}, false},
		{"spoofed source MAC", func(tag string) []byte {
			return ether(spoofed, unix.ETH_P_IP, ipv4UDP(a.addr, netip.MustParseAddr("10.88.0.1"), tagged(tag)))
		}, false},
		{"another guest's MAC and address", func(tag string) []byte { return b.own(tag) }, false},
		{"ARP spoofed sender address", func(tag string) []byte { return ether(a.mac, unix.ETH_P_ARP, arpRequest(a.mac, other, tag)) }, false},
		{"ARP spoofed sender MAC", func(tag string) []byte { return ether(a.mac, unix.ETH_P_ARP, arpRequest(spoofed, a.addr, tag)) }, false},
		{"ARP from a spoofed MAC", func(tag string) []byte { return ether(spoofed, unix.ETH_P_ARP, arpRequest(spoofed, a.addr, tag)) }, false},
		{"ARP as another guest", func(tag string) []byte { return ether(b.mac, unix.ETH_P_ARP, arpRequest(b.mac, b.addr, tag)) }, false},
		{"IPv6", func(tag string) []byte { return ether(a.mac, unix.ETH_P_IPV6, ipv6(tagged(tag))) }, false},
		{"VLAN-tagged IPv4", func(tag string) []byte {
			return ether(a.mac, unix.ETH_P_8021Q, append(vlan, ipv4UDP(a.addr, netip.MustParseAddr("10.88.0.1"), tagged(tag))...))
		}, false},
		{"other ethertype", func(tag string) []byte { return ether(a.mac, 0x88b5, tagged(tag)) }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			tag := fmt.Sprintf("case-%x", c.name)
			assert.Equal(t, c.pass, s.passed(t, a, tag, c.frame(tag)), "does the frame reach the bridge?")
		})
	}
}

func TestGuardDropsAGuestPortWithoutElement(t *testing.T) {
	e, a, b, s := twoGuests(t)
	// A's element gone (a port whose element is not there yet): even its
	// own frames stop; B's still pass.
	network.EditGuard(t, e.net, [3]string{b.name, b.mac.String(), b.addr.String()})
	a.send(t, a.own("a-without-element"))
	b.send(t, b.own("b-marker"))
	before, ok := s.await(t, "b-marker", 10*time.Second)
	require.True(t, ok, "B's frame passes")
	assert.NotContains(t, before, "a-without-element", "a guest port without element forwards nothing")
}

func TestGuardElementBeforeTheTAP(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	tap := network.TAPName(netip.MustParseAddr("10.88.0.2"))
	// A TUN under the TAP's name: the attach stops where it would make
	// the TAP.
	nettest.MakeTAP(t, e.ns, tap, true)
	_, err := e.attach(t, "vm-a", 1_900_000_001)
	require.ErrorIs(t, err, network.ErrNotOurs)
	assert.Equal(t, []string{network.GuardElement(tap, network.MAC(e.macKey(t), "vm-a", 0), netip.MustParseAddr("10.88.0.2"))},
		network.GuardElements(t, e.net), "the element is there before the TAP")
}

func TestGuardElementGoneAfterRelease(t *testing.T) {
	e := newEnv(t, subnet)
	a := e.attachOpen(t, "vm-a", 1_900_000_001)
	b := e.attachOpen(t, "vm-b", 1_900_000_002)
	require.ElementsMatch(t, []string{a.element(), b.element()}, network.GuardElements(t, e.net))
	a.tap.Close()
	e.beginDelete(t, "vm-a")
	released, _, err := e.net.Release(context.Background(), "vm-a")
	require.NoError(t, err)
	require.True(t, released)
	assert.Equal(t, []string{b.element()}, network.GuardElements(t, e.net), "A's element went with its TAP")
}

func TestGuardRebuildRestoresExactlyTheHeldLeases(t *testing.T) {
	e := newEnv(t, subnet)
	a := e.attachOpen(t, "vm-a", 1_900_000_001)
	b := e.attachOpen(t, "vm-b", 1_900_000_002)
	c := e.attachOpen(t, "vm-c", 1_900_000_003)
	b.tap.Close()
	e.beginDelete(t, "vm-b")
	_, _, err := e.net.Release(context.Background(), "vm-b")
	require.NoError(t, err)
	ctx := context.Background()

	// What a crash or a hand leaves: the set flushed, then a stale element
	// of the released lease and one of A's TAP under another MAC.
	network.EditGuard(t, e.net, [3]string{b.name, b.mac.String(), b.addr.String()}, [3]string{a.name, spoofed.String(), a.addr.String()})
	require.NoError(t, e.net.RebuildGuard(ctx))
	assert.ElementsMatch(t, []string{a.element(), c.element()}, network.GuardElements(t, e.net), "exactly the held leases")

	// A reboot: no table at all. The reconcile rebuilds it.
	network.DropGuard(t, e.net)
	_, err = e.net.ReconcileTAPs(ctx)
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{a.element(), c.element()}, network.GuardElements(t, e.net))

	// No table when a launch comes: it makes the whole table again.
	network.DropGuard(t, e.net)
	d := e.attachOpen(t, "vm-d", 1_900_000_004)
	assert.ElementsMatch(t, []string{a.element(), c.element(), d.element()}, network.GuardElements(t, e.net))
}

func TestGuardRebuildKeepsTheElementOfAnUnreadableRecord(t *testing.T) {
	e := newEnv(t, subnet)
	a := e.attachOpen(t, "vm-a", 1_900_000_001)
	b := e.attachOpen(t, "vm-b", 1_900_000_002)
	p, err := e.st.Paths("vm-b")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte("{torn"), 0o600))
	network.EditGuard(t, e.net, [3]string{b.name, b.mac.String(), b.addr.String()})
	require.NoError(t, e.net.RebuildGuard(context.Background()))
	assert.ElementsMatch(t, []string{a.element(), b.element()}, network.GuardElements(t, e.net),
		"A's is restored from its record; B's, which no record can tell about, kept")
}

// released is a guest attached and then released, as a delete does.
func (e *env) released(t *testing.T, id string, uid uint32) guestPort {
	t.Helper()
	g := e.attachOpen(t, id, uid)
	g.tap.Close()
	e.beginDelete(t, id)
	_, _, err := e.net.Release(context.Background(), id)
	require.NoError(t, err)
	return g
}

func TestGuardStaleElementOfAReleasedLeaseLetsNoOneSpoof(t *testing.T) {
	e := newEnv(t, subnet)
	a := e.released(t, "vm-a", 1_900_000_001)
	// A crash between the recorded release and the element's removal.
	network.EditGuard(t, e.net, [3]string{a.name, a.mac.String(), a.addr.String()})
	// The next lease of the address has the same TAP: its element
	// replaces the stale one before the TAP is made.
	c := e.attachOpen(t, "vm-c", 1_900_000_003)
	require.Equal(t, a.name, c.name, "the freed address, so the same TAP name")
	assert.Equal(t, []string{c.element()}, network.GuardElements(t, e.net))
	s := e.sniff(t)
	s.forwarding(t, c)
	asA := ether(a.mac, unix.ETH_P_IP, ipv4UDP(c.addr, netip.MustParseAddr("10.88.0.1"), tagged("as-a")))
	assert.False(t, s.passed(t, c, "as-a", asA), "the released lease's MAC is no one's to use")
}

func TestGuardRebuildKeepsTheChainAndItsCounter(t *testing.T) {
	e, a, b, s := twoGuests(t)
	ctx := context.Background()
	spoof := func(tag string) {
		t.Helper()
		f := ether(spoofed, unix.ETH_P_IP, ipv4UDP(a.addr, netip.MustParseAddr("10.88.0.1"), tagged(tag)))
		require.False(t, s.passed(t, a, tag, f))
	}
	spoof("spoof-1")
	rules, drops := network.GuardChain(t, e.net)
	require.Equal(t, uint64(1), drops, "the drop rule counts what a guest sent that is not its own")

	require.NoError(t, e.net.RebuildGuard(ctx))
	_, after := network.GuardChain(t, e.net)
	assert.Equal(t, drops, after, "a rebuild that changes nothing keeps the chain")
	b.tap.Close()
	e.beginDelete(t, "vm-b")
	_, _, err := e.net.Release(context.Background(), "vm-b")
	require.NoError(t, err)
	network.EditGuard(t, e.net, [3]string{a.name, a.mac.String(), a.addr.String()}, [3]string{b.name, b.mac.String(), b.addr.String()})
	require.NoError(t, e.net.RebuildGuard(ctx))
	assert.Equal(t, []string{a.element()}, network.GuardElements(t, e.net))
	_, after = network.GuardChain(t, e.net)
	assert.Equal(t, drops, after, "a rebuild that changes the set keeps the chain")

	// A chain a hand cut short is made again whole.
	network.CutGuardChain(t, e.net)
	require.NoError(t, e.net.RebuildGuard(ctx))
	again, _ := network.GuardChain(t, e.net)
	assert.Equal(t, rules, again)
	spoof("spoof-2")
}

// TestGuardLateRemovalSparesTheNextLease: once A's release is recorded its
// address is free, and the next lease of it (the same TAP, another MAC) may
// add its element before A's removal runs; that removal takes only A's.
func TestGuardLateRemovalSparesTheNextLease(t *testing.T) {
	e := newEnv(t, subnet)
	a := e.released(t, "vm-a", 1_900_000_001)
	c := e.attachOpen(t, "vm-c", 1_900_000_003)
	require.Equal(t, a.name, c.name, "the freed address, so the same TAP name")
	rec, err := e.st.Get("vm-a")
	require.NoError(t, err)
	require.NoError(t, network.UnguardPort(e.net, "vm-a", store.Network(rec).GetNetwork()))
	assert.Equal(t, []string{c.element()}, network.GuardElements(t, e.net), "C's element stays")
}
