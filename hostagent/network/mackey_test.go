package network_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/network"
	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// TestGuestMACIsTheHostsSecret (finding 1): a guest's MAC was a hash of its
// instance id, so anyone who knew an id knew its MAC. It is keyed with a
// random key of the host's own, made once in the state dir (0600): the same
// after a restart, another on another host.
func TestGuestMACIsTheHostsSecret(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-a")
	a, err := e.attach(t, "vm-a", 1_900_000_001)
	require.NoError(t, err)
	path := filepath.Join(e.st.StateDir(), network.MACKeyFile)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	keyFile, err := os.ReadFile(path)
	require.NoError(t, err)

	// A restart: a new agent over the same state dir derives the same MAC.
	again, err := network.New(network.Config{Subnet: subnet, NetNS: e.ns, Store: e.st})
	require.NoError(t, err)
	t.Cleanup(again.Close)
	key, err := again.MACKey(context.Background())
	require.NoError(t, err)
	assert.Equal(t, a.MAC, network.MAC(key, "vm-a", 0))
	after, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, keyFile, after, "the key is made once")

	// Another host: the same instance id, another MAC.
	other := newEnv(t, subnet)
	other.record(t, "vm-a")
	b, err := other.attach(t, "vm-a", 1_900_000_001)
	require.NoError(t, err)
	assert.NotEqual(t, a.MAC, b.MAC, "the id alone does not give the MAC")
	assert.NotEqual(t, e.link(t, network.DefaultBridge).Attrs().HardwareAddr.String(),
		other.link(t, network.DefaultBridge).Attrs().HardwareAddr.String(), "nor the bridge's")
}

// TestLeaseKeepsItsRecordedMAC: a lease placed before the key existed (its
// MAC the unkeyed hash) keeps its MAC: its NIC, its guard element and its
// FDB entry are made from the record, never derived again.
func TestLeaseKeepsItsRecordedMAC(t *testing.T) {
	e := newEnv(t, subnet)
	e.record(t, "vm-old")
	const old = "02:aa:bb:cc:dd:ee"
	l, err := e.st.Lock(context.Background(), "vm-old")
	require.NoError(t, err)
	_, err = l.Apply(store.LeaseIntent(store.NetworkLease(&vmflowv1.NetworkLease{
		Tap: network.TAPName(netip.MustParseAddr("10.88.0.9")), Mac: old, Address: "10.88.0.9/24",
		Gateway: "10.88.0.1", Bridge: network.DefaultBridge,
	}), time.Now()))
	require.NoError(t, err)
	l.Unlock()
	a, err := e.attach(t, "vm-old", 1_900_000_001)
	require.NoError(t, err)
	assert.Equal(t, old, a.MAC)
	mac, _ := net.ParseMAC(old)
	assert.Equal(t, []string{network.TAPName(netip.MustParseAddr("10.88.0.9"))}, e.fdbPorts(t, mac))
	assert.True(t, network.GuestPortWhole(t, e.net, network.TAPName(netip.MustParseAddr("10.88.0.9")), mac))
}

// TestUnusableMACKeyRefusesPlacement: a key others may read, or that is not
// a key, refuses every placement (Misconfigured) and is never replaced.
func TestUnusableMACKeyRefusesPlacement(t *testing.T) {
	for name, c := range map[string]struct {
		body string
		mode os.FileMode
	}{
		"readable by others": {body: fmt.Sprintf("%064x\n", 7), mode: 0o644},
		"not a key":          {body: "hello\n", mode: 0o600},
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, subnet)
			path := filepath.Join(e.st.StateDir(), network.MACKeyFile)
			require.NoError(t, os.WriteFile(path, []byte(c.body), c.mode))
			require.NoError(t, os.Chmod(path, c.mode))
			e.record(t, "vm-a")
			_, err := e.attach(t, "vm-a", 1_900_000_001)
			require.ErrorIs(t, err, network.ErrMisconfigured)
			got, err := os.ReadFile(path)
			require.NoError(t, err)
			assert.Equal(t, c.body, string(got), "left as it was")
		})
	}
}
