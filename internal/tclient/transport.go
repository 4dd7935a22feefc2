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

// TransportRisks lists in words what is insecure about copts' connection:
// credentials over plaintext, TLS skip-verify (anyone on the path can hand the
// agent activities), plaintext off loopback. Empty when nothing is.
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

// CheckTransport refuses a risky connection unless insecure (--insecure, then
// the caller logs the risks): ErrInsecureTransport naming every risk.
func CheckTransport(copts client.Options, insecure bool) error {
	risks := TransportRisks(copts)
	if len(risks) == 0 || insecure {
		return nil
	}
	return fmt.Errorf("temporal at %s: %s: %w", copts.HostPort, strings.Join(risks, "; "), ErrInsecureTransport)
}

// IsLoopback reports whether a Temporal host:port (with an optional resolver
// scheme) names this machine only: localhost, a loopback IP or the unspecified
// address, which Linux connects locally (make dev with DEV_IP=0.0.0.0).
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
