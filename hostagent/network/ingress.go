package network

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	mnl "github.com/mdlayher/netlink"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// The ingress guard (issue 32): every frame a guest's QEMU writes into its
// TAP is judged at the TAP's own ingress hook, the earliest netfilter has
// (run in __netif_receive_skb_core before the bridge's rx_handler), by a
// netdev-family base chain of its own: a frame over the port's rate
// (Config.PortPPS), or whose Ethernet source is not the lease's MAC, is
// dropped and counted there. The bridge guard (guard.go) cannot do this
// for every frame: the bridge hands a link-local frame (01:80:c2:00:00:0x,
// LLDP, STP) to the host's stack on the TAP, learning its source first if
// the port learns, and it never passes the bridge's prerouting hook; so
// without this chain a guest sent such frames with any source and at any
// rate.
//
// One table, netdev vmflow_<bridge>, holds a base chain per guest TAP,
// named as the TAP: a netdev base chain hooks the devices it names, and
// each TAP's chain holds its own lease's MAC and its own rate bucket (a
// limit expression keeps its state per rule). Every chain's drop rules
// count into the table's two named counters, so the counts survive a
// port's chain going with its lease (vmflow_network_filter_dropped_frames_total
// and vmflow_network_port_rate_dropped_frames_total add them to the bridge
// guard's).
//
// A chain is made by setupPort before its TAP joins the bridge (launch,
// and the scan round's reattach), checked and made again by RebuildGuard
// (agent start, every scan round), and removed once its lease's release is
// recorded (unguardPort) or, by RebuildGuard, when no held lease names its
// TAP. What the kernel does when a chain's device goes: before Linux 6.16
// the chain goes with it (nft_netdev_event released the base chain of its
// last device); since 6.16 the chain stays, hooked to nothing, and is
// hooked again to a device made later under that name (measured here, on
// 6.18: a chain can even be made for a name no device has). So a release
// removes its chain by name and MAC, a chain already gone being success,
// and a chain is made only for a TAP that exists (an older kernel refuses
// one for a missing device); a new TAP that finds an old lease's chain
// under its name has it replaced by setupPort before it joins the bridge.
const (
	// Named counters of the ingress table.
	ingressSpoofed = "spoofed"
	ingressRate    = "over_rate"
	// ingressPriority runs each TAP's chain first of whatever else a
	// tool may hook at the TAP's ingress: nothing there sees a frame
	// this chain drops.
	ingressPriority = math.MinInt32
	// commentIngressMAC starts the comment of the rule that passes the
	// lease's own MAC (the MAC follows); commentIngressSpoofed is the one
	// that drops the rest.
	commentIngressMAC     = "vmflow: the lease's source MAC "
	commentIngressSpoofed = "vmflow: any other source MAC: dropped"
	// nfnetlink attributes golang.org/x/sys/unix does not name.
	nftaHookDevs   = 4 // NFTA_HOOK_DEVS: nested NFTA_DEVICE_NAME
	nftaDeviceName = 1 // NFTA_DEVICE_NAME
)

func (n *Net) ingressTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyNetdev, Name: n.tableName()}
}

// ingressChain is the base chain of the TAP tap in table t: hooked at its
// ingress, dropping what no rule accepts (so a chain a hand emptied still
// lets no spoofed frame through until it is made again).
func ingressChain(t *nftables.Table, tap string) *nftables.Chain {
	drop := nftables.ChainPolicyDrop
	return &nftables.Chain{Name: tap, Table: t, Type: nftables.ChainTypeFilter, Hooknum: nftables.ChainHookIngress,
		Priority: nftables.ChainPriorityRef(ingressPriority), Policy: &drop, Device: tap}
}

// ingressRules are the rules of a TAP's chain, in order, for its lease's
// mac and pps frames a second.
func ingressRules(mac net.HardwareAddr, pps uint32) []guardRule {
	counter := func(name string) *expr.Objref { return &expr.Objref{Type: int(nftables.ObjTypeCounter), Name: name} }
	return []guardRule{
		// limit rate over pps/second burst b packets counter name
		// over_rate drop: first, so a flood of spoofed frames costs no
		// more than the rest. The rate is in the comment, as in the
		// bridge guard's.
		{fmt.Sprintf("%s%d frames/s (burst %d) from this guest port: dropped", commentRate, pps, portBurst(pps)), []expr.Any{
			&expr.Limit{Type: expr.LimitTypePkts, Rate: uint64(pps), Unit: expr.LimitTimeSecond, Over: true, Burst: portBurst(pps)},
			counter(ingressRate),
			&expr.Verdict{Kind: expr.VerdictDrop},
		}},
		// ether saddr <mac> accept: the lease's MAC, every ethertype and
		// destination (the bridge guard judges the rest, where a frame
		// reaches it). An accept, not a drop of the others: a frame this
		// rule cannot read falls to the drop below.
		{commentIngressMAC + mac.String(), []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: slices.Clone([]byte(mac))},
			&expr.Verdict{Kind: expr.VerdictAccept},
		}},
		// counter name spoofed drop
		{commentIngressSpoofed, []expr.Any{counter(ingressSpoofed), &expr.Verdict{Kind: expr.VerdictDrop}}},
	}
}

// chainHook is a netdev base chain as the kernel describes it.
type chainHook struct {
	typ                   string
	hooknum, prio, policy uint32
	hooked, policed       bool
	devices               []string // hooked device names; nil: none named
}

// ingressState is what the kernel holds of the ingress table: its chains
// and, for those read, their rules.
type ingressState struct {
	counters bool                        // both named counters exist
	chains   map[string]chainHook        // by name
	rules    map[string][]*nftables.Rule // by chain name, for the chains read
}

// whole reports whether tap's chain hooks tap alone at its ingress, first,
// and holds exactly ingressRules(mac, pps).
func (s *ingressState) whole(tap string, mac net.HardwareAddr, pps uint32) bool {
	ch, ok := s.chains[tap]
	if !ok || !ch.hooked || !ch.policed || ch.typ != string(nftables.ChainTypeFilter) ||
		ch.hooknum != unix.NF_NETDEV_INGRESS || int32(ch.prio) != ingressPriority || ch.policy != uint32(nftables.ChainPolicyDrop) ||
		!slices.Equal(ch.devices, []string{tap}) {
		return false
	}
	rules, ok := s.rules[tap]
	want := ingressRules(mac, pps)
	if !ok || len(rules) != len(want) {
		return false
	}
	for i, r := range rules {
		comment, _ := userdata.GetString(r.UserData, userdata.TypeComment)
		if comment != want[i].comment || !reflect.DeepEqual(r.Exprs, want[i].exprs) {
			return false
		}
	}
	return s.counters
}

// macOf is the MAC tap's chain passes, as its accept rule's comment says;
// false when it has no such rule (a chain a hand changed).
func (s *ingressState) macOf(tap string) (net.HardwareAddr, bool) {
	for _, r := range s.rules[tap] {
		comment, _ := userdata.GetString(r.UserData, userdata.TypeComment)
		if m, ok := strings.CutPrefix(comment, commentIngressMAC); ok {
			mac, err := net.ParseMAC(m)
			return mac, err == nil
		}
	}
	return nil, false
}

// readIngress reads the ingress table's chains and counters on c, and the
// rules of the chains named in only (every chain's when only is nil).
func (n *Net) readIngress(c *nftables.Conn, only []string) (*ingressState, error) {
	t := n.ingressTable()
	s := &ingressState{rules: map[string][]*nftables.Rule{}}
	var err error
	if s.chains, err = n.netdevChains(t.Name); err != nil {
		return nil, err
	}
	objs, err := c.GetObjects(t)
	if err != nil {
		return nil, fmt.Errorf("list counters of table netdev %s: %w", t.Name, err)
	}
	have := map[string]bool{}
	for _, o := range objs {
		if co, ok := o.(*nftables.CounterObj); ok {
			have[co.Name] = true
		}
	}
	s.counters = have[ingressSpoofed] && have[ingressRate]
	for name := range s.chains {
		if only != nil && !slices.Contains(only, name) {
			continue
		}
		rules, err := c.GetRules(t, &nftables.Chain{Name: name, Table: t})
		if err != nil {
			// A chain gone since the list: read as not whole.
			continue
		}
		s.rules[name] = rules
	}
	return s, nil
}

// ingressCounts reads the ingress table's counters: what its chains dropped
// as spoofed and as over the rate. A table that is not there counted
// nothing.
func (n *Net) ingressCounts(c *nftables.Conn) (spoofed, overRate uint64, err error) {
	objs, err := c.GetObjects(n.ingressTable())
	if err != nil {
		return 0, 0, fmt.Errorf("list counters of table netdev %s: %w", n.tableName(), err)
	}
	for _, o := range objs {
		co, ok := o.(*nftables.CounterObj)
		switch {
		case !ok:
		case co.Name == ingressSpoofed:
			spoofed = co.Packets
		case co.Name == ingressRate:
			overRate = co.Packets
		}
	}
	return spoofed, overRate, nil
}

// queueIngressChain queues on c tap's chain for mac made anew: the table
// and its counters made where missing (adding existing ones changes
// nothing, their counts included), the old chain deleted when there is
// one, then the chain and its rules. One transaction: until it commits
// the old chain judges, after it the new one.
func (n *Net) queueIngressChain(c *nftables.Conn, old bool, tap string, mac net.HardwareAddr) {
	t := n.ingressTable()
	c.AddTable(t)
	c.AddObj(&nftables.CounterObj{Table: t, Name: ingressSpoofed})
	c.AddObj(&nftables.CounterObj{Table: t, Name: ingressRate})
	if old {
		c.DelChain(&nftables.Chain{Name: tap, Table: t})
	}
	ch := c.AddChain(ingressChain(t, tap))
	for _, r := range ingressRules(mac, n.cfg.PortPPS) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: r.exprs, UserData: userdata.AppendString(nil, userdata.TypeComment, r.comment)})
	}
}

// ingressPort makes the chain of the TAP (or a link standing for one) tap
// for its lease's mac, unless it is there whole: setupPort's first step,
// before the port joins the bridge.
func (n *Net) ingressPort(tap string, mac net.HardwareAddr) error {
	n.gmu.Lock()
	defer n.gmu.Unlock()
	c, err := n.nft()
	if err != nil {
		return fmt.Errorf("ingress filter of %s: %w", tap, err)
	}
	s, err := n.readIngress(c, []string{tap})
	if err != nil {
		return fmt.Errorf("ingress filter of %s: %w", tap, err)
	}
	if s.whole(tap, mac, n.cfg.PortPPS) {
		return nil
	}
	_, old := s.chains[tap]
	n.queueIngressChain(c, old, tap, mac)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("ingress filter of %s: table netdev %s: %w", tap, n.tableName(), err)
	}
	return nil
}

// rebuildIngressLocked makes the ingress table hold a whole chain for each
// held lease in ports whose TAP exists (or whose chain does: a kernel since
// 6.16 keeps it for a TAP that is gone), and no chain of a TAP no held
// lease names. A chain is kept as it is where no readable record can tell
// (unknown's TAPs, every TAP when all). Each chain changes in a
// transaction of its own, so one that fails (its TAP going meanwhile) holds
// up no other. Under gmu.
func (n *Net) rebuildIngressLocked(ports map[string]port, owner map[string]string, unknown map[string]bool, all bool) error {
	t := n.ingressTable()
	c, err := n.nft()
	if err != nil {
		return fmt.Errorf("ingress filter: %w", err)
	}
	taps, err := n.taps()
	if err != nil {
		return fmt.Errorf("ingress filter: %w", err)
	}
	s, err := n.readIngress(c, nil)
	if err != nil {
		return fmt.Errorf("ingress filter: %w", err)
	}
	var errs []error
	if !s.counters {
		// Made even with no guest: the drop counts are read from it
		// every round.
		c.AddTable(t)
		c.AddObj(&nftables.CounterObj{Table: t, Name: ingressSpoofed})
		c.AddObj(&nftables.CounterObj{Table: t, Name: ingressRate})
		if err := c.Flush(); err != nil {
			return fmt.Errorf("ingress filter: table netdev %s: %w", t.Name, err)
		}
	}
	for tap, p := range ports {
		_, old := s.chains[tap]
		if !old && !slices.Contains(taps, tap) {
			continue // made by its launch's setupPort
		}
		if s.whole(tap, p.mac, n.cfg.PortPPS) {
			continue
		}
		n.queueIngressChain(c, old, tap, p.mac)
		if err := c.Flush(); err != nil {
			errs = append(errs, fmt.Errorf("ingress filter of %s: table netdev %s: %w", tap, t.Name, err))
			continue
		}
		if old {
			n.cfg.Logger.Warn("network ingress chain was not whole (changed by hand, or another --net-port-pps); made again",
				zap.String("instance_id", owner[tap]), zap.String("tap", tap), zap.String("mac", p.mac.String()))
		} else {
			n.logPort("network ingress chain added", owner[tap], p)
		}
	}
	for name := range s.chains {
		if _, leased := ports[name]; leased || all || unknown[name] {
			continue
		}
		if err := n.delIngressChain(c, name); err != nil {
			errs = append(errs, err)
			continue
		}
		n.cfg.Logger.Info("network ingress chain removed: no held lease names its TAP", zap.String("tap", name))
	}
	return errors.Join(errs...)
}

// unIngressLocked removes the released lease p's chain, and only its: once
// the release is recorded the next lease of the address (the same TAP
// name, another MAC) may already have made its own. A chain already gone
// (with its TAP, before Linux 6.16) is success. Under gmu.
func (n *Net) unIngressLocked(id string, p port) error {
	c, err := n.nft()
	if err != nil {
		return fmt.Errorf("ingress filter: %w", err)
	}
	s, err := n.readIngress(c, []string{p.tap})
	if err != nil {
		return fmt.Errorf("ingress filter: %w", err)
	}
	if mac, ok := s.macOf(p.tap); !ok || !bytes.Equal(mac, p.mac) {
		return nil
	}
	if err := n.delIngressChain(c, p.tap); err != nil {
		return err
	}
	n.logPort("network ingress chain removed", id, p)
	return nil
}

// delIngressChain deletes the ingress chain name; one already gone is
// success.
func (n *Net) delIngressChain(c *nftables.Conn, name string) error {
	c.DelChain(&nftables.Chain{Name: name, Table: n.ingressTable()})
	if err := c.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("ingress filter: remove chain %s: %w", name, err)
	}
	return nil
}

// netdevChains lists the chains of the netdev table named table, with
// their hooks' devices, which nftables v0.3.0 does not read: one dump of
// the family's chains, on a netfilter socket in the host network's
// namespace, with a deadline.
func (n *Net) netdevChains(table string) (map[string]chainHook, error) {
	cfg := &mnl.Config{}
	if n.ns.IsOpen() {
		cfg.NetNS = int(n.ns)
	}
	c, err := mnl.Dial(unix.NETLINK_NETFILTER, cfg)
	if err != nil {
		return nil, fmt.Errorf("nfnetlink: %w", err)
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(netlinkTimeout)); err != nil {
		return nil, fmt.Errorf("nfnetlink: %w", err)
	}
	msgs, err := c.Execute(mnl.Message{
		Header: mnl.Header{Type: mnl.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETCHAIN), Flags: mnl.Request | mnl.Dump},
		// struct nfgenmsg: the family, NFNETLINK_V0, res_id 0.
		Data: []byte{unix.NFPROTO_NETDEV, unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return nil, fmt.Errorf("list netdev chains: %w", err)
	}
	out := map[string]chainHook{}
	for _, m := range msgs {
		name, of, ch, err := parseChain(m.Data)
		if err != nil {
			return nil, fmt.Errorf("list netdev chains: %w", err)
		}
		if of == table {
			out[name] = ch
		}
	}
	return out, nil
}

// parseChain reads an NFT_MSG_NEWCHAIN's payload: the chain's name, its
// table's and its hook.
func parseChain(b []byte) (name, table string, ch chainHook, err error) {
	if len(b) < 4 {
		return "", "", ch, errors.New("short chain message")
	}
	ad, err := mnl.NewAttributeDecoder(b[4:])
	if err != nil {
		return "", "", ch, err
	}
	ad.ByteOrder = binary.BigEndian
	var dev string
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_CHAIN_NAME:
			name = ad.String()
		case unix.NFTA_CHAIN_TABLE:
			table = ad.String()
		case unix.NFTA_CHAIN_TYPE:
			ch.typ = ad.String()
		case unix.NFTA_CHAIN_POLICY:
			ch.policy, ch.policed = ad.Uint32(), true
		case unix.NFTA_CHAIN_HOOK:
			ad.Nested(func(h *mnl.AttributeDecoder) error {
				for h.Next() {
					switch h.Type() {
					case unix.NFTA_HOOK_HOOKNUM:
						ch.hooknum, ch.hooked = h.Uint32(), true
					case unix.NFTA_HOOK_PRIORITY:
						ch.prio = h.Uint32()
					case unix.NFTA_HOOK_DEV:
						dev = h.String()
					case nftaHookDevs:
						ch.devices = []string{}
						h.Nested(func(d *mnl.AttributeDecoder) error {
							for d.Next() {
								name := d.String()
								if d.Type() != nftaDeviceName {
									// A wildcard (Linux 6.16's
									// NFTA_DEVICE_PREFIX): never one of ours.
									name += "*"
								}
								ch.devices = append(ch.devices, name)
							}
							return nil
						})
					}
				}
				return nil
			})
		}
	}
	if ch.devices == nil && dev != "" {
		ch.devices = []string{dev}
	}
	return name, table, ch, ad.Err()
}
