package nettest

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Veth joins namespaces a and b with a veth pair, aName in a and bName in
// b, both up; each end that is given an address (a valid prefix) gets it.
func Veth(tb testing.TB, a, aName string, aAddr netip.Prefix, b, bName string, bAddr netip.Prefix) {
	tb.Helper()
	bns, err := netns.GetFromName(b)
	require.NoError(tb, err)
	defer bns.Close()
	ha := Handle(tb, a)
	la := netlink.NewLinkAttrs()
	la.Name = aName
	require.NoError(tb, ha.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: bName, PeerNamespace: netlink.NsFd(int(bns))}))
	Up(tb, a, aName, aAddr)
	Up(tb, b, bName, bAddr)
	// The kernel gives a link its queue once it has seen the carrier
	// (its link watch, up to a second later, later still under load);
	// until then what it sends is dropped, the first ARP request too, and
	// a dial waits for the retry. Both ends up first.
	operUp(tb, a, aName)
	operUp(tb, b, bName)
}

// operUp waits, within a bound, until the link name in ns is
// operationally up.
func operUp(tb testing.TB, ns, name string) {
	tb.Helper()
	h := Handle(tb, ns)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		l, err := h.LinkByName(name)
		require.NoError(tb, err)
		if l.Attrs().OperState == netlink.OperUp {
			return
		}
	}
	tb.Fatalf("%s in %s never came up", name, ns)
}

// Local makes a link named name in ns, up, with addrs: addresses the
// namespace owns on no path the guests use (a management interface, a
// server). It is a bridge without ports: this kernel has no dummy driver,
// and a local address is local whatever its link's carrier.
func Local(tb testing.TB, ns, name string, addrs ...netip.Prefix) {
	tb.Helper()
	la := netlink.NewLinkAttrs()
	la.Name = name
	require.NoError(tb, Handle(tb, ns).LinkAdd(&netlink.Bridge{LinkAttrs: la}))
	Up(tb, ns, name, netip.Prefix{})
	for _, a := range addrs {
		Up(tb, ns, name, a)
	}
}

// Up brings the link name in ns up and, when addr is valid, adds it.
func Up(tb testing.TB, ns, name string, addr netip.Prefix) {
	tb.Helper()
	h := Handle(tb, ns)
	l, err := h.LinkByName(name)
	require.NoError(tb, err)
	if addr.IsValid() {
		require.NoError(tb, h.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: addr.Addr().AsSlice(), Mask: net.CIDRMask(addr.Bits(), addr.Addr().BitLen())}}))
	}
	require.NoError(tb, h.LinkSetUp(l))
}

// Route adds a route to dst via gw in ns.
func Route(tb testing.TB, ns string, dst netip.Prefix, gw netip.Addr) {
	tb.Helper()
	r := &netlink.Route{Dst: &net.IPNet{IP: dst.Addr().AsSlice(), Mask: net.CIDRMask(dst.Bits(), 32)}, Gw: gw.AsSlice()}
	require.NoError(tb, Handle(tb, ns).RouteAdd(r))
}

// Sysctl writes value to /proc/sys/<key> inside ns (key as a path:
// "net/ipv4/ip_forward").
func Sysctl(tb testing.TB, ns, key, value string) {
	tb.Helper()
	require.NoError(tb, In(tb, ns, func() error {
		// /proc/sys/net is the namespace of the thread that opens it.
		return os.WriteFile("/proc/sys/"+key, []byte(value+"\n"), 0)
	}))
}

// Dial connects to addr over TCP from inside ns within timeout and closes
// the connection: nil when something there accepted it.
func Dial(tb testing.TB, ns string, addr netip.AddrPort, timeout time.Duration) error {
	tb.Helper()
	return In(tb, ns, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		// The socket is made on this thread, in ns; connecting it may
		// go on on another thread.
		c, err := (&net.Dialer{}).DialContext(ctx, "tcp4", addr.String())
		if err != nil {
			return fmt.Errorf("dial %s from %s: %w", addr, ns, err)
		}
		return c.Close()
	})
}
