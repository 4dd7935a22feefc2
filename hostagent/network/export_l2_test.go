package network

import (
	"net"
	"testing"

	mnl "github.com/mdlayher/netlink"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// FDBMaxLearned is the bound the bridge's learned FDB entries are given.
const FDBMaxLearned = fdbMaxLearned

// FlushFDB flushes the bridge's FDB (IFLA_BR_FDB_FLUSH): every entry not
// static goes, as learnt entries go after the ageing time.
func FlushFDB(t *testing.T, n *Net) {
	t.Helper()
	br, err := n.h.LinkByName(n.cfg.Bridge)
	require.NoError(t, err)
	ae := mnl.NewAttributeEncoder()
	ae.Nested(unix.IFLA_LINKINFO, func(li *mnl.AttributeEncoder) error {
		li.String(unix.IFLA_INFO_KIND, "bridge")
		li.Nested(unix.IFLA_INFO_DATA, func(d *mnl.AttributeEncoder) error {
			d.Flag(unix.IFLA_BR_FDB_FLUSH, true)
			return nil
		})
		return nil
	})
	attrs, err := ae.Encode()
	require.NoError(t, err)
	c, err := n.rtnl()
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Execute(mnl.Message{
		Header: mnl.Header{Type: unix.RTM_NEWLINK, Flags: mnl.Request | mnl.Acknowledge},
		Data:   append(ifinfomsg(unix.AF_UNSPEC, br.Attrs().Index), attrs...),
	})
	require.NoError(t, err)
}

// FDBBound is the bridge's fdb_max_learned; known is false where the
// kernel has none (before Linux 6.8).
func FDBBound(t *testing.T, n *Net) (bound uint32, known bool) {
	t.Helper()
	br, err := n.h.LinkByName(n.cfg.Bridge)
	require.NoError(t, err)
	c, err := n.rtnl()
	require.NoError(t, err)
	defer c.Close()
	msgs, err := c.Execute(mnl.Message{
		Header: mnl.Header{Type: unix.RTM_GETLINK, Flags: mnl.Request},
		Data:   ifinfomsg(unix.AF_UNSPEC, br.Attrs().Index),
	})
	require.NoError(t, err)
	bound, known, err = fdbMaxOf(msgs)
	require.NoError(t, err)
	return bound, known
}

// GuestPortWhole says whether the port tap has every guest port setting and
// the static, sticky FDB entry of mac, as the TAP reconcile checks them.
func GuestPortWhole(t *testing.T, n *Net, tap string, mac net.HardwareAddr) bool {
	t.Helper()
	ps, err := n.readBridgePorts()
	require.NoError(t, err)
	l, err := n.h.LinkByName(tap)
	require.NoError(t, err)
	br, err := n.h.LinkByName(n.cfg.Bridge)
	require.NoError(t, err)
	return ps.whole(l.Attrs().Index, mac, br.Attrs().Index)
}

// PortFloods reports the port tap's unicast, multicast and broadcast flood
// settings.
func PortFloods(t *testing.T, n *Net, tap string) (unicast, multicast, broadcast bool) {
	t.Helper()
	ps, err := n.readBridgePorts()
	require.NoError(t, err)
	l, err := n.h.LinkByName(tap)
	require.NoError(t, err)
	f := ps.flags[l.Attrs().Index]
	return f[unix.IFLA_BRPORT_UNICAST_FLOOD] == 1, f[unix.IFLA_BRPORT_MCAST_FLOOD] == 1, f[unix.IFLA_BRPORT_BCAST_FLOOD] == 1
}

// SetupGuestPort makes the link named port (a veth standing for a guest's
// TAP) a guest's port of the bridge for mac, as a launch makes a TAP one.
func SetupGuestPort(t *testing.T, n *Net, port string, mac net.HardwareAddr) {
	t.Helper()
	l, err := n.h.LinkByName(port)
	require.NoError(t, err)
	br, err := n.h.LinkByName(n.cfg.Bridge)
	require.NoError(t, err)
	require.NoError(t, n.setupPort(l, br, mac))
}
