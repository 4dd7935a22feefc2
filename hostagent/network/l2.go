package network

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"time"

	mnl "github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Layer 2 (issue 32, findings 1-3): what the bridge itself does with the
// guests' frames, besides the guard's judgement of their sources. The
// bridge learns a frame's source MAC before any bridge-family hook sees
// it, and link-local frames (01:80:c2:00:00:0x) never pass the prerouting
// hook at all; so a guest could move a neighbour's FDB entry to its own
// port with one LLDP frame, and fill the FDB with random sources. And a
// bridge floods a frame whose destination it has not learnt (or has
// forgotten, after 300 s of quiet) out of every port. So every guest's
// port learns nothing and is sent no flooded frame, and the bridge knows
// each guest's MAC from its lease: a static, sticky FDB entry on its port.

// fdbMaxLearned bounds the FDB entries the bridge learns
// (IFLA_BR_FDB_MAX_LEARNED, Linux 6.8). No guest port learns, so the bound
// matters only for a port a hand adds; on an older kernel there is none,
// and learning off on every guest port is what keeps guests from filling
// the FDB.
const fdbMaxLearned = 256

// guestPortFlags are the bridge-port settings of every guest's TAP, set in
// one request (no frame sees half of them):
//   - isolated: no frame passes between two guests' ports;
//   - learning off: the bridge learns no source MAC from a guest (the
//     guest's own entry is static, made from its lease);
//   - unicast flood off: a frame to a MAC the bridge has no entry for
//     reaches no guest (the bridge's own too: measured here);
//   - multicast and broadcast flood off: a port that is not a guest's (a
//     hand's) floods nothing to guests. The bridge's own broadcasts and
//     multicasts, the gateway's ARP requests, are not subject to these
//     flags (the kernel's br_flood exempts what the bridge device sends;
//     measured here: the gateway's ARP and a TCP dial to the guest work);
//     guests' own already stop at the isolation.
var guestPortFlags = []struct {
	attr uint16
	on   bool
}{
	{unix.IFLA_BRPORT_ISOLATED, true},
	{unix.IFLA_BRPORT_LEARNING, false},
	{unix.IFLA_BRPORT_UNICAST_FLOOD, false},
	{unix.IFLA_BRPORT_MCAST_FLOOD, false},
	{unix.IFLA_BRPORT_BCAST_FLOOD, false},
}

// rtnl is a raw rtnetlink connection in the host network's namespace, for
// what the netlink library cannot say (port flood flags, the bridge's FDB
// bound), with a deadline on its requests.
func (n *Net) rtnl() (*mnl.Conn, error) {
	cfg := &mnl.Config{}
	if n.ns.IsOpen() {
		cfg.NetNS = int(n.ns)
	}
	c, err := mnl.Dial(unix.NETLINK_ROUTE, cfg)
	if err != nil {
		return nil, fmt.Errorf("rtnetlink: %w", err)
	}
	if err := c.SetDeadline(time.Now().Add(netlinkTimeout)); err != nil {
		c.Close()
		return nil, fmt.Errorf("rtnetlink: %w", err)
	}
	return c, nil
}

// ifinfomsg is a struct ifinfomsg of family for the link index.
func ifinfomsg(family uint8, index int) []byte {
	b := make([]byte, unix.SizeofIfInfomsg)
	b[0] = family
	binary.NativeEndian.PutUint32(b[4:], uint32(index))
	return b
}

// setGuestPort gives the bridge port index guestPortFlags.
func (n *Net) setGuestPort(index int) error {
	ae := mnl.NewAttributeEncoder()
	ae.Nested(unix.IFLA_PROTINFO, func(nae *mnl.AttributeEncoder) error {
		for _, f := range guestPortFlags {
			nae.Uint8(f.attr, boolByte(f.on))
		}
		return nil
	})
	attrs, err := ae.Encode()
	if err != nil {
		return err
	}
	c, err := n.rtnl()
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.Execute(mnl.Message{
		Header: mnl.Header{Type: unix.RTM_SETLINK, Flags: mnl.Request | mnl.Acknowledge},
		Data:   append(ifinfomsg(unix.AF_BRIDGE, index), attrs...),
	})
	return err
}

func boolByte(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}

// guestFDB is the static FDB entry of a guest's MAC on its port: frames
// to the guest go out of its port only, ageing never forgets it (so a
// quiet guest's frames are not flooded), and sticky: not even a port that
// learns can move it (the kernel moves a static entry that is not sticky
// when it learns the MAC elsewhere: measured here).
func guestFDB(port int, mac net.HardwareAddr) *netlink.Neigh {
	return &netlink.Neigh{LinkIndex: port, Family: unix.AF_BRIDGE, State: unix.NUD_NOARP,
		Flags: netlink.NTF_MASTER | netlink.NTF_STICKY, HardwareAddr: mac}
}

// bridgePorts is what the kernel says of the bridge's ports and FDB, read
// once for a reconcile round.
type bridgePorts struct {
	flags map[int]map[uint16]uint8 // port index -> IFLA_BRPORT_* -> value
	fdb   map[int][]netlink.Neigh  // port index -> its entries in a bridge's FDB
}

// readBridgePorts reads every bridge port's settings and the bridge FDB of
// the namespace.
func (n *Net) readBridgePorts() (*bridgePorts, error) {
	ps := &bridgePorts{flags: map[int]map[uint16]uint8{}, fdb: map[int][]netlink.Neigh{}}
	c, err := n.rtnl()
	if err != nil {
		return ps, err
	}
	defer c.Close()
	msgs, err := c.Execute(mnl.Message{
		Header: mnl.Header{Type: unix.RTM_GETLINK, Flags: mnl.Request | mnl.Dump},
		Data:   ifinfomsg(unix.AF_BRIDGE, 0),
	})
	if err != nil {
		return ps, fmt.Errorf("list bridge ports: %w", err)
	}
	for _, m := range msgs {
		if len(m.Data) < unix.SizeofIfInfomsg {
			continue
		}
		index := int(binary.NativeEndian.Uint32(m.Data[4:8]))
		ad, err := mnl.NewAttributeDecoder(m.Data[unix.SizeofIfInfomsg:])
		if err != nil {
			return ps, fmt.Errorf("list bridge ports: %w", err)
		}
		for ad.Next() {
			if ad.Type() != unix.IFLA_PROTINFO {
				continue
			}
			f := map[uint16]uint8{}
			ad.Nested(func(nad *mnl.AttributeDecoder) error {
				for nad.Next() {
					if len(nad.Bytes()) == 1 {
						f[nad.Type()] = nad.Uint8()
					}
				}
				return nil
			})
			ps.flags[index] = f
		}
		if err := ad.Err(); err != nil {
			return ps, fmt.Errorf("list bridge ports: %w", err)
		}
	}
	fdb, err := n.h.NeighList(0, unix.AF_BRIDGE)
	if err != nil {
		return ps, fmt.Errorf("list bridge fdb: %w", err)
	}
	for _, e := range fdb {
		// A dump marks a bridge's entries by NDA_MASTER, not NTF_MASTER;
		// the rest are the ports' own (self) addresses.
		if e.MasterIndex != 0 {
			ps.fdb[e.LinkIndex] = append(ps.fdb[e.LinkIndex], e)
		}
	}
	return ps, nil
}

// whole reports whether port index has every guest port setting and the
// static, sticky FDB entry of mac in bridge br's FDB.
func (ps *bridgePorts) whole(index int, mac net.HardwareAddr, br int) bool {
	f, ok := ps.flags[index]
	if !ok {
		return false
	}
	for _, g := range guestPortFlags {
		if v, ok := f[g.attr]; !ok || v != boolByte(g.on) {
			return false
		}
	}
	for _, e := range ps.fdb[index] {
		if e.MasterIndex == br && bytes.Equal(e.HardwareAddr, mac) && e.Flags&netlink.NTF_STICKY != 0 && e.State&unix.NUD_NOARP != 0 {
			return true
		}
	}
	return false
}

// bridgeSettings makes the bridge's FDB bound fdbMaxLearned where the
// kernel knows it (Linux 6.8); it says once, per Net, when it does not.
func (n *Net) bridgeSettings(br netlink.Link) error {
	c, err := n.rtnl()
	if err != nil {
		return err
	}
	defer c.Close()
	msgs, err := c.Execute(mnl.Message{
		Header: mnl.Header{Type: unix.RTM_GETLINK, Flags: mnl.Request},
		Data:   ifinfomsg(unix.AF_UNSPEC, br.Attrs().Index),
	})
	if err != nil {
		return fmt.Errorf("read bridge %s: %w", n.cfg.Bridge, err)
	}
	limit, known, err := fdbMaxOf(msgs)
	if err != nil {
		return fmt.Errorf("read bridge %s: %w", n.cfg.Bridge, err)
	}
	if !known {
		n.fdbOnce.Do(func() {
			n.cfg.Logger.Info("this kernel has no bound on the bridge's learned FDB entries (fdb_max_learned, Linux 6.8); guest ports learn nothing, so guests cannot fill it",
				zap.String("bridge", n.cfg.Bridge))
		})
		return nil
	}
	if limit == fdbMaxLearned {
		return nil
	}
	ae := mnl.NewAttributeEncoder()
	ae.Nested(unix.IFLA_LINKINFO, func(li *mnl.AttributeEncoder) error {
		li.String(unix.IFLA_INFO_KIND, "bridge")
		li.Nested(unix.IFLA_INFO_DATA, func(d *mnl.AttributeEncoder) error {
			d.Uint32(unix.IFLA_BR_FDB_MAX_LEARNED, fdbMaxLearned)
			return nil
		})
		return nil
	})
	attrs, err := ae.Encode()
	if err != nil {
		return err
	}
	if _, err := c.Execute(mnl.Message{
		Header: mnl.Header{Type: unix.RTM_NEWLINK, Flags: mnl.Request | mnl.Acknowledge},
		Data:   append(ifinfomsg(unix.AF_UNSPEC, br.Attrs().Index), attrs...),
	}); err != nil {
		return fmt.Errorf("bridge %s: set fdb_max_learned: %w", n.cfg.Bridge, err)
	}
	return nil
}

// fdbMaxOf finds IFLA_BR_FDB_MAX_LEARNED in a bridge's RTM_NEWLINK; known
// is false when the kernel does not report it (before Linux 6.8).
func fdbMaxOf(msgs []mnl.Message) (limit uint32, known bool, err error) {
	if len(msgs) != 1 || len(msgs[0].Data) < unix.SizeofIfInfomsg {
		return 0, false, errors.New("unexpected answer")
	}
	ad, err := mnl.NewAttributeDecoder(msgs[0].Data[unix.SizeofIfInfomsg:])
	if err != nil {
		return 0, false, err
	}
	for ad.Next() {
		if ad.Type() != unix.IFLA_LINKINFO {
			continue
		}
		ad.Nested(func(li *mnl.AttributeDecoder) error {
			for li.Next() {
				if li.Type() != unix.IFLA_INFO_DATA {
					continue
				}
				li.Nested(func(d *mnl.AttributeDecoder) error {
					for d.Next() {
						if d.Type() == unix.IFLA_BR_FDB_MAX_LEARNED {
							limit, known = d.Uint32(), true
						}
					}
					return nil
				})
			}
			return nil
		})
	}
	return limit, known, ad.Err()
}
