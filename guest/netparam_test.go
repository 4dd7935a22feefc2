package guest_test

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/guest"
)

func TestNetConfigFromCmdline(t *testing.T) {
	want := guest.NetConfig{Addr: netip.MustParsePrefix("10.88.0.2/24"), Gateway: netip.MustParseAddr("10.88.0.1")}
	for _, tc := range []struct {
		name, cmdline string
		ok            bool
		err           string
	}{
		{"absent", "console=ttyS0 panic=-1\n", false, ""},
		{"present", "console=ttyS0 panic=-1 vmflow.net=10.88.0.2/24,10.88.0.1\n", true, ""},
		{"another parameter's prefix", "xvmflow.net=1 vmflow.netx=2", false, ""},
		{"twice", "vmflow.net=10.88.0.2/24,10.88.0.1 vmflow.net=10.88.0.3/24,10.88.0.1", true, "given 2 times"},
		{"malformed", "vmflow.net=garbage", true, "want <ipv4>/<prefix>,<gateway>"},
		{"empty", "vmflow.net=", true, "want"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, ok, err := guest.NetConfigFromCmdline(tc.cmdline)
			assert.Equal(t, tc.ok, ok)
			if tc.err != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.err)
				return
			}
			require.NoError(t, err)
			if ok {
				assert.Equal(t, want, c)
			}
		})
	}
}

func TestParseNetConfig(t *testing.T) {
	c, err := guest.ParseNetConfig("192.168.7.200/16,192.168.0.1")
	require.NoError(t, err)
	assert.Equal(t, netip.MustParsePrefix("192.168.7.200/16"), c.Addr, "the address keeps its host bits")
	assert.Equal(t, netip.MustParseAddr("192.168.0.1"), c.Gateway)

	for _, bad := range []string{
		"10.88.0.2,10.88.0.1",      // no prefix length
		"10.88.0.2/24",             // no gateway
		"10.88.0.2/24,",            // empty gateway
		"10.88.0.2/33,10.88.0.1",   // prefix too long
		"10.88.0.2/32,10.88.0.1",   // gateway cannot be inside a /32
		"10.88.0.2/0,10.88.0.1",    // no subnet
		"10.88.0.2/24,10.89.0.1",   // gateway outside
		"10.88.0.2/24,10.88.0.2",   // gateway is the guest
		"10.88.0.0/24,10.88.0.1",   // network address
		"10.88.0.255/24,10.88.0.1", // broadcast address
		"fd00::2/64,fd00::1",       // IPv6
		"10.88.0.2/24,fd00::1",
		"10.88.0.2/24,10.88.0.1,x",
		"::ffff:10.88.0.2/120,10.88.0.1",
	} {
		_, err := guest.ParseNetConfig(bad)
		assert.Error(t, err, bad)
	}
}

func TestBroadcast(t *testing.T) {
	assert.Equal(t, "10.88.0.255", guest.Broadcast(netip.MustParsePrefix("10.88.0.2/24")).String())
	assert.Equal(t, "10.127.255.255", guest.Broadcast(netip.MustParsePrefix("10.88.0.2/9")).String())
	assert.Equal(t, "10.88.0.3", guest.Broadcast(netip.MustParsePrefix("10.88.0.1/30")).String())
}

func TestNetConfigParamRoundTrip(t *testing.T) {
	c := guest.NetConfig{Addr: netip.MustParsePrefix("10.88.0.2/24"), Gateway: netip.MustParseAddr("10.88.0.1")}
	assert.Equal(t, "vmflow.net=10.88.0.2/24,10.88.0.1", c.Param())
	back, ok, err := guest.NetConfigFromCmdline(guest.KernelCmdline + " " + c.Param())
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, c, back)
}
