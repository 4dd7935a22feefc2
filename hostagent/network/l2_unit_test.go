package network

import (
	"testing"

	mnl "github.com/mdlayher/netlink"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// bridgeLink is a bridge's RTM_NEWLINK as the kernel answers it, its
// IFLA_INFO_DATA holding data.
func bridgeLink(t *testing.T, data func(*mnl.AttributeEncoder)) []mnl.Message {
	t.Helper()
	ae := mnl.NewAttributeEncoder()
	ae.String(unix.IFLA_IFNAME, "vmflow0")
	ae.Nested(unix.IFLA_LINKINFO, func(li *mnl.AttributeEncoder) error {
		li.String(unix.IFLA_INFO_KIND, "bridge")
		li.Nested(unix.IFLA_INFO_DATA, func(d *mnl.AttributeEncoder) error {
			d.Uint32(unix.IFLA_BR_AGEING_TIME, 30000)
			data(d)
			return nil
		})
		return nil
	})
	b, err := ae.Encode()
	require.NoError(t, err)
	return []mnl.Message{{Data: append(ifinfomsg(unix.AF_UNSPEC, 2), b...)}}
}

// TestFDBBoundOfAnOlderKernel: a kernel before 6.8 does not report
// fdb_max_learned (and ignores it when set): the agent tells it apart from
// a bound of 0, which means none.
func TestFDBBoundOfAnOlderKernel(t *testing.T) {
	limit, known, err := fdbMaxOf(bridgeLink(t, func(*mnl.AttributeEncoder) {}))
	require.NoError(t, err)
	assert.False(t, known)
	assert.Zero(t, limit)

	limit, known, err = fdbMaxOf(bridgeLink(t, func(d *mnl.AttributeEncoder) { d.Uint32(unix.IFLA_BR_FDB_MAX_LEARNED, 0) }))
	require.NoError(t, err)
	assert.True(t, known, "a kernel that knows the bound reports it, 0 too")
	assert.Zero(t, limit)

	limit, known, err = fdbMaxOf(bridgeLink(t, func(d *mnl.AttributeEncoder) { d.Uint32(unix.IFLA_BR_FDB_MAX_LEARNED, 256) }))
	require.NoError(t, err)
	assert.True(t, known)
	assert.Equal(t, uint32(256), limit)
}
