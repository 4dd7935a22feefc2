package tclient

import (
	"errors"
	"fmt"
	"net"
	"strings"

	"go.temporal.io/sdk/client"
)

// ErrInsecureTransport: the Temporal connection as configured would expose
// credentials or accept any server, and --insecure does not allow it. The
// host agent refuses to connect (and keeps supervising); the worker exits.
var ErrInsecureTransport = errors.New("insecure Temporal transport refused (pass --insecure to allow it)")

// TransportRisks lists what is insecure about copts' connection, in words,
// empty when nothing is:
//   - credentials (an API key) sent over plaintext, readable on the wire;
//   - TLS that does not verify the server (skip-verify): anyone on the path
//     can pose as Temporal and hand the agent activities;
//   - plaintext to an address that is not loopback.
//
// Plaintext to a loopback address without credentials (make dev, the tests'
// dev servers) is fine.
func TransportRisks(copts client.Options) []string {
	tlsOn := copts.ConnectionOptions.TLS != nil && !copts.ConnectionOptions.TLSDisabled
	var risks []string
	if !tlsOn && copts.Credentials != nil {
		risks = append(risks, "credentials (API key) over plaintext")
	}
	if tlsOn && copts.ConnectionOptions.TLS.InsecureSkipVerify {
		risks = append(risks, "TLS without server verification (skip-verify)")
	}
	if !tlsOn && !IsLoopback(copts.HostPort) {
		risks = append(risks, fmt.Sprintf("plaintext to %s, which is not a loopback address", copts.HostPort))
	}
	return risks
}

// CheckTransport refuses copts' connection when TransportRisks finds
// anything and insecure (the --insecure flag) is false: an error wrapping
// ErrInsecureTransport that names every risk. With insecure it returns nil;
// the caller logs the risks.
func CheckTransport(copts client.Options, insecure bool) error {
	risks := TransportRisks(copts)
	if len(risks) == 0 || insecure {
		return nil
	}
	return fmt.Errorf("temporal at %s: %s: %w", copts.HostPort, strings.Join(risks, "; "), ErrInsecureTransport)
}

// IsLoopback reports whether a Temporal host:port (optionally with a gRPC
// resolver scheme such as dns:///) names this machine only: "localhost", a
// loopback IP, or the unspecified address (0.0.0.0, ::), which Linux
// connects to this machine: `make dev` with DEV_IP=0.0.0.0 dials it. Any
// other name may resolve anywhere.
func IsLoopback(hostPort string) bool {
	if i := strings.Index(hostPort, ":///"); i >= 0 {
		hostPort = hostPort[i+len(":///"):]
	}
	host, _, err := net.SplitHostPort(hostPort)
	if err != nil {
		host = strings.Trim(hostPort, "[]") // no port
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && (ip.IsLoopback() || ip.IsUnspecified())
}
