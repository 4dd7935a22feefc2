package network_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

type env struct {
	ns  string
	h   *netlink.Handle
	st  *store.Store
	net *network.Net
	now *clock
}

var subnet = netip.MustParsePrefix("10.88.0.0/24")

func newEnv(t *testing.T, p netip.Prefix) *env {
	t.Helper()
	return newEnvConfig(t, p, nil)
}

// newEnvConfig is newEnv with its network's configuration changed by mod.
func newEnvConfig(t *testing.T, p netip.Prefix, mod func(*network.Config)) *env {
	t.Helper()
	e := &env{ns: nettest.Namespace(t), now: &clock{t: time.Now()}}
	e.h = nettest.Handle(t, e.ns)
	state := t.TempDir()
	var err error
	e.st, err = store.New(state)
	require.NoError(t, err)
	cfg := network.Config{Subnet: p, NetNS: e.ns, Store: e.st, OrphanGrace: time.Minute, Now: e.now.Now}
	if mod != nil {
		mod(&cfg)
	}
	e.net, err = network.New(cfg)
	require.NoError(t, err)
	t.Cleanup(e.net.Close)
	return e
}

func (e *env) record(t *testing.T, id string) {
	t.Helper()
	_, err := e.st.Create(context.Background(), &vmflowv1.InstanceRecord{Id: id, Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "q35", Network: "default"}})
	require.NoError(t, err)
}

// attach runs AttachLocked as a launch does, closing the descriptor.
func (e *env) attach(t *testing.T, id string, uid uint32) (network.Attachment, error) {
	t.Helper()
	l, err := e.st.Lock(context.Background(), id)
	require.NoError(t, err)
	defer l.Unlock()
	a, err := e.net.AttachLocked(context.Background(), l, uid)
	if err == nil {
		require.NotNil(t, a.TAP)
		a.TAP.Close()
	}
	return a, err
}

// attached records id, attaches it and returns its TAP's name.
func (e *env) attached(t *testing.T, id string, uid uint32) string {
	t.Helper()
	e.record(t, id)
	_, err := e.attach(t, id, uid)
	require.NoError(t, err)
	return e.lease(t, id).GetNetwork().GetTap()
}

func (e *env) beginDelete(t *testing.T, id string) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, e.st.MarkManualStop(ctx, id))
	_, err := e.st.Transition(ctx, id, vmflowv1.InstanceState_INSTANCE_STATE_DELETING)
	require.NoError(t, err)
}

func (e *env) lease(t *testing.T, id string) *vmflowv1.Lease {
	t.Helper()
	rec, err := e.st.Get(id)
	require.NoError(t, err)
	return store.Network(rec)
}

// macKey is the host's MAC key (made on first use).
func (e *env) macKey(t *testing.T) []byte {
	t.Helper()
	key, err := e.net.MACKey(context.Background())
	require.NoError(t, err)
	return key
}

func (e *env) link(t *testing.T, name string) netlink.Link {
	t.Helper()
	return nettest.Link(t, e.h, name)
}

func TestEnsureBridgeIdempotentAndReaddsAddress(t *testing.T) {
	e := newEnv(t, subnet)
	ctx := context.Background()
	require.NoError(t, e.net.EnsureBridge(ctx))
	require.NoError(t, e.net.EnsureBridge(ctx), "a second ensure changes nothing and succeeds")
	br := e.link(t, network.DefaultBridge)
	require.NotNil(t, br)
	assert.Equal(t, "bridge", br.Type())
	gw := "10.88.0.1/24"
	addrs := func() []string {
		as, err := e.h.AddrList(br, netlink.FAMILY_V4)
		require.NoError(t, err)
		var out []string
		for _, a := range as {
			out = append(out, a.IPNet.String())
		}
		return out
	}
	assert.Equal(t, []string{gw}, addrs())
	// What a reboot (or a hand) leaves: the bridge without its address.
	a, err := netlink.ParseAddr(gw)
	require.NoError(t, err)
	require.NoError(t, e.h.AddrDel(br, a))
	require.Empty(t, addrs())
	require.NoError(t, e.net.EnsureBridge(ctx))
	assert.Equal(t, []string{gw}, addrs(), "the gateway address is added again")
	// And a reboot that left nothing: the bridge is made again.
	require.NoError(t, e.h.LinkDel(br))
	require.NoError(t, e.net.EnsureBridge(ctx))
	br = e.link(t, network.DefaultBridge)
	require.NotNil(t, br)
	assert.Equal(t, []string{gw}, addrs())
}

func TestEnsureBridgeRefusesAnotherKindOfLink(t *testing.T) {
	e := newEnv(t, subnet)
	nettest.MakeTAP(t, e.ns, network.DefaultBridge, false)
	err := e.net.EnsureBridge(context.Background())
	require.ErrorIs(t, err, network.ErrMisconfigured)
	assert.Equal(t, "tuntap", e.link(t, network.DefaultBridge).Type(), "left as it was")
}

func TestConfigRefusals(t *testing.T) {
	st, err := store.New(t.TempDir())
	require.NoError(t, err)
	for _, c := range []network.Config{
		{Subnet: netip.MustParsePrefix("10.88.0.1/24"), Store: st},       // host bits
		{Subnet: netip.MustParsePrefix("fd00::/64"), Store: st},          // not IPv4
		{Subnet: netip.MustParsePrefix("10.88.0.0/31"), Store: st},       // no room
		{Subnet: subnet, Store: st, Bridge: "a-name-too-long-for-linux"}, // > 15
		{Subnet: subnet, Store: st, Bridge: network.TAPPrefix + "0"},     // reconcile's prefix
		{Subnet: subnet, Store: st, NetNS: "../x"},
		{Subnet: subnet},
	} {
		_, err := network.New(c)
		assert.ErrorIs(t, err, network.ErrInvalid, "%+v", c)
	}
}

func TestAttachWritesLeaseThenTAP(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	const uid = 1_900_000_007
	a, err := e.attach(t, "vm-a", uid)
	require.NoError(t, err)
	assert.Equal(t, "10.88.0.2/24", a.Address.String(), "the first guest address: the gateway has .1")
	assert.Equal(t, "10.88.0.1", a.Gateway.String())
	assert.Equal(t, network.MAC(e.macKey(t), "vm-a", 0), a.MAC)
	hw, err := net.ParseMAC(a.MAC)
	require.NoError(t, err)
	assert.Equal(t, byte(0x02), hw[0]&0x03, "locally administered, unicast")

	l := e.lease(t, "vm-a")
	require.NotNil(t, l)
	assert.Equal(t, vmflowv1.ClaimPhase_CLAIM_PHASE_ACTIVE, l.GetPhase())
	nl := l.GetNetwork()
	assert.Equal(t, "10.88.0.2/24", nl.GetAddress())
	assert.Equal(t, network.TAPName(a.Address.Addr()), nl.GetTap())
	assert.Equal(t, network.DefaultBridge, nl.GetBridge())

	tap := e.link(t, nl.GetTap())
	require.NotNil(t, tap, "the TAP exists in the namespace")
	tt, ok := tap.(*netlink.Tuntap)
	require.True(t, ok)
	assert.Equal(t, uint32(uid), tt.Owner, "owned by the VM's uid")
	br := e.link(t, network.DefaultBridge)
	assert.Equal(t, br.Attrs().Index, tap.Attrs().MasterIndex, "a port of the bridge")
	assert.NotZero(t, tap.Attrs().Flags&net.FlagUp)
	pi, err := e.h.LinkGetProtinfo(tap)
	require.NoError(t, err)
	assert.True(t, pi.Isolated, "isolated from the other ports")

	// A second attach (a restart) keeps name, MAC and address.
	b, err := e.attach(t, "vm-a", uid)
	require.NoError(t, err)
	assert.Equal(t, a.Address, b.Address)
	assert.Equal(t, a.MAC, b.MAC)
	// Nothing of it is in the machine's own namespace.
	_, err = netlink.LinkByName(nl.GetTap())
	assert.Error(t, err, "the TAP is only in the test's namespace")
}

func TestAttachOpensTheTAPOnce(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	l, err := e.st.Lock(context.Background(), "vm-a")
	require.NoError(t, err)
	defer l.Unlock()
	a, err := e.net.AttachLocked(context.Background(), l, 1_900_000_001)
	require.NoError(t, err)
	defer a.TAP.Close()
	// A QEMU still holding the TAP: a second queue is refused.
	_, err = e.net.AttachLocked(context.Background(), l, 1_900_000_001)
	require.ErrorIs(t, err, unix.EBUSY)
}

func TestAttachAfterRebootMakesTheSameTAP(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	a, err := e.attach(t, "vm-a", 1_900_000_001)
	require.NoError(t, err)
	name := e.lease(t, "vm-a").GetNetwork().GetTap()
	// A reboot: the namespace loses every link the agent made.
	require.NoError(t, e.h.LinkDel(e.link(t, name)))
	require.NoError(t, e.h.LinkDel(e.link(t, network.DefaultBridge)))
	b, err := e.attach(t, "vm-a", 1_900_000_001)
	require.NoError(t, err)
	assert.Equal(t, a, b, "same address, gateway and MAC")
	require.NotNil(t, e.link(t, name), "the TAP is back under its name")
}

func TestAttachRemakesTAPOfAnotherUID(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	_, err := e.attach(t, "vm-a", 1_900_000_001)
	require.NoError(t, err)
	_, err = e.attach(t, "vm-a", 1_900_000_002)
	require.NoError(t, err)
	tt := e.link(t, e.lease(t, "vm-a").GetNetwork().GetTap()).(*netlink.Tuntap)
	assert.Equal(t, uint32(1_900_000_002), tt.Owner)
}

func TestAddressNamedByOneRecord(t *testing.T) {
	// A /29: .1 the gateway, .2-.6 guests, .7 broadcast.
	e := newEnv(t, netip.MustParsePrefix("10.88.0.0/29"))
	seen := map[string]string{}
	for i := range 5 {
		id := fmt.Sprintf("vm-%d", i)
		e.record(t, id)
		a, err := e.attach(t, id, uint32(1_900_000_000+i))
		require.NoError(t, err)
		assert.NotContains(t, seen, a.Address.String(), "given to %s already", seen[a.Address.String()])
		seen[a.Address.String()] = id
	}
	assert.Len(t, seen, 5)
	e.record(t, "vm-full")
	_, err := e.attach(t, "vm-full", 1_900_000_009)
	require.ErrorIs(t, err, network.ErrNoAddress)
	assert.Equal(t, errdefs.NoCapacity, errdefs.ClassOf(err))
	assert.Nil(t, e.lease(t, "vm-full"), "nothing written for a refusal")

	// vm-2's address comes back only once its release is recorded.
	e.beginDelete(t, "vm-2")
	released, name, err := e.net.Release(context.Background(), "vm-2")
	require.NoError(t, err)
	assert.True(t, released)
	assert.Equal(t, "10.88.0.4/29", name)
	a, err := e.attach(t, "vm-full", 1_900_000_009)
	require.NoError(t, err)
	assert.Equal(t, "10.88.0.4/29", a.Address.String(), "the freed address is the lowest free one")
}

func TestConcurrentAttachesNeverShareAnAddress(t *testing.T) {
	e := newEnv(t, subnet)
	const n = 6
	for i := range n {
		e.record(t, fmt.Sprintf("vm-%d", i))
	}
	var wg sync.WaitGroup
	addrs := make([]string, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			var a network.Attachment
			a, errs[i] = e.attach(t, fmt.Sprintf("vm-%d", i), uint32(1_900_000_000+i))
			addrs[i] = a.Address.String()
		})
	}
	wg.Wait()
	seen := map[string]bool{}
	for i := range n {
		require.NoError(t, errs[i])
		assert.False(t, seen[addrs[i]], "%s given twice", addrs[i])
		seen[addrs[i]] = true
	}
}

func TestPlacementRefusedWhileARecordIsUnreadable(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	e.record(t, "vm-torn")
	p, err := e.st.Paths("vm-torn")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte("{torn"), 0o600))
	_, err = e.attach(t, "vm-a", 1_900_000_001)
	require.ErrorIs(t, err, network.ErrRecordsUnreadable)
	assert.Nil(t, e.lease(t, "vm-a"))
}

func TestReleaseRefusedWhileVMMayLive(t *testing.T) {
	e := newEnv(t, subnet)
	tap := e.attached(t, "vm-a", 1_900_000_001)
	self, err := proc.ReadIdentity(os.Getpid())
	require.NoError(t, err)
	_, err = e.st.Update(context.Background(), "vm-a", func(r *vmflowv1.InstanceRecord) error {
		r.Process = &vmflowv1.ProcessIdentity{Pid: int32(self.PID), StartTime: self.StartTime, BootId: self.BootID}
		return nil
	})
	require.NoError(t, err)
	e.beginDelete(t, "vm-a")
	released, _, err := e.net.Release(context.Background(), "vm-a")
	require.ErrorIs(t, err, network.ErrVMAlive)
	assert.False(t, released)
	l := e.lease(t, "vm-a")
	assert.True(t, store.LeaseHeld(l), "the lease is kept")
	assert.Equal(t, uint32(1), l.GetReleaseAttempts())
	rec, err := e.st.Get("vm-a")
	require.NoError(t, err)
	assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED, rec.GetState(), "visible like a failed release")
	assert.NotNil(t, e.link(t, tap), "the TAP is kept")
}

func TestReleaseRemovesTAPThenFreesAddressIdempotently(t *testing.T) {
	e := newEnv(t, subnet)
	tap := e.attached(t, "vm-a", 1_900_000_001)
	e.beginDelete(t, "vm-a")
	// A release that died after removing the TAP: the lease says
	// releasing, the TAP is gone.
	_, err := e.st.Apply(context.Background(), "vm-a", store.LeaseReleasing(store.LeaseName(e.lease(t, "vm-a"))))
	require.NoError(t, err)
	require.NoError(t, e.h.LinkDel(e.link(t, tap)))
	released, _, err := e.net.Release(context.Background(), "vm-a")
	require.NoError(t, err)
	assert.True(t, released)
	assert.False(t, store.LeaseHeld(e.lease(t, "vm-a")))
	assert.Nil(t, e.link(t, tap))
	released, _, err = e.net.Release(context.Background(), "vm-a")
	require.NoError(t, err)
	assert.False(t, released, "nothing held any more")
	require.NoError(t, e.st.Delete(context.Background(), "vm-a"), "the store lets the record go")
}

func TestReleaseLeavesALinkThatIsNoTAP(t *testing.T) {
	e := newEnv(t, subnet)
	tap := e.attached(t, "vm-a", 1_900_000_001)
	require.NoError(t, e.h.LinkDel(e.link(t, tap)))
	nettest.MakeTAP(t, e.ns, tap, true)
	e.beginDelete(t, "vm-a")
	_, _, err := e.net.Release(context.Background(), "vm-a")
	require.ErrorIs(t, err, network.ErrNotOurs)
	assert.True(t, store.LeaseHeld(e.lease(t, "vm-a")))
	assert.NotNil(t, e.link(t, tap), "a TUN of the TAP's name is left alone")
}

func TestDetachRemovesTAPKeepsLease(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	a, err := e.attach(t, "vm-a", 1_900_000_001)
	require.NoError(t, err)
	tap := e.lease(t, "vm-a").GetNetwork().GetTap()
	l, err := e.st.Lock(context.Background(), "vm-a")
	require.NoError(t, err)
	require.NoError(t, e.net.DetachLocked(l))
	require.NoError(t, e.net.DetachLocked(l), "idempotent")
	require.NoError(t, l.Unlock())
	assert.Nil(t, e.link(t, tap))
	assert.True(t, store.LeaseHeld(e.lease(t, "vm-a")), "the address stays the instance's")
	b, err := e.attach(t, "vm-a", 1_900_000_001)
	require.NoError(t, err)
	assert.Equal(t, a.Address, b.Address)
}

func TestReconcileRemovesOnlyUnleasedTAPsPastGrace(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	_, err := e.attach(t, "vm-a", 1_900_000_001)
	require.NoError(t, err)
	leased := e.lease(t, "vm-a").GetNetwork().GetTap()
	stray := network.TAPName(netip.MustParseAddr("10.88.0.200"))
	other := "othertap0"
	nettest.MakeTAP(t, e.ns, stray, false)
	nettest.MakeTAP(t, e.ns, other, false)
	ctx := context.Background()
	round, err := e.net.ReconcileTAPs(ctx)
	require.NoError(t, err)
	assert.Empty(t, round.Removed, "first sighting: within the grace")
	e.now.Advance(2 * time.Minute)
	round, err = e.net.ReconcileTAPs(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{stray}, round.Removed)
	assert.Nil(t, e.link(t, stray))
	assert.NotNil(t, e.link(t, leased), "a leased TAP stays")
	assert.NotNil(t, e.link(t, other), "a TAP without the prefix is not the agent's")
}

func TestTAPNameFitsIFNAMSIZ(t *testing.T) {
	n := network.TAPName(netip.MustParseAddr("255.255.255.254"))
	assert.LessOrEqual(t, len(n), unix.IFNAMSIZ-1)
	assert.Equal(t, "vmtapfffffffe", n)
	key := []byte("a key")
	assert.NotEqual(t, network.MAC(key, "a", 0), network.MAC(key, "a", 1))
	assert.Equal(t, network.MAC(key, "a", 0), network.MAC(key, "a", 0))
}
