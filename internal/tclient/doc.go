// Package tclient is the plumbing both vmflow binaries use to talk to
// Temporal: the one data converter for every vmflow payload (snake_case JSON,
// decoded strictly), the SDK logger routed to zap, the connection built from
// the SDK's envconfig with retries, the Prometheus metrics handler the SDK
// reports into, and the search-attribute setup.
//
// Nothing here knows about workflows or activities; it only decides how bytes
// cross the wire and how the binaries reach the server.
package tclient
