package network

import (
	"net"
	"net/netip"
	"testing"
	vmflowv1 "vmflow/proto/vmflow/v1"

	"github.com/google/nftables"
	"github.com/google/nftables/userdata"
	"github.com/stretchr/testify/require"
)

// GuardElements are the elements of n's anti-spoofing set, each as
// "TAP MAC ADDRESS".
func GuardElements(t *testing.T, n *Net) []string {
	t.Helper()
	out, err := n.FilterPorts()
	require.NoError(t, err)
	return out
}

// GuardElement is how GuardElements shows the element of tap, mac, addr.
func GuardElement(tap, mac string, addr netip.Addr) string { return FilterPort(tap, mac, addr) }

// EditGuard flushes n's anti-spoofing set, then adds an element of tap, mac,
// addr for each given (what a hand or a crash leaves).
func EditGuard(t *testing.T, n *Net, add ...[3]string) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	set := guardPorts(n.guardTable())
	c.FlushSet(set)
	for _, a := range add {
		mac, err := net.ParseMAC(a[1])
		require.NoError(t, err)
		p := port{tap: a[0], mac: mac, addr: netip.MustParseAddr(a[2])}
		require.NoError(t, c.SetAddElements(set, []nftables.SetElement{{Key: p.key()}}))
	}
	require.NoError(t, c.Flush())
}

// DropGuard deletes n's anti-spoofing table (what a reboot or a hand does).
func DropGuard(t *testing.T, n *Net) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	c.DelTable(n.guardTable())
	require.NoError(t, c.Flush())
}

// GuardChain is the number of rules of n's guard chain and the packets its
// drop rule counted.
func GuardChain(t *testing.T, n *Net) (rules int, drops uint64) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	tb := n.guardTable()
	rs, err := c.GetRules(tb, &nftables.Chain{Name: guardChain, Table: tb})
	require.NoError(t, err)
	d, err := n.FilterDropped()
	require.NoError(t, err)
	return len(rs), d.Spoofed
}

// CutGuardChain deletes the last rule of n's guard chain (a hand's edit).
func CutGuardChain(t *testing.T, n *Net) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	tb := n.guardTable()
	ch := &nftables.Chain{Name: guardChain, Table: tb}
	rs, err := c.GetRules(tb, ch)
	require.NoError(t, err)
	require.NotEmpty(t, rs)
	require.NoError(t, c.DelRule(rs[len(rs)-1]))
	require.NoError(t, c.Flush())
}

// UnguardPort is what Release does last: remove the released lease's element.
func UnguardPort(n *Net, id string, nl *vmflowv1.NetworkLease) error { return n.unguardPort(id, nl) }

// GuardComments are the comments of n's guard chain's rules, in order.
func GuardComments(t *testing.T, n *Net) []string {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	tb := n.guardTable()
	rs, err := c.GetRules(tb, &nftables.Chain{Name: guardChain, Table: tb})
	require.NoError(t, err)
	var out []string
	for _, r := range rs {
		comment, _ := userdata.GetString(r.UserData, userdata.TypeComment)
		out = append(out, comment)
	}
	return out
}
