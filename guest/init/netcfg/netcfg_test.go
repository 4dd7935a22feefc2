package netcfg

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/guest"
	"vmflow/hostagent/proc/proctest"
)

// rtattrs decodes the attributes after a fixed header of n bytes.
func rtattrs(t *testing.T, b []byte, n int) map[uint16][]byte {
	t.Helper()
	require.GreaterOrEqual(t, len(b), n)
	out := map[uint16][]byte{}
	rest := b[n:]
	for len(rest) > 0 {
		require.GreaterOrEqual(t, len(rest), unix.SizeofRtAttr)
		l := int(binary.NativeEndian.Uint16(rest))
		typ := binary.NativeEndian.Uint16(rest[2:])
		require.GreaterOrEqual(t, l, unix.SizeofRtAttr)
		require.LessOrEqual(t, l, len(rest))
		out[typ] = rest[unix.SizeofRtAttr:l]
		adv := (l + unix.NLA_ALIGNTO - 1) &^ (unix.NLA_ALIGNTO - 1)
		require.LessOrEqual(t, adv, len(rest), "attribute padded past the end")
		rest = rest[adv:]
	}
	return out
}

func TestMessages(t *testing.T) {
	b := linkUp(7)
	require.Len(t, b, unix.SizeofIfInfomsg)
	assert.Equal(t, uint32(7), binary.NativeEndian.Uint32(b[4:]))
	assert.Equal(t, uint32(unix.IFF_UP), binary.NativeEndian.Uint32(b[8:]))
	assert.Equal(t, uint32(unix.IFF_UP), binary.NativeEndian.Uint32(b[12:]), "changes only IFF_UP")

	b = addAddr(3, netip.MustParsePrefix("10.88.0.2/24"))
	assert.Equal(t, []byte{unix.AF_INET, 24, 0, unix.RT_SCOPE_UNIVERSE}, b[:4])
	assert.Equal(t, uint32(3), binary.NativeEndian.Uint32(b[4:]))
	attrs := rtattrs(t, b, unix.SizeofIfAddrmsg)
	assert.Equal(t, []byte{10, 88, 0, 2}, attrs[unix.IFA_LOCAL])
	assert.Equal(t, []byte{10, 88, 0, 2}, attrs[unix.IFA_ADDRESS])
	assert.Equal(t, []byte{10, 88, 0, 255}, attrs[unix.IFA_BROADCAST])

	b = defaultRoute(3, netip.MustParseAddr("10.88.0.1"))
	assert.Equal(t, []byte{unix.AF_INET, 0, 0, 0, unix.RT_TABLE_MAIN, unix.RTPROT_BOOT, unix.RT_SCOPE_UNIVERSE, unix.RTN_UNICAST},
		b[:8], "a unicast default route (dst_len 0) in the main table")
	attrs = rtattrs(t, b, unix.SizeofRtMsg)
	assert.Equal(t, []byte{10, 88, 0, 1}, attrs[unix.RTA_GATEWAY])
	assert.Equal(t, uint32(3), binary.NativeEndian.Uint32(attrs[unix.RTA_OIF]))

	odd := attr(nil, 1, []byte{1, 2, 3, 4, 5})
	assert.Len(t, odd, 12, "padded to 4")
}

func TestAckFor(t *testing.T) {
	msg := func(seq uint32, typ uint16, errno int32) []byte {
		b := make([]byte, unix.SizeofNlMsghdr+4+unix.SizeofNlMsghdr)
		binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
		binary.NativeEndian.PutUint16(b[4:], typ)
		binary.NativeEndian.PutUint32(b[8:], seq)
		binary.NativeEndian.PutUint32(b[unix.SizeofNlMsghdr:], uint32(errno))
		return b
	}
	done, err := ackFor(msg(5, unix.NLMSG_ERROR, 0), 5)
	assert.True(t, done)
	assert.NoError(t, err)
	done, err = ackFor(msg(5, unix.NLMSG_ERROR, -int32(unix.EEXIST)), 5)
	assert.True(t, done)
	assert.ErrorIs(t, err, unix.EEXIST)
	done, _ = ackFor(msg(4, unix.NLMSG_ERROR, 0), 5)
	assert.False(t, done, "an answer to another request")
	done, _ = ackFor(msg(5, unix.NLMSG_DONE, 0), 5)
	assert.False(t, done)
	done, err = ackFor([]byte{1, 2, 3}, 5)
	assert.True(t, done)
	assert.Error(t, err)
}

// inNewNetns runs f on a goroutine whose OS thread has been moved into a
// network namespace of its own, and returns f's error; the thread is never
// unlocked, so the Go runtime discards it afterwards and the namespace goes
// with it. Nothing touches the machine's own namespace.
func inNewNetns(t *testing.T, f func() error) error {
	t.Helper()
	proctest.RequiresRoot(t, "unshare(CLONE_NEWNET) needs CAP_SYS_ADMIN")
	type result struct {
		unshare, f error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			done <- result{unshare: err}
			return
		}
		done <- result{f: f()}
	}()
	r := <-done
	if r.unshare != nil {
		t.Skipf("cannot make a network namespace: %v", r.unshare)
	}
	return r.f
}

// threadRoutes reads the IPv4 routes of the calling thread's namespace.
func threadRoutes() ([]string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/self/task/%d/net/route", syscall.Gettid()))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		out = append(out, strings.Join(strings.Fields(sc.Text()), " "))
	}
	return out, sc.Err()
}

// TestUpConfiguresLoopbackInFreshNetns runs Up against the real kernel, on
// the loopback device of a new namespace (the only interface one has, so
// it stands in for eth0 too), and reads back the link flags, the address
// and the default route.
func TestUpConfiguresLoopbackInFreshNetns(t *testing.T) {
	c := guest.NetConfig{Addr: netip.MustParsePrefix("10.99.0.2/24"), Gateway: netip.MustParseAddr("10.99.0.1")}
	var (
		upBefore, upAfter bool
		addrs             []string
		routes            []string
		second, missing   error
	)
	err := inNewNetns(t, func() error {
		ifc, err := net.InterfaceByName("lo")
		if err != nil {
			return err
		}
		upBefore = ifc.Flags&net.FlagUp != 0
		if err := Up("lo", c, 5*time.Second); err != nil {
			return err
		}
		second = Up("lo", c, 5*time.Second)
		if ifc, err = net.InterfaceByName("lo"); err != nil {
			return err
		}
		upAfter = ifc.Flags&net.FlagUp != 0
		as, err := ifc.Addrs()
		if err != nil {
			return err
		}
		for _, a := range as {
			addrs = append(addrs, a.String())
		}
		if routes, err = threadRoutes(); err != nil {
			return err
		}
		missing = Up("nosuch0", c, 100*time.Millisecond)
		return nil
	})
	require.NoError(t, err)
	assert.False(t, upBefore, "a new namespace's lo starts down")
	assert.True(t, upAfter)
	assert.NoError(t, second, "a second run replaces, not fails")
	assert.Contains(t, addrs, "10.99.0.2/24")
	// /proc/net/route: Iface Destination Gateway Flags ...; addresses in
	// hex of their memory order, so 10.99.0.1 is 0100630A.
	var dflt []string
	for _, r := range routes {
		if f := strings.Fields(r); len(f) > 3 && f[1] == "00000000" {
			dflt = append(dflt, f[0]+" "+f[2])
		}
	}
	assert.Equal(t, []string{"lo 0100630A"}, dflt, "one default route, via the gateway, on lo: %v", routes)
	assert.ErrorContains(t, missing, "no interface nosuch0")
}
