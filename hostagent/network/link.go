package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/vishvananda/netlink"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// tapFlags are the TAP's flags, at creation and at every open: no packet
// information header, and the virtio-net header QEMU's virtio-net uses.
const tapFlags = unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR

func notFound(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf)
}

// EnsureBridge makes the host's bridge when it is missing, gives it the
// gateway address when it has not (after a reboot, or a hand removed it)
// and brings it up. Its MAC is pinned to the host's (bridgeMAC): a bridge
// whose MAC no one set takes the lowest of its ports' and changes as
// guests come and go, and every change flushes the gateway's neighbour
// entries and leaves the guests' ARP entries for the gateway stale. Its
// learned FDB entries are bounded (fdbMaxLearned) where the kernel can.
// Idempotent; a link of that name that is no bridge is refused
// (ErrMisconfigured), never changed.
func (n *Net) EnsureBridge(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("ensure bridge %s: %w", n.cfg.Bridge, err)
	}
	var mac net.HardwareAddr
	switch key, err := n.MACKey(ctx); {
	case errors.Is(err, ErrMisconfigured):
		return fmt.Errorf("ensure bridge %s: %w", n.cfg.Bridge, err)
	case err != nil:
		// No key yet and none can be made (the state disk is full): the
		// pin is a second line, and the running guests' ports matter
		// more. The bridge serves with the kernel's MAC; the next round
		// that can make the key pins it and announces the gateway. (The
		// host model found a bridge loss on a full disk left every port
		// off the bridge.)
		n.cfg.Logger.Warn("bridge MAC not pinned: no MAC key; pinned at the next launch or scan round that can make it",
			zap.String("bridge", n.cfg.Bridge), zap.Error(err))
	default:
		mac = bridgeMAC(key, n.cfg.Bridge)
	}
	br, err := n.h.LinkByName(n.cfg.Bridge)
	if notFound(err) {
		la := netlink.NewLinkAttrs()
		la.Name = n.cfg.Bridge
		// Made with its MAC: the kernel marks an address given at
		// creation as set, and never replaces it with a port's.
		la.HardwareAddr = mac
		if err := n.h.LinkAdd(&netlink.Bridge{LinkAttrs: la}); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("create bridge %s: %w", n.cfg.Bridge, err)
		}
		n.cfg.Logger.Info("bridge created", zap.String("bridge", n.cfg.Bridge), zap.String("mac", mac.String()))
		br, err = n.h.LinkByName(n.cfg.Bridge)
	}
	if err != nil {
		return fmt.Errorf("ensure bridge %s: %w", n.cfg.Bridge, err)
	}
	if br.Type() != "bridge" {
		return fmt.Errorf("%w: link %s is a %s, not a bridge", ErrMisconfigured, n.cfg.Bridge, br.Type())
	}
	// Set only when it differs: setting a MAC, even the same, flushes
	// the bridge's neighbour entries (measured here). A bridge with the
	// host's MAC got it from here: netlink does not say whether an
	// address is set or the kernel's choice, and the kernel's (random,
	// or a port's) is the host's only by a 2^-40 chance.
	pinned := false
	if old := br.Attrs().HardwareAddr; mac != nil && old.String() != mac.String() {
		if err := n.h.LinkSetHardwareAddr(br, mac); err != nil {
			return fmt.Errorf("ensure bridge %s: pin its MAC %s: %w", n.cfg.Bridge, mac, err)
		}
		pinned = true
		n.cfg.Logger.Warn("bridge MAC pinned; the gateway announced at it", zap.String("bridge", n.cfg.Bridge),
			zap.String("was", old.String()), zap.String("mac", mac.String()))
	}
	// The bound is a second line (no guest port learns): a bridge that
	// cannot be given it still serves, and the next ensure tries again.
	if err := n.bridgeSettings(br); err != nil {
		n.cfg.Logger.Warn("bridge FDB bound not set; tried again at the next launch or scan round", zap.String("bridge", n.cfg.Bridge), zap.Error(err))
	}
	want := &net.IPNet{IP: n.gateway.AsSlice(), Mask: net.CIDRMask(n.cfg.Subnet.Bits(), 32)}
	addrs, err := n.h.AddrList(br, netlink.FAMILY_V4)
	if err != nil {
		return fmt.Errorf("ensure bridge %s: list addresses: %w", n.cfg.Bridge, err)
	}
	have := false
	for _, a := range addrs {
		if a.IPNet != nil && a.IPNet.String() == want.String() {
			have = true
		}
	}
	if !have {
		if err := n.h.AddrAdd(br, &netlink.Addr{IPNet: want}); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("ensure bridge %s: add %s: %w", n.cfg.Bridge, want, err)
		}
		n.cfg.Logger.Info("bridge address added", zap.String("bridge", n.cfg.Bridge), zap.String("address", want.String()))
	}
	if err := n.h.LinkSetUp(br); err != nil {
		return fmt.Errorf("ensure bridge %s: up: %w", n.cfg.Bridge, err)
	}
	if pinned {
		if err := n.announceGateway(br.Attrs().Index, mac); err != nil {
			n.cfg.Logger.Warn("gateway not announced; guests re-learn its MAC when their ARP entries expire",
				zap.String("bridge", n.cfg.Bridge), zap.Error(err))
		}
	}
	return nil
}

// announceGateway sends a gratuitous ARP for the gateway's address at mac
// out of the bridge (index): guests whose ARP entry holds the bridge's old
// MAC (the first agent of a release that pins it, a bridge a hand made)
// take the new one at once, where they would otherwise lose the gateway
// until the entry failed its unicast probes (the old MAC is no longer the
// bridge's, so the host drops what is sent to it). The bridge's own
// broadcast reaches every guest port whatever its flood flags.
func (n *Net) announceGateway(index int, mac net.HardwareAddr) error {
	gw := n.gateway.As4()
	f := append(append([]byte{}, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff), mac...)
	f = append(f, byte(unix.ETH_P_ARP>>8), byte(unix.ETH_P_ARP&0xff))
	f = append(f, arpEthIPv4...)
	f = append(f, 0x00, 0x01) // a request: who has the gateway, told by the gateway
	f = append(append(f, mac...), gw[:]...)
	f = append(append(f, make([]byte, 6)...), gw[:]...)
	return n.inNS(func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("announce gateway: %w", err)
		}
		defer unix.Close(fd)
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Ifindex: index}); err != nil {
			return fmt.Errorf("announce gateway: %w", err)
		}
		if _, err := unix.Write(fd, f); err != nil {
			return fmt.Errorf("announce gateway: %w", err)
		}
		return nil
	})
}

// tap is the link named name when it is a TAP; (nil, nil) when there is no
// link of that name; ErrNotOurs when it is something else.
func (n *Net) tap(name string) (*netlink.Tuntap, error) {
	link, err := n.h.LinkByName(name)
	if notFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("look up %s: %w", name, err)
	}
	t, ok := link.(*netlink.Tuntap)
	if !ok || t.Mode != netlink.TUNTAP_MODE_TAP {
		return nil, fmt.Errorf("%w: %s is a %s", ErrNotOurs, name, link.Type())
	}
	return t, nil
}

// ensureTAP makes the TAP of lease l when it is missing (owned by uid, so
// no other uid can attach to it), or again when it is owned by another uid
// (a lease's TAP whose VM was given a new uid); then makes it a guest's
// port of the bridge (setupPort). Idempotent.
func (n *Net) ensureTAP(l Lease, uid uint32) error {
	name := l.TAP
	mac, err := net.ParseMAC(l.MAC)
	if err != nil || len(mac) != 6 {
		return fmt.Errorf("%w: lease mac %q", ErrInvalid, l.MAC)
	}
	t, err := n.tap(name)
	if err != nil {
		return err
	}
	if t != nil && t.Owner != uid {
		if err := n.h.LinkDel(t); err != nil && !notFound(err) {
			return fmt.Errorf("remove %s of uid %d: %w", name, t.Owner, err)
		}
		t = nil
	}
	if t == nil {
		la := netlink.NewLinkAttrs()
		la.Name = name
		t = &netlink.Tuntap{LinkAttrs: la, Mode: netlink.TUNTAP_MODE_TAP, Flags: netlink.TUNTAP_NO_PI | netlink.TUNTAP_VNET_HDR,
			Owner: uid, Group: uid}
		// TUNSETIFF makes the TAP in the namespace of the thread that
		// opened /dev/net/tun, whatever netlink socket the handle has.
		if err := n.inNS(func() error { return n.h.LinkAdd(t) }); err != nil {
			return fmt.Errorf("create %s: %w", name, err)
		}
	}
	br, err := n.h.LinkByName(n.cfg.Bridge)
	if err != nil {
		return fmt.Errorf("attach %s: bridge %s: %w", name, n.cfg.Bridge, err)
	}
	return n.setupPort(t, br, mac)
}

// setupPort makes t a guest's port of the bridge br for the guest NIC's
// mac, and up: the one port setup, for a launch and for the reconcile
// that puts a detached or altered port back. First t gets its ingress
// chain (ingress.go), so no frame from it reaches the bridge unjudged,
// not even a link-local one: only mac's frames, at most the port's rate.
// The port is isolated from the other ports (guests reach the gateway,
// not each other), learns nothing and is flooded nothing
// (guestPortFlags), and the bridge knows mac on it by a static, sticky FDB
// entry, which leaving the bridge removes (so it is made again here each
// time).
func (n *Net) setupPort(t netlink.Link, br netlink.Link, mac net.HardwareAddr) error {
	name := t.Attrs().Name
	if err := n.ingressPort(name, mac); err != nil {
		return err
	}
	if err := n.h.LinkSetMasterByIndex(t, br.Attrs().Index); err != nil {
		return fmt.Errorf("attach %s to %s: %w", name, n.cfg.Bridge, err)
	}
	// A frame in the instant between the two steps may be learnt, at
	// worst: no guest's entry moves (they are sticky), and learnt ones
	// age out.
	if err := n.setGuestPort(t.Attrs().Index); err != nil {
		return fmt.Errorf("guest port settings of %s: %w", name, err)
	}
	if err := n.h.NeighSet(guestFDB(t.Attrs().Index, mac)); err != nil {
		return fmt.Errorf("fdb entry of %s on %s: %w", mac, name, err)
	}
	if err := n.h.LinkSetUp(t); err != nil {
		return fmt.Errorf("up %s: %w", name, err)
	}
	return nil
}

// openTAP opens a queue of the TAP name for QEMU. The TAP is single
// queue: while another descriptor is attached (a QEMU still holding it)
// the kernel refuses with EBUSY.
func (n *Net) openTAP(name string) (*os.File, error) {
	var f *os.File
	err := n.inNS(func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(name)
		if err != nil {
			unix.Close(fd)
			return fmt.Errorf("%w: tap name %q: %w", ErrInvalid, name, err)
		}
		ifr.SetUint16(tapFlags)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("attach to %s: %w", name, err)
		}
		f = os.NewFile(uintptr(fd), "/dev/net/tun:"+name)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("open tap: %w", err)
	}
	return f, nil
}

// removeTAP removes the TAP name; one already gone is success, a link of
// that name that is no TAP is left alone (ErrNotOurs).
func (n *Net) removeTAP(name string) error {
	t, err := n.tap(name)
	if err != nil || t == nil {
		return err
	}
	if err := n.h.LinkDel(t); err != nil && !notFound(err) {
		return fmt.Errorf("remove %s: %w", name, err)
	}
	return nil
}

// taps lists the TAPs whose names carry TAPPrefix.
func (n *Net) taps() ([]string, error) {
	links, err := n.h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	var out []string
	for _, l := range links {
		if t, ok := l.(*netlink.Tuntap); ok && t.Mode == netlink.TUNTAP_MODE_TAP && strings.HasPrefix(t.Attrs().Name, TAPPrefix) {
			out = append(out, t.Attrs().Name)
		}
	}
	return out, nil
}
