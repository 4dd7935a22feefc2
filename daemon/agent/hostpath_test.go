package agent

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"vmflow/daemon"
	"vmflow/hostagent/network"
	"vmflow/hostagent/network/nettest"
	"vmflow/internal/errdefs"
)

// TestAgentRefusesRouteLocalnet (issue 32, finding 4): with route_localnet
// on in the agent's network namespace, the kernel routes guests' packets
// to the host's 127.0.0.1 services; the agent refuses to start, saying
// which setting and how to turn it off, before it changes anything there.
func TestAgentRefusesRouteLocalnet(t *testing.T) {
	ns := nettest.Namespace(t)
	nettest.Sysctl(t, ns, "net/ipv4/conf/all/route_localnet", "1")
	cfg := Config{
		HostID: "h1", StateDir: t.TempDir(), VGPUDriver: "none", TaskQueue: "vmflow", ReconcileEvery: time.Minute,
		GracefulTimeout: time.Second, GroupExitCap: time.Second,
		NetBridge: network.DefaultBridge, NetSubnet: netip.MustParsePrefix("10.88.0.0/24"), NetNetNS: ns,
		Flags: daemon.Flags{Address: refusingTemporal(t), Namespace: "default", LogLevel: "info", Logger: zap.NewNop()},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := Run(ctx, cfg)
	require.ErrorIs(t, err, network.ErrRouteLocalnet)
	assert.Equal(t, errdefs.Misconfigured, errdefs.ClassOf(err))
	assert.Contains(t, err.Error(), "sysctl -w net.ipv4.conf.all.route_localnet=0")
	assert.Nil(t, nettest.Link(t, nettest.Handle(t, ns), network.DefaultBridge), "nothing made in the namespace")
}
