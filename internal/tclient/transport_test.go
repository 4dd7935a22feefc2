package tclient_test

import (
	"crypto/tls"
	"testing"

	"github.com/stretchr/testify/assert"
	"go.temporal.io/sdk/client"

	"vmflow/internal/tclient"
)

func TestCheckTransport(t *testing.T) {
	key := client.NewAPIKeyStaticCredentials("k")
	verified, skip := &tls.Config{}, &tls.Config{InsecureSkipVerify: true}
	for _, tc := range []struct {
		name  string
		opts  client.Options
		risks int
	}{
		{"loopback plaintext", client.Options{HostPort: "127.0.0.1:7233"}, 0},
		{"localhost plaintext", client.Options{HostPort: "localhost:7233"}, 0},
		{"ipv6 loopback plaintext", client.Options{HostPort: "[::1]:7233"}, 0},
		{"unspecified address (make dev with DEV_IP=0.0.0.0)", client.Options{HostPort: "0.0.0.0:7233"}, 0},
		{"resolver scheme to loopback", client.Options{HostPort: "dns:///localhost:7233"}, 0},
		{"remote TLS with a key", client.Options{HostPort: "ns.tmprl.cloud:7233", Credentials: key,
			ConnectionOptions: client.ConnectionOptions{TLS: verified}}, 0},
		{"key over plaintext to loopback", client.Options{HostPort: "127.0.0.1:7233", Credentials: key}, 1},
		{"key with TLS disabled", client.Options{HostPort: "127.0.0.1:7233", Credentials: key,
			ConnectionOptions: client.ConnectionOptions{TLS: verified, TLSDisabled: true}}, 1},
		{"skip-verify", client.Options{HostPort: "t:7233", ConnectionOptions: client.ConnectionOptions{TLS: skip}}, 1},
		{"remote plaintext", client.Options{HostPort: "10.0.0.1:7233"}, 1},
		{"a name that merely starts with 127", client.Options{HostPort: "127.example.com:7233"}, 1},
		{"remote plaintext with a key", client.Options{HostPort: "temporal:7233", Credentials: key}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Len(t, tclient.TransportRisks(tc.opts), tc.risks)
			err := tclient.CheckTransport(tc.opts, false)
			if tc.risks == 0 {
				assert.NoError(t, err)
			} else {
				assert.ErrorIs(t, err, tclient.ErrInsecureTransport)
			}
			assert.NoError(t, tclient.CheckTransport(tc.opts, true), "--insecure allows everything")
		})
	}
}
