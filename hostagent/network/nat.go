package network

import (
	"fmt"
	"os"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// tableName names the nftables tables of the host's network, one per
// bridge in each family: inet (the host-path filter and egress NAT,
// hostpath.go) and bridge (the guard).
func (n *Net) tableName() string { return "vmflow_" + n.cfg.Bridge }

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

// addEgressNAT queues on r, in the inet table, the chain that gives the
// guests a way out when Config.Egress is set: their IPv4 traffic from the
// subnet leaving by the egress interface is masqueraded behind its
// address. What may leave at all is the forward chain's to say
// (hostPathRuleset).
func (n *Net) addEgressNAT(r *ruleset) {
	post := r.chain(&nftables.Chain{Name: natChain, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	exprs := []expr.Any{
		// An inet chain sees IPv6 too: the payload offsets are IPv4's.
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
	}
	exprs = append(exprs, ipIn(12, n.cfg.Subnet)...)
	exprs = append(exprs,
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(n.cfg.Egress)},
		&expr.Masq{},
	)
	r.rule(post, exprs...)
}

// enableForwarding turns IPv4 forwarding on in the network's namespace.
// Without egress it is left as it is (another of the host's users may need
// it): the forward chain drops the guests' traffic then.
func (n *Net) enableForwarding() error {
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
