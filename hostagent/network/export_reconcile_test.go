package network

// SetAfterList makes n's ReconcileTAPs call f between its read of the
// records and its removals.
func SetAfterList(n *Net, f func()) { n.afterList = f }
