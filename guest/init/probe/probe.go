// Package probe is the guest init's TCP probe server on guest.ProbePort: a
// host test connects to see that the guest is reachable, and asks it to
// connect somewhere to see what the guest can reach (the gateway, another
// guest). One request per connection, every input bounded: the port is
// open to whatever shares the guest's network.
package probe

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"

	"vmflow/guest"
)

const (
	// MaxLine bounds the request line, its newline excluded.
	MaxLine = guest.ProbeMaxLine
	// MaxConns bounds the connections served at once; more are closed
	// unanswered.
	MaxConns = 4
	// DialTimeout bounds the connection a "dial" request makes.
	DialTimeout = 3 * time.Second
	// IOTimeout bounds each read and write on a client connection.
	IOTimeout = 5 * time.Second

	acceptRetry = 100 * time.Millisecond
	// lingerMax and lingerTimeout bound what finish reads after the reply.
	lingerMax     = 4 << 10
	lingerTimeout = time.Second
)

// Serve answers connections on ln until ctx ends or ln fails for good.
// Temporary accept errors (out of descriptors) are waited out: for PID 1
// giving up would leave the guest unreachable for the rest of its life.
func Serve(ctx context.Context, ln net.Listener) error {
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()
	slots := make(chan struct{}, MaxConns)
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			select {
			case <-time.After(acceptRetry):
			case <-ctx.Done():
				return ctx.Err()
			}
			continue
		}
		select {
		case slots <- struct{}{}:
			go func() {
				defer func() {
					// In PID 1 a panic in any goroutine is a kernel panic:
					// lose the connection, not the guest.
					_ = recover()
					<-slots
				}()
				serveConn(ctx, c)
			}()
		default:
			_ = c.Close() // busy: a bounded number of connections at once
		}
	}
}

func serveConn(ctx context.Context, c net.Conn) {
	defer c.Close()
	if !writeLine(c, guest.ProbeHello) {
		return
	}
	if err := c.SetReadDeadline(time.Now().Add(IOTimeout)); err != nil {
		return
	}
	line, err := readLine(c)
	var reply string
	switch {
	case err != nil:
		reply = guest.ProbeFail + err.Error()
	default:
		reply = Answer(ctx, line)
	}
	if writeLine(c, reply) {
		finish(c)
	}
}

// finish ends the connection after the reply has been written: FIN first,
// then what the client still sends is read (bounded in bytes and time)
// before the close. Closing a socket with unread input (the rest of a line
// that was too long) sends RST, and an RST can discard the reply before the
// client reads it.
func finish(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	if c.SetReadDeadline(time.Now().Add(lingerTimeout)) == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(c, lingerMax))
	}
}

// readLine reads one line of at most MaxLine bytes.
func readLine(r io.Reader) (string, error) {
	br := bufio.NewReaderSize(io.LimitReader(r, MaxLine+1), MaxLine+1)
	line, err := br.ReadString('\n')
	switch {
	case err == nil:
		return strings.TrimSuffix(strings.TrimSuffix(line, "\n"), "\r"), nil
	case len(line) > MaxLine:
		return "", fmt.Errorf("line longer than %d bytes", MaxLine)
	case errors.Is(err, io.EOF):
		return "", errors.New("no request line")
	default:
		return "", errors.New("reading the request timed out or failed")
	}
}

func writeLine(c net.Conn, line string) bool {
	if err := c.SetWriteDeadline(time.Now().Add(IOTimeout)); err != nil {
		return false
	}
	_, err := io.WriteString(c, line+"\n")
	return err == nil
}

// Answer is the reply to one request line: "dial <ipv4>:<port>" tries that
// TCP connection and answers "ok" or "fail <reason>"; anything else is
// "fail unknown command". The reply is always one line.
func Answer(ctx context.Context, line string) string {
	arg, ok := strings.CutPrefix(line, guest.ProbeDial)
	if !ok {
		return guest.ProbeFail + "unknown command"
	}
	ap, err := netip.ParseAddrPort(strings.TrimSpace(arg))
	if err != nil || !ap.Addr().Is4() || ap.Port() == 0 {
		return guest.ProbeFail + "bad address: want <ipv4>:<port>"
	}
	dctx, cancel := context.WithTimeout(ctx, DialTimeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(dctx, "tcp4", ap.String())
	if err != nil {
		return guest.ProbeFail + oneLine(err.Error())
	}
	_ = conn.Close()
	return guest.ProbeOK
}

func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '\n' || r == '\r' {
			return ' '
		}
		return r
	}, s)
}
