// Package netcfg is the guest init's network setup: it configures an
// interface with the address the agent put on the kernel command line
// (guest.NetParam, parsed by guest.NetConfigFromCmdline) over rtnetlink —
// link up, the address, a default route via the gateway — since Debian's
// cloud kernel has no IP_PNP and the initramfs has no ip(8).
package netcfg

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"vmflow/guest"
)

// Up configures the interface named ifname: waits (up to timeout) for it to
// exist — virtio_net registers it while probing, which may trail the
// module load — then sets it up, adds the address and the default route.
// It sets the loopback device up first (the kernel then gives it
// 127.0.0.1): nothing else in the initramfs does. Each step replaces what
// is there, so running it again is harmless.
func Up(ifname string, c guest.NetConfig, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	nl, err := dialNetlink(deadline)
	if err != nil {
		return err
	}
	defer nl.close()
	lo, err := net.InterfaceByName(loopback)
	if err != nil {
		return fmt.Errorf("no interface %s: %w", loopback, err)
	}
	if err := nl.request(unix.RTM_NEWLINK, 0, linkUp(uint32(lo.Index))); err != nil {
		return fmt.Errorf("set %s up: %w", loopback, err)
	}
	ifc, err := waitInterface(ifname, deadline)
	if err != nil {
		return err
	}
	idx := uint32(ifc.Index)
	if err := nl.request(unix.RTM_NEWLINK, 0, linkUp(idx)); err != nil {
		return fmt.Errorf("set %s up: %w", ifname, err)
	}
	if err := nl.request(unix.RTM_NEWADDR, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, addAddr(idx, c.Addr)); err != nil {
		return fmt.Errorf("add %s to %s: %w", c.Addr, ifname, err)
	}
	if err := nl.request(unix.RTM_NEWROUTE, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, defaultRoute(idx, c.Gateway)); err != nil {
		return fmt.Errorf("default route via %s on %s: %w", c.Gateway, ifname, err)
	}
	return nil
}

const loopback = "lo"

func waitInterface(name string, deadline time.Time) (*net.Interface, error) {
	for {
		ifc, err := net.InterfaceByName(name)
		if err == nil {
			return ifc, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no interface %s: %w", name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// The message bodies, in the kernel's layout (native byte order): the
// fixed header of the message type, then attributes.

func linkUp(idx uint32) []byte {
	b := make([]byte, unix.SizeofIfInfomsg)
	b[0] = unix.AF_UNSPEC
	binary.NativeEndian.PutUint32(b[4:], idx)
	binary.NativeEndian.PutUint32(b[8:], unix.IFF_UP)  // ifi_flags
	binary.NativeEndian.PutUint32(b[12:], unix.IFF_UP) // ifi_change: only this flag
	return b
}

func addAddr(idx uint32, p netip.Prefix) []byte {
	b := make([]byte, unix.SizeofIfAddrmsg)
	b[0] = unix.AF_INET
	b[1] = byte(p.Bits())
	b[3] = unix.RT_SCOPE_UNIVERSE
	binary.NativeEndian.PutUint32(b[4:], idx)
	a := p.Addr().As4()
	brd := guest.Broadcast(p).As4()
	b = attr(b, unix.IFA_LOCAL, a[:])
	b = attr(b, unix.IFA_ADDRESS, a[:])
	return attr(b, unix.IFA_BROADCAST, brd[:])
}

func defaultRoute(idx uint32, gw netip.Addr) []byte {
	b := make([]byte, unix.SizeofRtMsg)
	b[0] = unix.AF_INET // rtm_family; rtm_dst_len 0: the default route
	b[4] = unix.RT_TABLE_MAIN
	b[5] = unix.RTPROT_BOOT
	b[6] = unix.RT_SCOPE_UNIVERSE
	b[7] = unix.RTN_UNICAST
	g := gw.As4()
	b = attr(b, unix.RTA_GATEWAY, g[:])
	oif := make([]byte, 4)
	binary.NativeEndian.PutUint32(oif, idx)
	return attr(b, unix.RTA_OIF, oif)
}

// attr appends a netlink attribute (struct rtattr + data, padded to 4).
func attr(b []byte, typ uint16, data []byte) []byte {
	h := make([]byte, unix.SizeofRtAttr)
	binary.NativeEndian.PutUint16(h[0:], uint16(unix.SizeofRtAttr+len(data)))
	binary.NativeEndian.PutUint16(h[2:], typ)
	b = append(b, h...)
	b = append(b, data...)
	for len(b)%unix.NLA_ALIGNTO != 0 {
		b = append(b, 0)
	}
	return b
}

// netlinkConn is an rtnetlink socket whose every send and receive is
// bounded by the deadline given to dialNetlink.
type netlinkConn struct {
	fd  int
	seq uint32
}

func dialNetlink(deadline time.Time) (*netlinkConn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink socket: %w", err)
	}
	nl := &netlinkConn{fd: fd}
	left := time.Until(deadline)
	if left < time.Second {
		left = time.Second // the interface wait used the budget: still bound each call
	}
	tv := unix.NsecToTimeval(left.Nanoseconds())
	for _, opt := range []int{unix.SO_RCVTIMEO, unix.SO_SNDTIMEO} {
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, opt, &tv); err != nil {
			nl.close()
			return nil, fmt.Errorf("netlink socket timeout: %w", err)
		}
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		nl.close()
		return nil, fmt.Errorf("netlink bind: %w", err)
	}
	return nl, nil
}

func (nl *netlinkConn) close() { _ = unix.Close(nl.fd) }

// request sends one message asking for an acknowledgement and returns the
// kernel's answer: nil, or the errno it reported.
func (nl *netlinkConn) request(typ, flags uint16, body []byte) error {
	nl.seq++
	msg := make([]byte, unix.SizeofNlMsghdr, unix.SizeofNlMsghdr+len(body))
	binary.NativeEndian.PutUint32(msg[0:], uint32(unix.SizeofNlMsghdr+len(body)))
	binary.NativeEndian.PutUint16(msg[4:], typ)
	binary.NativeEndian.PutUint16(msg[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK|flags)
	binary.NativeEndian.PutUint32(msg[8:], nl.seq)
	msg = append(msg, body...)
	if err := unix.Sendto(nl.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("netlink send: %w", err)
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := unix.Recvfrom(nl.fd, buf, 0)
		if err != nil {
			return fmt.Errorf("netlink receive: %w", err)
		}
		done, err := ackFor(buf[:n], nl.seq)
		if done {
			return err
		}
	}
}

// ackFor looks in received bytes for the NLMSG_ERROR answering seq (an
// errno of 0 is the acknowledgement); done is false when they hold none.
func ackFor(b []byte, seq uint32) (done bool, err error) {
	for len(b) > 0 {
		if len(b) < unix.SizeofNlMsghdr {
			return true, errors.New("netlink answer: truncated header")
		}
		l := int(binary.NativeEndian.Uint32(b[0:]))
		typ := binary.NativeEndian.Uint16(b[4:])
		mseq := binary.NativeEndian.Uint32(b[8:])
		if l < unix.SizeofNlMsghdr || l > len(b) {
			return true, fmt.Errorf("netlink answer: message length %d of %d bytes", l, len(b))
		}
		if mseq == seq && typ == unix.NLMSG_ERROR {
			data := b[unix.SizeofNlMsghdr:l]
			if len(data) < 4 {
				return true, errors.New("netlink answer: short error message")
			}
			if errno := int32(binary.NativeEndian.Uint32(data)); errno != 0 {
				return true, unix.Errno(-errno)
			}
			return true, nil
		}
		next := (l + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1)
		if next >= len(b) {
			break
		}
		b = b[next:]
	}
	return false, nil
}
