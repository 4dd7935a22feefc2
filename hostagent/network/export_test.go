package network

import (
	"testing"

	"github.com/google/nftables"
	"github.com/stretchr/testify/require"
)

// NFTDump lists the nftables tables of n's namespace, the chains and the
// number of rules of n's host-path table.
func NFTDump(t *testing.T, n *Net) (tables, chains []string, rules int) {
	t.Helper()
	c, err := n.nft()
	require.NoError(t, err)
	ts, err := c.ListTables()
	require.NoError(t, err)
	for _, tb := range ts {
		tables = append(tables, tb.Name)
	}
	cs, err := c.ListChains()
	require.NoError(t, err)
	for _, ch := range cs {
		if ch.Table.Name != n.tableName() || ch.Table.Family != nftables.TableFamilyINet {
			continue
		}
		chains = append(chains, ch.Name)
		rs, err := c.GetRules(ch.Table, ch)
		require.NoError(t, err)
		rules += len(rs)
	}
	return tables, chains, rules
}
