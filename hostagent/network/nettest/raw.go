package nettest

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// SYN writes, from inside ns, one TCP SYN from src to dst as a raw
// Ethernet frame out of link dev (source MAC dev's own, destination
// dstMAC), past the namespace's routing: what a guest's kernel would not
// send (a destination in 127/8) a guest's raw socket can. It reports
// whether any TCP segment from dst to src came back within wait (a SYN-ACK
// or a RST: something there answered).
func SYN(tb testing.TB, ns, dev string, dstMAC net.HardwareAddr, src, dst netip.AddrPort, wait time.Duration) (answered bool) {
	tb.Helper()
	err := In(tb, ns, func() error {
		ifi, err := net.InterfaceByName(dev)
		if err != nil {
			return err
		}
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_IP)))
		if err != nil {
			return fmt.Errorf("packet socket: %w", err)
		}
		defer unix.Close(fd)
		sa := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_IP), Ifindex: ifi.Index, Halen: 6}
		copy(sa.Addr[:], dstMAC)
		if err := unix.Bind(fd, sa); err != nil {
			return fmt.Errorf("bind packet socket: %w", err)
		}
		frame := append(append(append([]byte{}, dstMAC...), ifi.HardwareAddr...), 0x08, 0x00)
		frame = append(frame, tcpSYN(src, dst)...)
		if err := unix.Sendto(fd, frame, 0, sa); err != nil {
			return fmt.Errorf("send SYN: %w", err)
		}
		deadline := time.Now().Add(wait)
		buf := make([]byte, 2048)
		for left := time.Until(deadline); left > 0; left = time.Until(deadline) {
			tv := unix.NsecToTimeval(left.Nanoseconds())
			if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
				return err
			}
			n, _, err := unix.Recvfrom(fd, buf, 0)
			if err == unix.EAGAIN || err == unix.EINTR {
				continue
			}
			if err != nil {
				return fmt.Errorf("read: %w", err)
			}
			if tcpFrom(buf[:n], dst, src) {
				answered = true
				return nil
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("raw SYN from %s: %v", ns, err)
	}
	return answered
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// tcpSYN is an IPv4 packet holding a TCP SYN from src to dst, checksummed.
func tcpSYN(src, dst netip.AddrPort) []byte {
	s, d := src.Addr().As4(), dst.Addr().As4()
	tcp := make([]byte, 20)
	binary.BigEndian.PutUint16(tcp[0:], src.Port())
	binary.BigEndian.PutUint16(tcp[2:], dst.Port())
	binary.BigEndian.PutUint32(tcp[4:], 0x1000)
	tcp[12] = 5 << 4 // header length: 5 words
	tcp[13] = 0x02   // SYN
	binary.BigEndian.PutUint16(tcp[14:], 64240)
	pseudo := append(append(append([]byte{}, s[:]...), d[:]...), 0, unix.IPPROTO_TCP, 0, byte(len(tcp)))
	binary.BigEndian.PutUint16(tcp[16:], checksum(append(pseudo, tcp...)))
	ip := make([]byte, 20)
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(len(ip)+len(tcp)))
	ip[8] = 64 // TTL
	ip[9] = unix.IPPROTO_TCP
	copy(ip[12:], s[:])
	copy(ip[16:], d[:])
	binary.BigEndian.PutUint16(ip[10:], checksum(ip))
	return append(ip, tcp...)
}

// tcpFrom says whether frame is an Ethernet frame holding a TCP segment
// from src to dst.
func tcpFrom(frame []byte, src, dst netip.AddrPort) bool {
	if len(frame) < 14+20+4 || binary.BigEndian.Uint16(frame[12:]) != unix.ETH_P_IP {
		return false
	}
	ip := frame[14:]
	hl := int(ip[0]&0x0f) * 4
	if ip[9] != unix.IPPROTO_TCP || len(ip) < hl+4 {
		return false
	}
	s, d := src.Addr().As4(), dst.Addr().As4()
	return [4]byte(ip[12:16]) == s && [4]byte(ip[16:20]) == d &&
		binary.BigEndian.Uint16(ip[hl:]) == src.Port() && binary.BigEndian.Uint16(ip[hl+2:]) == dst.Port()
}

// checksum is the Internet checksum of b.
func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
