// Package tclient is the plumbing the vmflow binaries share around their
// Temporal connection: the SDK logger routed to zap, the Prometheus metrics
// handler the SDK reports into, and the search-attribute setup. The
// connection itself (Dial) and the data converter are public, in
// vmflow/platform, so a platform API in another module can use them.
package tclient
