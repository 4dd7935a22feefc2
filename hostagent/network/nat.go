package network

import (
	"fmt"
	"net"
	"os"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// tableName names the nftables tables of the host's network, one per
// bridge in each family: ip (egress NAT) and bridge (the guard).
func (n *Net) tableName() string { return "vmflow_" + n.cfg.Bridge }

// natTable is the egress table, replaced whole by EnsureEgress.
func (n *Net) natTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyIPv4, Name: n.tableName()}
}

// nft is an nftables connection in the host network's namespace.
func (n *Net) nft() (*nftables.Conn, error) {
	// Each request dials its own socket: the deadline bounds each one.
	opts := []nftables.ConnOption{nftables.WithSockOptions(func(c *mnl.Conn) error {
		return c.SetDeadline(time.Now().Add(netlinkTimeout))
	})}
	if n.ns.IsOpen() {
		opts = append(opts, nftables.WithNetNSFd(int(n.ns)))
	}
	c, err := nftables.New(opts...)
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	return c, nil
}

// EnsureEgress gives the guests a way out when Config.Egress is set: their
// traffic from the subnet leaving by the egress interface is masqueraded
// behind its address, and forwarding is on; traffic routed from the bridge
// back into it is dropped, so a guest cannot reach another through the
// gateway either (the bridge's isolated ports already keep them apart at
// layer 2). The table is replaced whole in one transaction: idempotent,
// and an agent's restart after a changed flag leaves no rule of the old.
// Without Egress it removes the table an earlier run made.
func (n *Net) EnsureEgress() error {
	c, err := n.nft()
	if err != nil {
		return err
	}
	t := n.natTable()
	// Adding an existing table is no error; deleting it then empties it.
	c.AddTable(t)
	c.DelTable(t)
	if n.cfg.Egress == "" {
		if err := c.Flush(); err != nil {
			return fmt.Errorf("remove egress table %s: %w", t.Name, err)
		}
		return nil
	}
	c.AddTable(t)
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	sub := n.cfg.Subnet
	addr := sub.Addr().As4()
	mask := net.CIDRMask(sub.Bits(), 32)
	c.AddRule(&nftables.Rule{Table: t, Chain: post, Exprs: []expr.Any{
		// ip saddr & mask == subnet
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: addr[:]},
		// oifname == egress
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(n.cfg.Egress)},
		&expr.Masq{},
	}})
	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter})
	c.AddRule(&nftables.Rule{Table: t, Chain: fwd, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(n.cfg.Bridge)},
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(n.cfg.Bridge)},
		&expr.Verdict{Kind: expr.VerdictDrop},
	}})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("egress table %s: %w", t.Name, err)
	}
	return n.inNS(func() error {
		// /proc/sys/net is the namespace of the thread that opens it.
		f, err := os.OpenFile("/proc/sys/net/ipv4/ip_forward", os.O_WRONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("enable forwarding: %w", err)
		}
		_, werr := f.Write([]byte("1\n"))
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			return fmt.Errorf("enable forwarding: %w", werr)
		}
		return nil
	})
}

// ifname is name as nftables compares interface names: NUL-padded to
// IFNAMSIZ.
func ifname(name string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return b
}
