package guest_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"vmflow/guest"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/proc/proctest"
)

// The test network: a bridge holding the gateway address and one TAP, in a
// namespace the test makes. The names are distinctive so the check that
// the machine's own namespace never got them means something.
const (
	netnsPrefix = "vmflow-guesttest-"
	testBridge  = "vmgbr0"
	testTAP     = "vmgtap0"
	guestAddr   = "10.88.0.2"
	gatewayAddr = "10.88.0.1"
	subnetBits  = 24
	netUpWait   = 90 * time.Second // TCG, on a machine shared with other tests
)

var netnsSeq atomic.Int64

// testNetns is a network namespace made for one test and deleted after it.
type testNetns struct{ name string }

func ipCmd(t *testing.T, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	require.NoError(t, err, "ip %s: %s", strings.Join(args, " "), out)
}

// newNetns makes a namespace with lo up and a bridge holding the gateway's
// address; it skips where namespaces, iproute2 or TUN are missing.
func newNetns(t *testing.T) *testNetns {
	t.Helper()
	proctest.RequiresRoot(t, "network namespaces and TAPs need CAP_SYS_ADMIN and CAP_NET_ADMIN")
	proctest.RequiresBinary(t, "ip", "apt-get install iproute2")
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skipf("needs /dev/net/tun for a TAP: %v", err)
	}
	removeStaleNetns(t)
	n := &testNetns{name: fmt.Sprintf("%s%d-%d", netnsPrefix, os.Getpid(), netnsSeq.Add(1))}
	ipCmd(t, "netns", "add", n.name)
	t.Cleanup(func() { ipCmd(t, "netns", "del", n.name) })
	ipCmd(t, "-n", n.name, "link", "set", "lo", "up")
	ipCmd(t, "-n", n.name, "link", "add", testBridge, "type", "bridge")
	ipCmd(t, "-n", n.name, "addr", "add", fmt.Sprintf("%s/%d", gatewayAddr, subnetBits), "dev", testBridge)
	ipCmd(t, "-n", n.name, "link", "set", testBridge, "up")
	return n
}

// removeStaleNetns deletes the namespaces of test processes that died
// before their cleanup ran (a kill -9): the name carries the pid.
func removeStaleNetns(t *testing.T) {
	entries, _ := os.ReadDir("/run/netns")
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), netnsPrefix)
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(strings.SplitN(rest, "-", 2)[0])
		if err != nil || pid == os.Getpid() {
			continue
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, os.ErrNotExist) {
			ipCmd(t, "netns", "del", e.Name())
		}
	}
}

// do runs f on an OS thread moved into the namespace. The thread is never
// unlocked, so the Go runtime ends it afterwards: no thread of this test
// process is left in the namespace, and none of the others ever enters it.
// Sockets made inside f stay in the namespace wherever they are used later.
func (n *testNetns) do(f func() error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		ns, err := os.Open("/run/netns/" + n.name)
		if err != nil {
			done <- err
			return
		}
		err = unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET)
		ns.Close()
		if err != nil {
			done <- fmt.Errorf("setns %s: %w", n.name, err)
			return
		}
		done <- f()
	}()
	return <-done
}

// tap makes a TAP in the namespace (TUNSETIFF creates it in the calling
// thread's namespace), attaches it to the bridge and returns its
// descriptor: the TAP lives as long as a descriptor of it is open, so it
// goes with the QEMU that holds it.
func (n *testNetns) tap(t *testing.T) *os.File {
	t.Helper()
	var f *os.File
	require.NoError(t, n.do(func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(testTAP)
		if err != nil {
			unix.Close(fd)
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("TUNSETIFF %s: %w", testTAP, err)
		}
		f = os.NewFile(uintptr(fd), "/dev/net/tun")
		return nil
	}))
	t.Cleanup(func() { f.Close() })
	ipCmd(t, "-n", n.name, "link", "set", testTAP, "master", testBridge, "up")
	return f
}

// probe connects to the guest's probe port from inside the namespace and
// returns its reply to request.
func (n *testNetns) probe(t *testing.T, request string) string {
	t.Helper()
	var reply string
	require.NoError(t, n.do(func() error {
		c, err := net.DialTimeout("tcp4", net.JoinHostPort(guestAddr, strconv.Itoa(guest.ProbePort)), 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		// The guest's own dial is bounded by ~3 s; TCG adds its slowness.
		reply, err = guest.Probe(c, request, time.Now().Add(20*time.Second))
		return err
	}))
	return reply
}

// unservedPort is a port on the gateway's address nothing listens on.
func (n *testNetns) unservedPort(t *testing.T) netip.AddrPort {
	t.Helper()
	var ln net.Listener
	require.NoError(t, n.do(func() (err error) {
		ln, err = net.Listen("tcp4", net.JoinHostPort(gatewayAddr, "0"))
		return err
	}))
	free := addrPort(ln)
	require.NoError(t, ln.Close())
	return free
}

// TestGuestNetwork boots the real guest (TCG) with a TAP in a namespace of
// its own: the guest configures eth0 from the kernel parameter, answers on
// the probe port from inside the namespace, reaches a listener on the
// gateway, fails to reach what nobody serves, and still powers off on the
// button.
func TestGuestNetwork(t *testing.T) {
	for _, tc := range []struct{ machine, nic, cmdline string }{
		// q35's NIC has an option ROM QEMU would load from its data dir:
		// romfile= empty leaves it out (direct kernel boot needs none).
		{machine: "q35", nic: "virtio-net-pci,romfile="},
		// microvm's NIC sits on virtio-mmio, described by its ACPI tables.
		// Under TCG its kernel finds no timer to calibrate the TSC against
		// (no PIT or HPET in hardware-reduced ACPI) and stops early in boot;
		// telling it the TSC's rate lets it go on. KVM tells it by itself.
		{machine: "microvm", nic: "virtio-net-device", cmdline: " tsc_early_khz=2000000"},
	} {
		t.Run(tc.machine, func(t *testing.T) {
			ns := newNetns(t)
			tap := ns.tap(t)
			g := bootGuest(t, bootOptions{
				Machine: tc.machine,
				Cmdline: guest.KernelCmdline + tc.cmdline + " " + guest.NetConfig{
					Addr:    netip.PrefixFrom(netip.MustParseAddr(guestAddr), subnetBits),
					Gateway: netip.MustParseAddr(gatewayAddr),
				}.Param(),
				// ExtraFiles[0] is fd 3 in QEMU.
				Args:  []string{"-netdev", "tap,fd=3,id=net0", "-device", tc.nic + ",netdev=net0,mac=52:54:00:88:00:02"},
				Files: []*os.File{tap},
			})
			g.waitLine(t, fmt.Sprintf("%s%s/%d", guest.NetUpPrefix, guestAddr, subnetBits), netUpWait)
			netUp := time.Since(g.spawned)
			g.waitLine(t, guest.UpLine, upTimeout)
			up := time.Since(g.spawned) // an upper bound when "up" came first

			listener, peers := nettest.Listen(t, ns.name, netip.MustParseAddr(gatewayAddr))
			reply := ns.probe(t, guest.DialRequest(listener))
			assert.Equal(t, guest.ProbeOK, reply, "the guest reaches the gateway%s", g.diag())
			select {
			case peer := <-peers:
				assert.Equal(t, guestAddr, peer, "the connection came from the guest's address")
			case <-time.After(10 * time.Second):
				t.Error("the listener on the gateway accepted nothing")
			}

			reply = ns.probe(t, guest.DialRequest(ns.unservedPort(t)))
			assert.True(t, strings.HasPrefix(reply, guest.ProbeFail) && strings.Contains(reply, "refused"),
				"a port nobody serves on the gateway: %q", reply)
			reply = ns.probe(t, guest.DialRequest(netip.MustParseAddrPort("10.88.0.99:80")))
			assert.True(t, strings.HasPrefix(reply, guest.ProbeFail), "an address nobody has: %q", reply)
			reply = ns.probe(t, guest.DialRequest(netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), guest.ProbePort)))
			assert.Equal(t, guest.ProbeOK, reply, "the guest's lo is up: it reaches its own probe port")
			reply = ns.probe(t, "hello")
			assert.Equal(t, guest.ProbeFail+"unknown command", reply)

			g.powerOff(t)
			out := g.serial()
			assert.NotContains(t, out, guest.NetErrorPrefix)
			assert.NotContains(t, out, guest.FatalPrefix)
			for _, name := range []string{testBridge, testTAP} {
				_, err := net.InterfaceByName(name)
				assert.Error(t, err, "%s must exist only inside the test's namespace", name)
			}
			t.Logf("%s: spawn→%q %s (→%q ≤%s)", tc.machine, guest.NetUpPrefix+guestAddr, netUp.Round(time.Millisecond),
				guest.UpLine, up.Round(time.Millisecond))
		})
	}
}

// addrPort is ln's address in the 4-byte form the probe takes.
func addrPort(ln net.Listener) netip.AddrPort {
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
