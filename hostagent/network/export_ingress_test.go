package network

import (
	"net"
	"slices"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/stretchr/testify/require"
)

// IngressChains lists, sorted, the chains of n's ingress table, each as
// "TAP MAC" (the MAC its accept rule names; "?" where it names none).
func IngressChains(t *testing.T, n *Net) []string {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	s, err := n.readIngress(c, nil)
	require.NoError(t, err)
	var out []string
	for name := range s.chains {
		mac, ok := s.macOf(name)
		m := "?"
		if ok {
			m = mac.String()
		}
		out = append(out, name+" "+m)
	}
	slices.Sort(out)
	return out
}

// IngressChain is how IngressChains shows tap's chain for mac.
func IngressChain(tap string, mac net.HardwareAddr) string { return tap + " " + mac.String() }

// IngressWhole says whether tap's ingress chain is whole for mac, as the
// rebuild checks it.
func IngressWhole(t *testing.T, n *Net, tap string, mac net.HardwareAddr) bool {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	s, err := n.readIngress(c, []string{tap})
	require.NoError(t, err)
	return s.whole(tap, mac, n.cfg.PortPPS)
}

// IngressRuleHandles are the handles of tap's ingress chain's rules: the
// same handles, the same rules (none made again).
func IngressRuleHandles(t *testing.T, n *Net, tap string) []uint64 {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	tb := n.ingressTable()
	rs, err := c.GetRules(tb, &nftables.Chain{Name: tap, Table: tb})
	require.NoError(t, err)
	var out []uint64
	for _, r := range rs {
		out = append(out, r.Handle)
	}
	return out
}

// IngressDropped is what n's ingress chains counted: frames with another
// source MAC, frames over the rate.
func IngressDropped(t *testing.T, n *Net) (spoofed, overRate uint64) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	spoofed, overRate, err = n.ingressCounts(c)
	require.NoError(t, err)
	return spoofed, overRate
}

// DropIngressChain deletes tap's ingress chain (a hand's `nft delete chain`).
func DropIngressChain(t *testing.T, n *Net, tap string) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	c.DelChain(&nftables.Chain{Name: tap, Table: n.ingressTable()})
	require.NoError(t, c.Flush())
}

// OpenIngressChain replaces, in place, each rule of tap's ingress chain by
// one that accepts every frame, keeping its comment (a hand's `nft replace
// rule`): the chain looks as it was to whoever reads only the comments.
func OpenIngressChain(t *testing.T, n *Net, tap string) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	tb := n.ingressTable()
	ch := &nftables.Chain{Name: tap, Table: tb}
	rs, err := c.GetRules(tb, ch)
	require.NoError(t, err)
	require.NotEmpty(t, rs)
	for _, r := range rs {
		c.ReplaceRule(&nftables.Rule{Table: tb, Chain: ch, Handle: r.Handle, UserData: r.UserData,
			Exprs: []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}}})
	}
	require.NoError(t, c.Flush())
}

// MakeIngressChain makes an ingress chain for tap and mac as the agent
// does (what a crash, or an agent of another lease, left).
func MakeIngressChain(t *testing.T, n *Net, tap string, mac net.HardwareAddr) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	s, err := n.readIngress(c, []string{tap})
	require.NoError(t, err)
	_, old := s.chains[tap]
	n.queueIngressChain(c, old, tap, mac)
	require.NoError(t, c.Flush())
}
