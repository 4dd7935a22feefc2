package guest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"
)

// DialRequest is the probe request asking the guest to connect to target.
func DialRequest(target netip.AddrPort) string { return ProbeDial + target.String() }

// Probe speaks the probe protocol over c, a connection to a guest's
// ProbePort: it reads the greeting, sends request and returns the reply
// line ("ok", "fail <reason>"). Everything happens before deadline. It
// closes nothing: the caller owns c. The caller makes c, so it decides from
// where (a test dials from inside a network namespace).
func Probe(c net.Conn, request string, deadline time.Time) (string, error) {
	if strings.ContainsAny(request, "\r\n") || len(request) > ProbeMaxLine {
		return "", fmt.Errorf("probe request %q: one line of at most %d bytes", request, ProbeMaxLine)
	}
	if err := c.SetDeadline(deadline); err != nil {
		return "", fmt.Errorf("probe: %w", err)
	}
	// A reply longer than a request is not one this guest sends.
	br := bufio.NewReaderSize(io.LimitReader(c, 4*ProbeMaxLine), 4*ProbeMaxLine)
	hello, err := br.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("probe greeting: %w", err)
	}
	if got := strings.TrimSuffix(hello, "\n"); got != ProbeHello {
		return "", fmt.Errorf("probe greeting %q, want %q", got, ProbeHello)
	}
	if _, err := io.WriteString(c, request+"\n"); err != nil {
		return "", fmt.Errorf("probe request: %w", err)
	}
	reply, err := br.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("probe reply to %q: %w", request, err)
	}
	reply = strings.TrimSuffix(reply, "\n")
	if reply != ProbeOK && !strings.HasPrefix(reply, ProbeFail) {
		return reply, errors.New("probe reply is neither ok nor fail: " + reply)
	}
	return reply, nil
}
