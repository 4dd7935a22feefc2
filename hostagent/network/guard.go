package network

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// The guard is the per-port anti-spoofing filter: a bridge-family table (the
// NAT table's name, in its own family) whose prerouting chain judges every
// frame entering a bridge from a port named with TAPPrefix. A frame passes
// only when its (port, source MAC, source IPv4) is an element of the ports
// set, or, for ARP over Ethernet/IPv4, when both (port, source MAC, sender
// address) and (port, sender MAC, sender address) are; every other frame from
// such a port is dropped: spoofed ones, IPv6, VLAN-tagged, any other
// ethertype (a guest's network is IPv4 with a static address, so it needs
// neither IPv6 nor the unspecified source). A port not in the set forwards
// nothing, so a TAP forwards only once its lease's element exists.
//
// Before any of that, each guest port's frames are bounded to
// Config.PortPPS a second (issue 32, finding 6): a per-port token bucket
// (a meter: the rate set holds one limit per port name) drops and counts
// what is over it, so a guest flooding the bridge costs the host a bounded
// share of its time and leaves its neighbours' buckets alone.
//
// LLDP and STP group frames (01:80:c2:00:00:0e and :00) never reach this
// hook: the bridge hands them to the host's stack on the TAP itself. The
// ingress guard (ingress.go) judges every frame at the TAP first, those
// included: its chain drops a source MAC that is not the lease's and
// bounds the port to the same rate. So of this chain, the meter and the
// MAC in the set's key repeat the ingress chain's judgement for the frames
// that reach the bridge; they are kept as a second line (a port whose
// ingress chain a hand deleted, until the next scan round makes it again),
// while the IPv4 source, ARP's sender fields and the ethertypes are judged
// here only.
//
// The set holds one element per held network lease, derived from the
// records: AttachLocked adds the lease's before it makes the TAP, Release
// removes it once the release is recorded, and RebuildGuard replaces the
// table whole from the records (at start, after a reboot, each reconcile),
// and the ingress chains with it.
const (
	guardChain = "guard"
	guardSet   = "ports"
	// rateSet is the meter: one per-port limit, keyed by the port's name.
	// Its size bounds the ports it tracks: names come from addresses, and
	// a subnet has fewer.
	rateSet     = "rate"
	rateSetSize = 1 << 16
	// commentSpoofed marks the rule that drops what is not the lease's;
	// commentRate starts the one that drops what is over the rate.
	commentSpoofed = "vmflow: anything else from a guest port: dropped"
	commentRate    = "vmflow: over "
	// guardPriority is nft's "filter" priority in the bridge family.
	guardPriority = -200
	// Registers of the concatenated key: NFT_REG32_00 takes the port's
	// name (16 bytes), NFT_REG32_04 the MAC (6 bytes, padded to 8),
	// NFT_REG32_06 the IPv4 address.
	regName, regMAC, regAddr = 8, 12, 14
	// keyLen is the key's length: each field padded to 4 bytes.
	keyLen = unix.IFNAMSIZ + 8 + 4
)

var guardKeyType = nftables.MustConcatSetType(nftables.TypeIFName, nftables.TypeEtherAddr, nftables.TypeIPAddr)

// arpEthIPv4 is an ARP header's first six bytes for Ethernet and IPv4:
// htype 1, ptype 0x0800, hlen 6, plen 4; it fixes where sha and spa are.
var arpEthIPv4 = []byte{0x00, 0x01, 0x08, 0x00, 0x06, 0x04}

func (n *Net) guardTable() *nftables.Table {
	return &nftables.Table{Family: nftables.TableFamilyBridge, Name: n.tableName()}
}

func guardPorts(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: guardSet, KeyType: guardKeyType, Concatenation: true}
}

func guardRate(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: rateSet, KeyType: nftables.TypeIFName, Dynamic: true, Size: rateSetSize}
}

// portBurst is the frames a guest port may send at once beyond the rate:
// a tenth of a second's worth, and at least nft's default of 5.
func portBurst(pps uint32) uint32 { return max(pps/10, 5) }

// port is one element of the guard's set: a TAP and the source MAC and
// IPv4 address its frames may carry.
type port struct {
	tap  string
	mac  net.HardwareAddr
	addr netip.Addr
}

// portOf is the port a recorded network lease allows.
func portOf(nl *vmflowv1.NetworkLease) (port, error) {
	l, err := ParseLease(nl)
	if err != nil {
		return port{}, err
	}
	return l.port()
}

// port is the port l allows.
func (l Lease) port() (port, error) {
	mac, err := net.ParseMAC(l.MAC)
	if err != nil || len(mac) != 6 {
		return port{}, fmt.Errorf("%w: lease mac %q", ErrInvalid, l.MAC)
	}
	return port{tap: l.TAP, mac: mac, addr: l.Address.Addr()}, nil
}

// key is p as the set holds it: name NUL-padded, MAC zero-padded, address.
func (p port) key() []byte {
	k := make([]byte, 0, keyLen)
	k = append(k, ifname(p.tap)...)
	k = append(k, p.mac...)
	k = append(k, 0, 0)
	a := p.addr.As4()
	return append(k, a[:]...)
}

// keyTAP is the port name a key starts with.
func keyTAP(k []byte) string {
	name, _, _ := bytes.Cut(k[:min(len(k), unix.IFNAMSIZ)], []byte{0})
	return string(name)
}

// heldPorts reads the ports of the records' held network leases, each with
// its instance. unknown names the TAPs whose lease cannot be parsed; all is
// true when a record cannot be read at all (it may lease any TAP).
func (n *Net) heldPorts() (ports map[string]port, owner map[string]string, unknown map[string]bool, all bool, err error) {
	recs, err := n.cfg.Store.List()
	bad, listed := store.Unreadable(err)
	if !listed {
		return nil, nil, nil, false, fmt.Errorf("read leases: %w", err)
	}
	ports, owner, unknown = map[string]port{}, map[string]string{}, map[string]bool{}
	for _, r := range recs {
		lease := store.Network(r)
		if !store.LeaseHeld(lease) {
			continue
		}
		p, perr := portOf(lease.GetNetwork())
		if perr != nil {
			unknown[lease.GetNetwork().GetTap()] = true
			n.cfg.Logger.Warn("network filter: lease unreadable; its TAP's element is kept as it is",
				zap.String("instance_id", r.GetId()), zap.Error(perr))
			continue
		}
		ports[p.tap], owner[p.tap] = p, r.GetId()
	}
	if len(bad) > 0 {
		n.cfg.Logger.Warn("network filter: records unreadable; elements no readable record names are kept",
			zap.Int("unreadable", len(bad)), zap.String("instance_id", bad[0].ID))
	}
	return ports, owner, unknown, len(bad) > 0, nil
}

// RebuildGuard makes the guard's table, in one transaction, hold an
// element for each held network lease: the set replaced when it differs,
// the whole table when it is missing or its chain lacks rules (only the
// count is compared; a rule edited in place stays until the table is
// replaced), so the drop counter counts across rounds. Idempotent, and what it leaves is
// what the records say, whatever a crash, a reboot or a hand left. An
// element of the old set is kept only where no readable record can tell
// (an unreadable record's TAP): its guest keeps working until the record
// is repaired.
//
// It makes the ingress chains from the same read of the records
// (rebuildIngressLocked): each held lease's TAP has its whole chain, no
// other TAP has one.
func (n *Net) RebuildGuard(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("network filter: %w", err)
	}
	n.gmu.Lock()
	defer n.gmu.Unlock()
	return n.rebuildGuardLocked()
}

func (n *Net) rebuildGuardLocked() error {
	ports, owner, unknown, all, err := n.heldPorts()
	if err != nil {
		return fmt.Errorf("network filter: %w", err)
	}
	// One fails without holding up the other: each judges on its own.
	return errors.Join(n.rebuildSetLocked(ports, owner, unknown, all), n.rebuildIngressLocked(ports, owner, unknown, all))
}

// rebuildSetLocked is RebuildGuard's bridge table.
func (n *Net) rebuildSetLocked(ports map[string]port, owner map[string]string, unknown map[string]bool, all bool) error {
	c, err := n.nft()
	if err != nil {
		return fmt.Errorf("network filter: %w", err)
	}
	t := n.guardTable()
	// A missing table (first start, after a reboot) has no elements; one
	// that cannot be read is replaced, unless an unreadable lease may
	// have its element there.
	old, lerr := c.GetSetElements(guardPorts(t))
	if lerr != nil && (all || len(unknown) > 0) {
		if _, terr := c.ListTableOfFamily(t.Name, t.Family); terr == nil {
			return fmt.Errorf("network filter: %w: and table bridge %s unreadable: %w", ErrRecordsUnreadable, t.Name, lerr)
		}
	}
	want := map[string]bool{}
	var elems []nftables.SetElement
	for _, p := range ports {
		want[string(p.key())] = true
		elems = append(elems, nftables.SetElement{Key: p.key()})
	}
	for _, e := range old {
		tap := keyTAP(e.Key)
		if _, leased := ports[tap]; want[string(e.Key)] || leased || !(all || unknown[tap]) {
			continue
		}
		want[string(e.Key)] = true
		elems = append(elems, nftables.SetElement{Key: e.Key})
	}
	had := map[string]bool{}
	for _, e := range old {
		had[string(e.Key)] = true
	}
	malformed := slices.ContainsFunc(old, func(e nftables.SetElement) bool { return len(e.Key) != keyLen })
	switch {
	case lerr != nil || malformed || !n.guardIntact(c, t):
		n.guardRuleset(c, t, elems)
	case len(had) == len(want) && !slices.ContainsFunc(elems, func(e nftables.SetElement) bool { return !had[string(e.Key)] }):
		return nil
	default:
		// One transaction: no frame sees the set empty.
		set := guardPorts(t)
		c.FlushSet(set)
		if len(elems) > 0 {
			if err := c.SetAddElements(set, elems); err != nil {
				return fmt.Errorf("network filter: %w", err)
			}
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("network filter table bridge %s: %w", t.Name, err)
	}
	for _, e := range old {
		if !want[string(e.Key)] {
			n.cfg.Logger.Info("network filter element removed: no held lease names it", zap.String("tap", keyTAP(e.Key)))
		}
	}
	for tap, p := range ports {
		if !had[string(p.key())] {
			n.logPort("network filter element added", owner[tap], p)
		}
	}
	return nil
}

// guardRuleset queues, on c, table t replaced whole: the ports set with
// elems and the guard chain.
func (n *Net) guardRuleset(c *nftables.Conn, t *nftables.Table, elems []nftables.SetElement) {
	// Adding an existing table is no error; deleting it then empties it.
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	set, rate := guardPorts(t), guardRate(t)
	// AddSet fails only on a malformed set; c.Flush reports what it queued.
	_ = c.AddSet(set, elems)
	_ = c.AddSet(rate, nil)
	accept := nftables.ChainPolicyAccept
	ch := c.AddChain(&nftables.Chain{Name: guardChain, Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRef(guardPriority), Policy: &accept})
	for _, r := range guardRules(set, rate, n.cfg.PortPPS) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: r.exprs, UserData: userdata.AppendString(nil, userdata.TypeComment, r.comment)})
	}
}

// guardRule is one rule of the guard chain and its comment (what `nft
// list` shows; the counters are told apart, and the chain checked, by it).
type guardRule struct {
	comment string
	exprs   []expr.Any
}

// guardRules are the guard chain's rules, in order, for ports and rate
// limit sets and pps frames a second per port.
func guardRules(set, rate *nftables.Set, pps uint32) []guardRule {
	lookup := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: regName},
		&expr.Payload{DestRegister: regMAC, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
	}
	inSet := &expr.Lookup{SourceRegister: regName, SetName: set.Name, SetID: set.ID}
	return []guardRule{
		// Frames of a port that is no guest's: not judged. Every
		// TAPPrefix port of the namespace is judged, whatever its bridge,
		// as reconcile owns every such TAP; meta ibrname would need
		// nft_meta_bridge, which not every kernel has.
		{"vmflow: ports that are no guest's are not judged", []expr.Any{
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte(TAPPrefix)},
			&expr.Verdict{Kind: expr.VerdictAccept},
		}},
		// iifname . limit over pps: add @rate { iifname limit rate over
		// pps/second burst b packets } counter drop. First, so a flood
		// of spoofed frames costs no more than the rest. The rate is in
		// the comment: a changed --net-port-pps makes the chain not
		// intact, and the table is made again with it.
		{fmt.Sprintf("%s%d frames/s (burst %d) from one guest port: dropped", commentRate, pps, portBurst(pps)), []expr.Any{
			&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
			&expr.Dynset{SrcRegKey: 1, SetName: rate.Name, SetID: rate.ID, Operation: unix.NFT_DYNSET_OP_ADD,
				Exprs: []expr.Any{&expr.Limit{Type: expr.LimitTypePkts, Rate: uint64(pps), Unit: expr.LimitTimeSecond, Over: true, Burst: portBurst(pps)}}},
			&expr.Counter{},
			&expr.Verdict{Kind: expr.VerdictDrop},
		}},
		// IPv4: iifname . ether saddr . ip saddr @ports accept
		{"vmflow: IPv4 from the lease's MAC and address", slices.Concat(etherTypeIs(unix.ETH_P_IP), lookup, []expr.Any{
			&expr.Payload{DestRegister: regAddr, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			inSet,
			&expr.Verdict{Kind: expr.VerdictAccept},
		})},
		// ARP: the sender's MAC must be the frame's source, and both the
		// lease's: iifname . ether saddr . arp spa @ports and
		// iifname . arp sha . arp spa @ports.
		{"vmflow: ARP as the lease's MAC and address", slices.Concat(etherTypeIs(unix.ETH_P_ARP), []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 0, Len: 6},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: arpEthIPv4},
		}, lookup, []expr.Any{
			&expr.Payload{DestRegister: regAddr, Base: expr.PayloadBaseNetworkHeader, Offset: 14, Len: 4},
			inSet,
			&expr.Payload{DestRegister: regMAC, Base: expr.PayloadBaseNetworkHeader, Offset: 8, Len: 6},
			inSet,
			&expr.Verdict{Kind: expr.VerdictAccept},
		})},
		// Everything else from a guest's port, counted.
		{commentSpoofed, []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: expr.VerdictDrop}}},
	}
}

// guardIntact reports whether table t's guard chain has its rules, as
// their comments say (a table an older agent made has none), and its rate
// set is there: then a rebuild changes only the set, and the drop rules'
// counters keep counting.
func (n *Net) guardIntact(c *nftables.Conn, t *nftables.Table) bool {
	rules, err := c.GetRules(t, &nftables.Chain{Name: guardChain, Table: t})
	if err != nil {
		return false
	}
	want := guardRules(guardPorts(t), guardRate(t), n.cfg.PortPPS)
	if len(rules) != len(want) {
		return false
	}
	for i, r := range rules {
		if got, _ := userdata.GetString(r.UserData, userdata.TypeComment); got != want[i].comment {
			return false
		}
	}
	_, err = c.GetSetByName(t, rateSet)
	return err == nil
}

func etherType(t uint16) *expr.Cmp {
	return &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{byte(t >> 8), byte(t)}}
}

// etherTypeIs matches frames of ethertype t.
func etherTypeIs(t uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 12, Len: 2},
		etherType(t),
	}
}

// guardPort makes p instance id's element in the guard's set, the only one
// of its TAP: an element of an earlier lease on the same address (left by a
// crash) goes in the same transaction. Without a readable table it rebuilds
// the whole table, which holds p as p's lease is already recorded.
func (n *Net) guardPort(id string, p port) error {
	n.gmu.Lock()
	defer n.gmu.Unlock()
	c, set, old, err := n.readPorts()
	if c == nil {
		return err
	}
	if err != nil {
		n.cfg.Logger.Info("network filter table unreadable; rebuilt", zap.String("instance_id", id), zap.Error(err))
		return n.rebuildGuardLocked()
	}
	var stale []nftables.SetElement
	have := false
	for _, e := range old {
		switch {
		case bytes.Equal(e.Key, p.key()):
			have = true
		case keyTAP(e.Key) == p.tap:
			stale = append(stale, nftables.SetElement{Key: e.Key})
		}
	}
	if have && len(stale) == 0 {
		return nil
	}
	if err := changePorts(c, set, []nftables.SetElement{{Key: p.key()}}, stale); err != nil {
		return fmt.Errorf("network filter: add %s: %w", p.tap, err)
	}
	n.logPort("network filter element added", id, p)
	return nil
}

// unguardPort removes the released lease nl's own element from the guard's
// set, and only it, and its own ingress chain: once the release is
// recorded the address is free, and the next lease of it (the same TAP
// name, another MAC) may already have added its element and made its
// chain.
func (n *Net) unguardPort(id string, nl *vmflowv1.NetworkLease) error {
	p, err := portOf(nl)
	if err != nil {
		return fmt.Errorf("network filter: %w", err)
	}
	n.gmu.Lock()
	defer n.gmu.Unlock()
	return errors.Join(n.unguardSetLocked(id, p), n.unIngressLocked(id, p))
}

// unguardSetLocked is unguardPort's bridge set. Under gmu.
func (n *Net) unguardSetLocked(id string, p port) error {
	c, set, old, err := n.readPorts()
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(old, func(e nftables.SetElement) bool { return bytes.Equal(e.Key, p.key()) }) {
		return nil
	}
	if err := changePorts(c, set, nil, []nftables.SetElement{{Key: p.key()}}); err != nil {
		return fmt.Errorf("network filter: remove %s: %w", p.tap, err)
	}
	n.logPort("network filter element removed", id, p)
	return nil
}

// readPorts reads the guard's set on a new connection; c is nil when there
// is none, set and c are good when only the read failed.
func (n *Net) readPorts() (c *nftables.Conn, set *nftables.Set, old []nftables.SetElement, err error) {
	if c, err = n.nft(); err != nil {
		return nil, nil, nil, fmt.Errorf("network filter: %w", err)
	}
	set = guardPorts(n.guardTable())
	if old, err = c.GetSetElements(set); err != nil {
		return c, set, nil, fmt.Errorf("network filter: list table bridge %s: %w", set.Table.Name, err)
	}
	return c, set, old, nil
}

// FilterPorts lists, sorted, the anti-spoofing filter's elements, each as
// FilterPort writes it (what `nft list set bridge vmflow_<bridge> ports`
// shows); reading only.
func (n *Net) FilterPorts() ([]string, error) {
	_, _, elems, err := n.readPorts()
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(elems))
	for _, e := range elems {
		if len(e.Key) != keyLen {
			out = append(out, fmt.Sprintf("malformed %x", e.Key))
			continue
		}
		out = append(out, FilterPort(keyTAP(e.Key), net.HardwareAddr(e.Key[unix.IFNAMSIZ:unix.IFNAMSIZ+6]).String(),
			netip.AddrFrom4([4]byte(e.Key[keyLen-4:]))))
	}
	slices.Sort(out)
	return out, nil
}

// FilterPort is one element of the filter as FilterPorts lists it.
func FilterPort(tap, mac string, addr netip.Addr) string {
	return tap + " " + mac + " " + addr.String()
}

// FilterDrops are the guard's drop counters: the bridge table's and the
// ingress table's together.
type FilterDrops struct {
	// Spoofed: frames from guest TAPs that were not their lease's (a
	// spoofed source MAC, at the TAP's ingress; a spoofed source address,
	// IPv6, another ethertype, at the bridge).
	Spoofed uint64
	// OverRate: frames over a guest port's frames-a-second limit.
	OverRate uint64
}

// FilterDropped is how many frames from guest TAPs the filter's drop rules
// have counted since their tables were made (a reboot or a replaced table
// starts them again from 0, as a Prometheus counter's reset; a port's
// ingress chain going keeps its counts, which are the table's).
func (n *Net) FilterDropped() (FilterDrops, error) {
	var d FilterDrops
	c, err := n.nft()
	if err != nil {
		return d, fmt.Errorf("network filter: %w", err)
	}
	if d.Spoofed, d.OverRate, err = n.ingressCounts(c); err != nil {
		return d, fmt.Errorf("network filter: %w", err)
	}
	t := n.guardTable()
	rules, err := c.GetRules(t, &nftables.Chain{Name: guardChain, Table: t})
	if err != nil {
		return d, fmt.Errorf("network filter: list chain bridge %s %s: %w", t.Name, guardChain, err)
	}
	for _, r := range rules {
		comment, _ := userdata.GetString(r.UserData, userdata.TypeComment)
		for _, e := range r.Exprs {
			ctr, ok := e.(*expr.Counter)
			switch {
			case !ok:
			case comment == commentSpoofed:
				d.Spoofed += ctr.Packets
			case strings.HasPrefix(comment, commentRate):
				d.OverRate += ctr.Packets
			}
		}
	}
	return d, nil
}

// changePorts adds add to and deletes del from set, in one transaction.
func changePorts(c *nftables.Conn, set *nftables.Set, add, del []nftables.SetElement) error {
	if len(add) > 0 {
		if err := c.SetAddElements(set, add); err != nil {
			return err
		}
	}
	if len(del) > 0 {
		if err := c.SetDeleteElements(set, del); err != nil {
			return err
		}
	}
	return c.Flush()
}

func (n *Net) logPort(msg, id string, p port) {
	n.cfg.Logger.Info(msg, zap.String("instance_id", id), zap.String("tap", p.tap),
		zap.String("mac", p.mac.String()), zap.String("address", p.addr.String()))
}
