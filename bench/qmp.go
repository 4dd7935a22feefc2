package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"
)

// RawQMP is the smallest QMP client that works: dial, read the greeting,
// qmp_capabilities, one command at a time. It exists so the "raw QEMU
// action" baseline does not share code with vmflow's own monitor (whose
// cost is part of what is measured). Events are skipped while waiting for
// a reply: QEMU may send them at any time, even before the greeting.
type RawQMP struct {
	c *net.UnixConn
	r *bufio.Reader
}

// DialRawQMP connects to QEMU's QMP socket, retrying until QEMU created it, and
// negotiates capabilities; ctx bounds the whole handshake.
func DialRawQMP(ctx context.Context, path string) (*RawQMP, error) {
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, "unix", path)
		if err == nil {
			q := &RawQMP{c: conn.(*net.UnixConn), r: bufio.NewReader(conn)}
			if err := q.handshake(ctx); err != nil {
				q.Close()
				return nil, err
			}
			return q, nil
		}
		// The socket appears some tens of ms after the fork: retry on a
		// short timer until ctx's deadline, not a synchronisation sleep.
		t := time.NewTimer(5 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("dial QMP %s: %w (last: %w)", path, ctx.Err(), err)
		case <-t.C:
		}
	}
}

func (q *RawQMP) deadline(ctx context.Context) {
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(10 * time.Second)
	}
	_ = q.c.SetDeadline(dl)
}

type qmpMsg struct {
	QMP    json.RawMessage `json:"QMP"`
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
	Event string `json:"event"`
}

func (q *RawQMP) handshake(ctx context.Context) error {
	q.deadline(ctx)
	for {
		m, err := q.readMsg()
		if err != nil {
			return fmt.Errorf("QMP greeting: %w", err)
		}
		if m.QMP != nil {
			break
		}
	}
	return q.Execute(ctx, "qmp_capabilities")
}

func (q *RawQMP) readMsg() (qmpMsg, error) {
	line, err := q.r.ReadBytes('\n')
	if err != nil {
		return qmpMsg{}, err
	}
	var m qmpMsg
	if err := json.Unmarshal(line, &m); err != nil {
		return qmpMsg{}, fmt.Errorf("decode %q: %w", line, err)
	}
	return m, nil
}

// ErrQMPClosed: the monitor closed before replying. After "quit" that is
// expected: QEMU may exit before its reply is read.
var ErrQMPClosed = errors.New("QMP connection closed before the reply")

// Execute sends a command without arguments and waits for its reply.
func (q *RawQMP) Execute(ctx context.Context, command string) error {
	q.deadline(ctx)
	b, err := json.Marshal(map[string]string{"execute": command})
	if err != nil {
		return fmt.Errorf("encode %s: %w", command, err)
	}
	if _, err := q.c.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("send %s: %w", command, err)
	}
	for {
		m, err := q.readMsg()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || isEOF(err) {
				return fmt.Errorf("%s: %w", command, ErrQMPClosed)
			}
			return fmt.Errorf("%s: %w", command, err)
		}
		switch {
		case m.Error != nil:
			return fmt.Errorf("%s: %s: %s", command, m.Error.Class, m.Error.Desc)
		case m.Return != nil:
			return nil
		}
	}
}

// isEOF: the peer closed (or reset) the connection. QEMU exiting right
// after "quit" can do either.
func isEOF(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
}

// Close closes the connection.
func (q *RawQMP) Close() error { return q.c.Close() }
