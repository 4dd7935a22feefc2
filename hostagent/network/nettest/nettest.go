// Package nettest gives tests a network namespace of their own, so that
// nothing they make (a bridge, an address, a TAP) reaches the machine's.
package nettest

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

var seq atomic.Int64

// Namespace creates a network namespace for tb (iproute2's `ip netns add`)
// and deletes it at cleanup; it skips the test where one cannot be made.
func Namespace(tb testing.TB) string {
	tb.Helper()
	if _, err := exec.LookPath("ip"); err != nil {
		tb.Skip("needs iproute2's ip to create a network namespace")
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		tb.Skip("needs /dev/net/tun")
	}
	sweepStale()
	name := fmt.Sprintf("vmflow-t%d-%d", os.Getpid(), seq.Add(1))
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		tb.Skipf("needs CAP_SYS_ADMIN to create a network namespace: %v: %s", err, out)
	}
	tb.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
			tb.Errorf("ip netns del %s: %v: %s", name, err, out)
		}
	})
	return name
}

// Handle is a netlink handle in namespace ns, for a test's checks.
func Handle(tb testing.TB, ns string) *netlink.Handle {
	tb.Helper()
	h, err := netns.GetFromName(ns)
	require.NoError(tb, err)
	tb.Cleanup(func() { h.Close() })
	nh, err := netlink.NewHandleAt(h)
	require.NoError(tb, err)
	tb.Cleanup(nh.Close)
	return nh
}

// Link is the link named name in h's namespace, nil when there is none.
func Link(tb testing.TB, h *netlink.Handle, name string) netlink.Link {
	tb.Helper()
	l, err := h.LinkByName(name)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		return nil
	}
	require.NoError(tb, err)
	return l
}

// In runs fn on an OS thread inside namespace ns (what acts in the calling
// thread's namespace: opening /dev/net/tun, a socket). The thread goes back
// before it is unlocked; if it cannot, it stays locked and dies with its
// goroutine.
func In(tb testing.TB, ns string, fn func() error) error {
	tb.Helper()
	target, err := netns.GetFromName(ns)
	require.NoError(tb, err)
	defer target.Close()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			done <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			done <- err
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			done <- err
			return
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}

// MakeTAP makes a persistent TAP (or, with tun, a TUN) named name in ns, as
// a hand or another tool would.
func MakeTAP(tb testing.TB, ns, name string, tun bool) {
	tb.Helper()
	require.NoError(tb, In(tb, ns, func() error {
		la := netlink.NewLinkAttrs()
		la.Name = name
		mode := netlink.TUNTAP_MODE_TAP
		if tun {
			mode = netlink.TUNTAP_MODE_TUN
		}
		return netlink.LinkAdd(&netlink.Tuntap{LinkAttrs: la, Mode: mode, Flags: netlink.TUNTAP_NO_PI})
	}))
}

// Listen opens a TCP listener on addr (port 0: any) inside namespace ns,
// closed at cleanup, and reports each peer's address; every connection is
// closed as soon as it is accepted. It returns the listener's address.
func Listen(tb testing.TB, ns string, addr netip.Addr) (netip.AddrPort, <-chan string) {
	tb.Helper()
	var ln net.Listener
	require.NoError(tb, In(tb, ns, func() (err error) {
		// The socket is made in the namespace and stays there.
		ln, err = net.Listen("tcp4", net.JoinHostPort(addr.String(), "0"))
		return err
	}))
	tb.Cleanup(func() { ln.Close() })
	peers := make(chan string, 8)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			select {
			case peers <- c.RemoteAddr().(*net.TCPAddr).IP.String():
			default:
			}
			c.Close()
		}
	}()
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), peers
}

// sweepStale deletes the namespaces of test processes that died before
// their cleanup ran (a panic, a kill), so a crashed run leaves nothing
// behind for long. A namespace of a live process is left alone.
func sweepStale() {
	ents, err := os.ReadDir("/run/netns")
	if err != nil {
		return
	}
	for _, e := range ents {
		var pid, n int
		if _, err := fmt.Sscanf(e.Name(), "vmflow-t%d-%d", &pid, &n); err != nil || pid <= 0 {
			continue
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
			continue
		}
		_ = exec.Command("ip", "netns", "del", e.Name()).Run()
	}
}
