package network_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
)

// hostPath is a host as a guest sees it: the agent's namespace (host) with
// the bridge, a management address (mgmt, where an operator serves the
// agent's metrics for a remote scrape) and an uplink to a second namespace
// (world) holding an allowed server, a cloud metadata address and a
// management range the operator denies; two guests, each in a namespace
// of its own behind a veth port of the bridge named and isolated as the
// agent's TAPs are.
type hostPath struct {
	host, world string
	guests      [2]string
	st          *store.Store
}

var (
	mgmt     = netip.MustParseAddr("10.0.0.5")
	allowed  = netip.MustParseAddr("198.51.100.7")
	metadata = netip.MustParseAddr("169.254.169.254")
	denied   = netip.MustParseAddr("203.0.113.7")
	denyNet  = netip.MustParsePrefix("203.0.113.0/24")
	gateway  = netip.MustParseAddr("10.88.0.1")
	upHost   = netip.MustParsePrefix("192.0.2.2/24")
	upWorld  = netip.MustParsePrefix("192.0.2.1/24")
)

// dialWait bounds a dial a filter drops: a SYN no one answers.
const dialWait = 700 * time.Millisecond

func newHostPath(t *testing.T) *hostPath {
	t.Helper()
	p := &hostPath{host: nettest.Namespace(t), world: nettest.Namespace(t)}
	var err error
	p.st, err = store.New(t.TempDir())
	require.NoError(t, err)
	n := p.net(t, "")
	require.NoError(t, n.EnsureBridge(context.Background()))
	h := nettest.Handle(t, p.host)
	br, err := h.LinkByName(network.DefaultBridge)
	require.NoError(t, err)
	for i := range p.guests {
		p.guests[i] = nettest.Namespace(t)
		addr := netip.AddrFrom4([4]byte{10, 88, 0, byte(2 + i)})
		port := network.TAPName(addr)
		nettest.Veth(t, p.host, port, netip.Prefix{}, p.guests[i], "eth0", netip.PrefixFrom(addr, 24))
		l, err := h.LinkByName(port)
		require.NoError(t, err)
		require.NoError(t, h.LinkSetMasterByIndex(l, br.Attrs().Index))
		require.NoError(t, h.LinkSetIsolated(l, true))
		nettest.Route(t, p.guests[i], netip.MustParsePrefix("0.0.0.0/0"), gateway)
	}
	for _, ns := range append([]string{p.host, p.world}, p.guests[:]...) {
		nettest.Up(t, ns, "lo", netip.Prefix{})
	}
	nettest.Local(t, p.host, "mgmt0", netip.PrefixFrom(mgmt, 24))
	nettest.Veth(t, p.host, "uplink0", upHost, p.world, "wan0", upWorld)
	nettest.Route(t, p.host, netip.MustParsePrefix("0.0.0.0/0"), upWorld.Addr())
	nettest.Local(t, p.world, "srv0", netip.PrefixFrom(allowed, 32), netip.PrefixFrom(metadata, 32), netip.PrefixFrom(denied, 32))
	// Without NAT the world answers the guests' own addresses through
	// the host (a host that routes for another reason).
	nettest.Route(t, p.world, subnet, upHost.Addr())
	return p
}

// net is the agent's network on p's host with egress and deny.
func (p *hostPath) net(t *testing.T, egress string, deny ...netip.Prefix) *network.Net {
	t.Helper()
	n, err := network.New(network.Config{Subnet: subnet, NetNS: p.host, Store: p.st, Egress: egress, Deny: deny})
	require.NoError(t, err)
	t.Cleanup(n.Close)
	return n
}

// reach says whether a TCP connection from guest i to ap is accepted.
func (p *hostPath) reach(t *testing.T, i int, ap netip.AddrPort) bool {
	t.Helper()
	return nettest.Dial(t, p.guests[i], ap, dialWait) == nil
}

func readSysctl(t *testing.T, ns, key string) string {
	t.Helper()
	var b []byte
	require.NoError(t, nettest.In(t, ns, func() (err error) {
		b, err = os.ReadFile("/proc/sys/" + key)
		return err
	}))
	return string(b)
}

// TestGuestCannotReachHostServices (issue 32, finding 4): a guest reached
// a listener on the bridge's address and on another address of the host
// (the agent's metrics on 10.0.0.5:9464 for a remote scrape); with the
// host-path filter it reaches neither, and the host's own connections to
// a guest still work (their replies are established).
func TestGuestCannotReachHostServices(t *testing.T) {
	p := newHostPath(t)
	onBridge, _ := nettest.Listen(t, p.host, gateway)
	onMgmt, _ := nettest.Listen(t, p.host, mgmt)
	require.True(t, p.reach(t, 0, onBridge), "control: without the filter the guest reaches the bridge's address")
	require.True(t, p.reach(t, 0, onMgmt), "control: ... and the management address")

	n := p.net(t, "")
	require.NoError(t, n.EnsureHostPath())
	assert.False(t, p.reach(t, 0, onBridge), "a listener on the bridge's address")
	assert.False(t, p.reach(t, 0, onMgmt), "a listener on another address of the host (metrics)")

	inGuest, _ := nettest.Listen(t, p.guests[0], netip.MustParseAddr("10.88.0.2"))
	assert.NoError(t, nettest.Dial(t, p.host, inGuest, 5*time.Second), "the host's own connection to a guest")
	require.NoError(t, n.EnsureHostPath(), "idempotent")
	assert.False(t, p.reach(t, 0, onMgmt))
}

// TestGuestCannotReachLoopbackWithRouteLocalnet (finding 4): with
// route_localnet on, the kernel routes a guest's SYN to 127.0.0.1 to the
// host's loopback services (a raw frame: the guest's own kernel would not
// send it); the agent refuses to start so, and should it be turned on
// afterwards, the input chain still drops it.
func TestGuestCannotReachLoopbackWithRouteLocalnet(t *testing.T) {
	p := newHostPath(t)
	lo, _ := nettest.Listen(t, p.host, netip.MustParseAddr("127.0.0.1"))
	br := nettest.Link(t, nettest.Handle(t, p.host), network.DefaultBridge)
	src := netip.AddrPortFrom(netip.MustParseAddr("10.88.0.2"), 40000)
	syn := func(i int) bool {
		return nettest.SYN(t, p.guests[0], "eth0", br.Attrs().HardwareAddr, netip.AddrPortFrom(src.Addr(), src.Port()+uint16(i)), lo, time.Second)
	}
	// The host knows the guest's MAC (from any ARP of the guest's; its own
	// ARP from 127.0.0.1 would go unanswered, a martian to the guest).
	hg := nettest.Handle(t, p.host)
	eth0 := nettest.Link(t, nettest.Handle(t, p.guests[0]), "eth0")
	require.NoError(t, hg.NeighAdd(&netlink.Neigh{LinkIndex: br.Attrs().Index, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
		IP: src.Addr().AsSlice(), HardwareAddr: eth0.Attrs().HardwareAddr}))
	assert.False(t, syn(0), "control: with route_localnet off the kernel drops a martian")
	n := p.net(t, "")
	require.NoError(t, n.EnsureHostPath())

	for _, key := range []string{"all", network.DefaultBridge, "default"} {
		t.Run(key, func(t *testing.T) {
			sysctl := "net/ipv4/conf/" + key + "/route_localnet"
			nettest.Sysctl(t, p.host, sysctl, "1")
			defer nettest.Sysctl(t, p.host, sysctl, "0")
			err := p.net(t, "").EnsureHostPath()
			require.ErrorIs(t, err, network.ErrRouteLocalnet)
			assert.Equal(t, errdefs.Misconfigured, errdefs.ClassOf(err))
			assert.Contains(t, err.Error(), "net.ipv4.conf."+key+".route_localnet")
		})
	}

	nettest.Sysctl(t, p.host, "net/ipv4/conf/all/route_localnet", "1")
	defer nettest.Sysctl(t, p.host, "net/ipv4/conf/all/route_localnet", "0")
	assert.False(t, syn(1), "127.0.0.1 with route_localnet on, the filter in place")
	// The control that the probe reaches loopback at all when nothing
	// drops it: the same SYN without the table.
	dropHostPath(t, p.host)
	assert.True(t, syn(2), "control: without the filter, route_localnet lets the guest in")
}

// TestEgressDeniesMetadataAndOperatorRanges (finding 4): with --net-egress
// a guest reached 169.254.169.254 and the operator's management networks;
// now it reaches an allowed address and neither of those.
func TestEgressDeniesMetadataAndOperatorRanges(t *testing.T) {
	p := newHostPath(t)
	ok, _ := nettest.Listen(t, p.world, allowed)
	md, _ := nettest.Listen(t, p.world, metadata)
	dn, _ := nettest.Listen(t, p.world, denied)
	up, _ := nettest.Listen(t, p.host, upHost.Addr())
	n := p.net(t, "uplink0", denyNet)
	require.NoError(t, n.EnsureHostPath())
	assert.Equal(t, "1\n", readSysctl(t, p.host, "net/ipv4/ip_forward"), "forwarding on")
	assert.True(t, p.reach(t, 0, ok), "an allowed address, masqueraded")
	assert.False(t, p.reach(t, 0, md), "cloud metadata")
	assert.False(t, p.reach(t, 1, dn), "a --net-deny range")
	assert.False(t, p.reach(t, 0, up), "the host's own uplink address")
}

// TestWithoutEgressNoForwarding (finding 4): without --net-egress there
// was no forward table: a host forwarding for another reason routed a
// guest to the world, and to another guest through the gateway (the
// bridge's isolated ports keep them apart only at layer 2).
func TestWithoutEgressNoForwarding(t *testing.T) {
	p := newHostPath(t)
	nettest.Sysctl(t, p.host, "net/ipv4/ip_forward", "1")
	world, _ := nettest.Listen(t, p.world, allowed)
	neighbour, _ := nettest.Listen(t, p.guests[1], netip.MustParseAddr("10.88.0.3"))
	// The guests send to each other through the gateway: the same
	// subnet, so their kernels need routes to do so, and must not take
	// the host's redirects (isolated ports drop what goes direct).
	for i, peer := range []string{"10.88.0.3/32", "10.88.0.2/32"} {
		nettest.Sysctl(t, p.guests[i], "net/ipv4/conf/all/accept_redirects", "0")
		nettest.Sysctl(t, p.guests[i], "net/ipv4/conf/eth0/accept_redirects", "0")
		nettest.Route(t, p.guests[i], netip.MustParsePrefix(peer), gateway)
	}
	require.True(t, p.reach(t, 0, world), "control: a forwarding host routes the guest out")
	require.True(t, p.reach(t, 0, neighbour), "control: ... and back into the bridge")

	require.NoError(t, p.net(t, "").EnsureHostPath())
	assert.False(t, p.reach(t, 0, world), "the world, without --net-egress")
	assert.False(t, p.reach(t, 0, neighbour), "another guest through the gateway")

	// With egress on, a guest still does not reach its neighbour.
	require.NoError(t, p.net(t, "uplink0").EnsureHostPath())
	assert.True(t, p.reach(t, 0, world), "egress on: the world")
	assert.False(t, p.reach(t, 0, neighbour), "egress on: not the neighbour")
}

// TestEnsureHostPathReplacesTheTable: each run replaces the table whole,
// with or without egress, and removes the ip-family egress table of earlier
// versions in the same transaction; RestoreHostPath rebuilds only a table
// that is not whole.
func TestEnsureHostPathReplacesTheTable(t *testing.T) {
	ns := nettest.Namespace(t)
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	// What an earlier version left: an ip-family table of the same name.
	h, err := netns.GetFromName(ns)
	require.NoError(t, err)
	defer h.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(h)))
	require.NoError(t, err)
	c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "vmflow_" + network.DefaultBridge})
	require.NoError(t, c.Flush())

	n, err := network.New(network.Config{Subnet: subnet, NetNS: ns, Store: st, Egress: "uplink0", Deny: []netip.Prefix{denyNet}})
	require.NoError(t, err)
	defer n.Close()
	require.NoError(t, n.EnsureHostPath())
	_, _, first := network.NFTDump(t, n)
	require.NoError(t, n.EnsureHostPath(), "a second run replaces the table")
	tables, chains, rules := network.NFTDump(t, n)
	assert.Equal(t, []string{"vmflow_vmflow0"}, tables, "one table: the earlier version's is gone")
	ts, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
	require.NoError(t, err)
	assert.Empty(t, ts)
	assert.ElementsMatch(t, []string{"input", "forward", "from_guests", "postrouting"}, chains)
	assert.Equal(t, first, rules, "nothing doubled")

	// A scan round leaves an intact table alone and makes a lost one again.
	restored, err := n.RestoreHostPath()
	require.NoError(t, err)
	assert.False(t, restored, "intact: left as it is")
	dropHostPath(t, ns)
	restored, err = n.RestoreHostPath()
	require.NoError(t, err)
	assert.True(t, restored, "a flushed table is made again")
	_, _, rules = network.NFTDump(t, n)
	assert.Equal(t, first, rules)

	off, err := network.New(network.Config{Subnet: subnet, NetNS: ns, Store: st})
	require.NoError(t, err)
	defer off.Close()
	require.NoError(t, off.EnsureHostPath())
	_, chains, rules = network.NFTDump(t, off)
	assert.ElementsMatch(t, []string{"input", "forward", "from_guests"}, chains, "without egress: no NAT, forwarding dropped")
	assert.Equal(t, 3+2+1, rules, "input: established, bridge, TAPs; forward: two jumps; from_guests: one drop")
}

func TestDenyRefusals(t *testing.T) {
	for _, s := range []string{"10.0.0.1/8", "fd00::/64", "ten", "10.0.0.0/8,", "10.0.0.0"} {
		_, err := network.ParseDeny(s)
		assert.ErrorIs(t, err, network.ErrInvalid, "%q", s)
	}
	got, err := network.ParseDeny(" 10.0.0.0/8, 192.168.0.0/16")
	require.NoError(t, err)
	assert.Equal(t, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.0.0/16")}, got)
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	for _, c := range []network.Config{
		{Subnet: subnet, Store: st, Deny: []netip.Prefix{netip.MustParsePrefix("10.0.0.1/8")}},
		{Subnet: subnet, Store: st, Egress: network.DefaultBridge},
		{Subnet: subnet, Store: st, Egress: network.TAPPrefix + "1"},
	} {
		_, err := network.New(c)
		assert.ErrorIs(t, err, network.ErrInvalid, fmt.Sprintf("%+v", c))
	}
}

// dropHostPath deletes the host-path table in ns (a hand's removal).
func dropHostPath(t *testing.T, ns string) {
	t.Helper()
	h, err := netns.GetFromName(ns)
	require.NoError(t, err)
	defer h.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(h)))
	require.NoError(t, err)
	c.DelTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: "vmflow_" + network.DefaultBridge})
	require.NoError(t, c.Flush())
}
