package network

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
)

// The host-path filter keeps guests off the host and, unless the operator
// gives them egress, off every other network. It is an inet table (the
// guard's name, in its own family) that EnsureHostPath replaces whole:
//
//   - input: whatever reaches the host's own stack from the bridge or from
//     a TAP is dropped, unless conntrack knows it as part of a flow the host
//     began (established, related). Guests get static addresses on their
//     command line and nothing on the host serves them; ARP is not seen by
//     inet hooks and goes on. Measured on this kernel: a guest's frame that
//     is routed to the host reaches inet input with iif = the bridge, not
//     its port, and `meta ibrname` (nft_meta_bridge) is refused with
//     EOPNOTSUPP in both the inet and the bridge family; so the bridge as a
//     whole is matched (every port of it is a VM's), and "vmtap*" besides
//     for a TAP that is not, or no longer, a port.
//   - forward, from the bridge or a TAP: without egress everything is
//     dropped (a host forwarding for another reason would route guests to
//     the world and back into the bridge to each other); with egress only
//     IPv4 out of the egress interface passes, and never to the denylist:
//     127/8, 169.254/16 (cloud metadata), the host's own addresses and the
//     operator's --net-deny ranges.
//   - postrouting (egress only): the guests' subnet masqueraded behind the
//     egress interface's address.
const (
	inputChain      = "input"
	forwardChain    = "forward"
	fromGuestsChain = "from_guests"
	natChain        = "postrouting"
)

// ErrRouteLocalnet: route_localnet is on, so the kernel routes packets to
// and from 127/8 on the bridge: a guest could reach the host's loopback
// services.
var ErrRouteLocalnet = errdefs.Misconfigured.New("network: route_localnet is on")

// alwaysDenied are what egress never reaches, whatever the operator says.
var alwaysDenied = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("169.254.0.0/16")}

func (n *Net) hostTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyINet, Name: n.tableName()}
}

// ParseDeny reads --net-deny: IPv4 CIDRs separated by commas, each masked
// (no host bits set). Empty: none.
func ParseDeny(s string) ([]netip.Prefix, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []netip.Prefix
	for f := range strings.SplitSeq(s, ",") {
		p, err := netip.ParsePrefix(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("%w: deny %q: want an IPv4 CIDR such as 10.0.0.0/8", ErrInvalid, f)
		}
		if err := checkDeny(p); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

func checkDeny(p netip.Prefix) error {
	if !p.IsValid() || !p.Addr().Is4() {
		return fmt.Errorf("%w: deny %q: want an IPv4 CIDR such as 10.0.0.0/8", ErrInvalid, p)
	}
	if p.Masked() != p {
		return fmt.Errorf("%w: deny %s: host bits set (want %s)", ErrInvalid, p, p.Masked())
	}
	return nil
}

// checkHostPath refuses what would open a hole in the filter: a deny
// range that is not a masked IPv4 CIDR, an egress that is the bridge or a
// TAP (traffic "out of the egress" would then go back to the guests).
func checkHostPath(cfg Config) error {
	for _, p := range cfg.Deny {
		if err := checkDeny(p); err != nil {
			return err
		}
	}
	if cfg.Egress != "" && (cfg.Egress == cfg.Bridge || strings.HasPrefix(cfg.Egress, TAPPrefix)) {
		return fmt.Errorf("%w: egress %q is the bridge or a VM's port", ErrInvalid, cfg.Egress)
	}
	return nil
}

// EnsureHostPath checks route_localnet, then replaces the host-path table
// (see above) in one transaction, removing the ip-family egress table of
// earlier versions in the same one, and with egress turns forwarding on.
// Idempotent; after an agent's restart with changed flags no rule of the
// old remains. ErrRouteLocalnet refuses before anything is changed.
func (n *Net) EnsureHostPath() error {
	if err := n.checkRouteLocalnet(); err != nil {
		return err
	}
	deny, err := n.denied()
	if err != nil {
		return err
	}
	c, err := n.nft()
	if err != nil {
		return err
	}
	// Adding an existing table is no error; deleting it then empties it.
	legacy := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: n.tableName()}
	c.AddTable(legacy)
	c.DelTable(legacy)
	t := n.hostTable()
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	n.hostPathRuleset(&ruleset{c: c, t: t, shape: map[string]int{}}, deny)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("host-path table %s: %w", t.Name, err)
	}
	if n.cfg.Egress == "" {
		return nil
	}
	return n.enableForwarding()
}

// RestoreHostPath runs EnsureHostPath when the table is not what it would
// make: missing, a chain missing, or a chain with another number of rules
// (a hand's flush or edit; the host gained or lost an address). Only the
// counts are compared: a rule edited in place stays until the agent
// restarts. It reports whether it rebuilt the table. route_localnet turned
// on since is ErrRouteLocalnet each time (the table stays and drops what
// the kernel would now route to 127/8).
func (n *Net) RestoreHostPath() (bool, error) {
	if err := n.checkRouteLocalnet(); err != nil {
		return false, err
	}
	deny, err := n.denied()
	if err != nil {
		return false, err
	}
	want := &ruleset{shape: map[string]int{}}
	n.hostPathRuleset(want, deny)
	c, err := n.nft()
	if err != nil {
		return false, err
	}
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return false, fmt.Errorf("host-path table: list chains: %w", err)
	}
	have := map[string]int{}
	for _, ch := range chains {
		if ch.Table.Name != n.tableName() {
			continue
		}
		rules, err := c.GetRules(ch.Table, ch)
		if err != nil {
			return false, fmt.Errorf("host-path table: list rules of %s: %w", ch.Name, err)
		}
		have[ch.Name] = len(rules)
	}
	if maps.Equal(have, want.shape) {
		return false, nil
	}
	return true, n.EnsureHostPath()
}

// ruleset queues chains and rules of table t on c and counts each chain's
// rules in shape; with c nil it only counts (what RestoreHostPath compares
// the kernel's table with).
type ruleset struct {
	c     *nftables.Conn
	t     *nftables.Table
	shape map[string]int
}

func (r *ruleset) chain(ch *nftables.Chain) *nftables.Chain {
	ch.Table = r.t
	r.shape[ch.Name] += 0
	if r.c != nil {
		r.c.AddChain(ch)
	}
	return ch
}

func (r *ruleset) rule(ch *nftables.Chain, exprs ...expr.Any) {
	r.shape[ch.Name]++
	if r.c != nil {
		r.c.AddRule(&nftables.Rule{Table: r.t, Chain: ch, Exprs: exprs})
	}
}

// hostPathRuleset queues the table's chains and rules on r; deny is the
// egress denylist (unused without egress).
func (n *Net) hostPathRuleset(r *ruleset, deny []netip.Prefix) {
	in := r.chain(&nftables.Chain{Name: inputChain, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter})
	r.rule(in,
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
		&expr.Verdict{Kind: expr.VerdictAccept},
	)
	drop := []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}}
	for _, from := range n.guestSides() {
		r.rule(in, append(from, drop...)...)
	}

	fwd := r.chain(&nftables.Chain{Name: forwardChain, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter})
	guests := r.chain(&nftables.Chain{Name: fromGuestsChain})
	for _, from := range n.guestSides() {
		r.rule(fwd, append(from, &expr.Verdict{Kind: expr.VerdictJump, Chain: guests.Name})...)
	}
	if n.cfg.Egress == "" {
		r.rule(guests, drop...)
		return
	}
	// Out of any other interface (back into the bridge too) is dropped.
	r.rule(guests, append([]expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: ifname(n.cfg.Egress)},
	}, drop...)...)
	// The denylist reads IPv4 headers; the guard lets nothing else leave a
	// port, this keeps the offsets right whatever comes.
	r.rule(guests, append(notIPv4(), drop...)...)
	for _, p := range deny {
		r.rule(guests, append(ipIn(16, p), drop...)...)
	}
	n.addEgressNAT(r)
}

// guestSides are the matches of what comes from the guests: the bridge
// (every port of it is a VM's), and a TAP seen on its own.
func (n *Net) guestSides() [][]expr.Any {
	return [][]expr.Any{
		{&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(n.cfg.Bridge)}},
		// A prefix match compares only the prefix's bytes: nft's "vmtap*".
		{&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte(TAPPrefix)}},
	}
}

// notIPv4 matches a packet that is not IPv4 (in an inet chain).
func notIPv4() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
	}
}

// ipIn matches an IPv4 packet whose address at header offset off (12:
// source, 16: destination) is in p.
func ipIn(off uint32, p netip.Prefix) []expr.Any {
	a := p.Addr().As4()
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: net.CIDRMask(p.Bits(), 32), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a[:]},
	}
}

// denied is the egress denylist: alwaysDenied, the namespace's own IPv4
// addresses now, and Config.Deny; sorted, without repeats. A packet to a
// local address is delivered, not forwarded, so the input chain is what
// keeps guests off the host's addresses, including ones added later; their
// place here says so to whoever lists the table.
func (n *Net) denied() ([]netip.Prefix, error) {
	addrs, err := n.h.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("host-path denylist: list addresses: %w", err)
	}
	out := slices.Concat(alwaysDenied, n.cfg.Deny)
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok && ip.Unmap().Is4() {
			out = append(out, netip.PrefixFrom(ip.Unmap(), 32))
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	return slices.Compact(out), nil
}

// checkRouteLocalnet refuses when route_localnet is on where it applies to
// the bridge: conf/all and conf/<bridge> (the kernel ORs them), and
// conf/default, which a bridge made later (EnsureBridge, after a reboot or
// a hand's removal) inherits; measured here: a link made with default=1
// has 1. Read inside the network's namespace.
func (n *Net) checkRouteLocalnet() error {
	var on []string
	err := n.inNS(func() error {
		for _, dev := range []string{"all", "default", n.cfg.Bridge} {
			p := "/proc/sys/net/ipv4/conf/" + dev + "/route_localnet"
			// /proc/sys/net is the namespace of the thread that opens it.
			b, err := os.ReadFile(p)
			if dev == n.cfg.Bridge && errors.Is(err, fs.ErrNotExist) {
				continue // no bridge yet: it will take conf/default's
			}
			if err != nil {
				return fmt.Errorf("read %s: %w", p, err)
			}
			if strings.TrimSpace(string(b)) != "0" {
				on = append(on, "net.ipv4.conf."+dev+".route_localnet")
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("check route_localnet: %w", err)
	}
	if len(on) > 0 {
		return fmt.Errorf("%w: %s set: the kernel would route guests' packets to the host's 127.0.0.1 services; set it to 0 (sysctl -w %s=0)",
			ErrRouteLocalnet, strings.Join(on, ", "), strings.Join(on, "=0 "))
	}
	return nil
}
