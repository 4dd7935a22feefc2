package network_test

import (
	"context"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
)

// TestBridgeLossPutsLeasedTAPsBack (issue 31 case 6): an operator deletes
// the bridge under running VMs; their TAPs stay, detached. The next TAP
// reconcile round makes the bridge again and puts every leased TAP back on
// it (isolated, learning nothing, flooded nothing, its guest's static FDB
// entry made again, up), and says which. Before, nothing put them back.
func TestBridgeLossPutsLeasedTAPsBack(t *testing.T) {
	e := newEnv(t, subnet)
	taps := []string{e.attached(t, "vm-a", 1_900_000_001), e.attached(t, "vm-b", 1_900_000_002)}
	macs := map[string]net.HardwareAddr{}
	for _, id := range []string{"vm-a", "vm-b"} {
		nl := e.lease(t, id).GetNetwork()
		mac, err := net.ParseMAC(nl.GetMac())
		require.NoError(t, err)
		macs[nl.GetTap()] = mac
	}
	require.NoError(t, e.h.LinkDel(e.link(t, network.DefaultBridge)))
	for _, tap := range taps {
		require.Zero(t, e.link(t, tap).Attrs().MasterIndex, "deleting the bridge detaches its ports")
	}

	round, err := e.net.ReconcileTAPs(context.Background())
	require.NoError(t, err)
	assert.ElementsMatch(t, taps, round.Reattached)
	br := e.link(t, network.DefaultBridge)
	require.NotNil(t, br, "the bridge is made again")
	for _, tap := range taps {
		l := e.link(t, tap)
		assert.Equal(t, br.Attrs().Index, l.Attrs().MasterIndex, "%s is a port of the bridge again", tap)
		pi, err := e.h.LinkGetProtinfo(l)
		require.NoError(t, err)
		assert.True(t, pi.Isolated, "%s is isolated again", tap)
		assert.True(t, network.GuestPortWhole(t, e.net, tap, macs[tap]), "%s has its guest port settings and FDB entry again", tap)
	}
	round, err = e.net.ReconcileTAPs(context.Background())
	require.NoError(t, err)
	assert.Empty(t, round.Reattached, "nothing to put back twice")
}

// TestTAPReconcileHoldsThePlacementLock (issue 31 case 8): a TAP no record
// leases, past its grace, is about to be removed when a spawn leases its
// address (TAP names come from addresses). The reconcile reads the records
// and removes under the placement lock, so the spawn's placement waits and
// its TAP is made afresh after the removal. Before, the reconcile removed
// the TAP the spawn had just taken.
func TestTAPReconcileHoldsThePlacementLock(t *testing.T) {
	e := newEnv(t, subnet)
	first := netip.MustParseAddr("10.88.0.2") // the address the next lease gets
	stray := network.TAPName(first)
	nettest.MakeTAP(t, e.ns, stray, false)
	ctx := context.Background()
	_, err := e.net.ReconcileTAPs(ctx)
	require.NoError(t, err)
	e.now.Advance(2 * time.Minute)

	e.record(t, "vm-a")
	attached := make(chan error, 1)
	network.SetAfterList(e.net, func() {
		go func() {
			_, err := e.attach(t, "vm-a", 1_900_000_001)
			attached <- err
		}()
		// Long enough for an unlocked placement to lease, write ahead and
		// take the TAP; a locked one waits for this round.
		select {
		case err := <-attached:
			attached <- err
		case <-time.After(time.Second):
		}
	})
	round, err := e.net.ReconcileTAPs(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{stray}, round.Removed)
	require.NoError(t, <-attached)
	tap := e.lease(t, "vm-a").GetNetwork().GetTap()
	require.Equal(t, stray, tap, "the spawn leased the stray TAP's address")
	assert.NotNil(t, e.link(t, tap), "the spawn's TAP survives the round that removed the stray")
}

// TestReleaseBesideAnUnreadableRecord: a record another instance's agent
// tore (or a hand) does not hold up this instance's network release (one
// broken instance never stops a host): the ownership check reads past it,
// as the GPU kinds' does.
func TestReleaseBesideAnUnreadableRecord(t *testing.T) {
	e := newEnv(t, subnet)
	tap := e.attached(t, "vm-a", 1_900_000_001)
	e.record(t, "vm-torn")
	p, err := e.st.Paths("vm-torn")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(p.Record, []byte(`{"id": "vm-torn", "sp`), 0o600))
	e.beginDelete(t, "vm-a")
	released, _, err := e.net.Release(context.Background(), "vm-a")
	require.NoError(t, err)
	assert.True(t, released)
	assert.Nil(t, e.link(t, tap))
}
