package vmm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
)

// Why a hand-written QMP client rather than go-qemu's qmp.SocketMonitor
// (go-qemu 2025-02-12, read in socket.go):
//
//   - SocketMonitor.Connect decodes the first JSON object as the greeting and
//     the next one as the qmp_capabilities reply. QEMU may send an event
//     before the greeting and between a command and its reply (measured
//     here: POWERDOWN arrives before system_powerdown's reply, SHUTDOWN
//     before quit's), so Connect "succeeds" on an event and every later Run
//     receives the reply meant for the command before it.
//   - Run matches replies by order, not by id, and has no context: a Run
//     abandoned on timeout leaves its late reply queued for the next caller.
//   - Connect has no timeout (upstream issue #214), and its events channel is
//     unbuffered: with a listener that stops reading, the reader goroutine
//     blocks, replies stop, and Disconnect (which drains the reply stream)
//     hangs with it.
//   - Lines are read with a bufio.Scanner and its 64 KiB token limit.
//
// Wrapping it would mean a goroutine per call plus closing the monitor on
// every timeout. This client is about the same size: one reader goroutine
// owns the socket's read side, replies are routed by "id" to the caller
// waiting for them (a late reply to an abandoned call is dropped), events go
// to a bounded buffer that drops the oldest when nobody reads, and every
// call takes a context and sets a socket write deadline. Importing go-qemu's
// qmp package only for its Event type would also pull in go-libvirt, so the
// two small types below mirror go-qemu's instead.

// DefaultQMPTimeout bounds a QMP call whose context has no deadline.
const DefaultQMPTimeout = 5 * time.Second

// maxQMPMessage bounds one QMP message (a greeting, an event or a reply).
// A QEMU that a guest took over may send anything; 16 MiB lines with 64
// events kept, each decoded into a map, grew the agent's heap by 1.2 GiB.
// What vmflow asks for is small. Measured on QEMU 7.2 (q35, TCG, a qcow2
// overlay on a qcow2 base, a python client on the socket): greeting 142
// bytes, qmp_capabilities and system_powerdown replies 16, query-status 73,
// query-block 1,708, query-named-block-nodes 3,071 (the largest reply any
// caller or test asks for), events 81 (STOP) to 138 (SHUTDOWN). 64 KiB is
// twenty times the largest; query-qmp-schema (207,000) is never asked for.
const maxQMPMessage = 64 << 10

// eventBuffer is how many events Monitor keeps for Events readers before it
// drops the oldest: as raw bytes, at most eventBuffer*maxQMPMessage (4 MiB)
// per monitor, decoded only when read.
const eventBuffer = 64

var (
	// ErrMonitorClosed: the QMP connection ended (EOF, error or Close)
	// before the reply came. It says nothing about whether QEMU has exited:
	// QEMU closes the monitor before its thread group is gone.
	ErrMonitorClosed = errdefs.Unavailable.New("qmp monitor closed")
	// ErrQMPProtocol: QEMU (or whatever is on the socket) did not speak QMP,
	// or sent a message longer than maxQMPMessage. The monitor drops the
	// connection (Violation reports it).
	ErrQMPProtocol = errdefs.Unavailable.New("qmp protocol error")
)

// QMPError is an error reply from QEMU ({"error": {"class", "desc"}}).
type QMPError struct {
	Command string
	Class   string `json:"class"`
	Desc    string `json:"desc"`
}

func (e *QMPError) Error() string {
	return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc)
}

// StatusInfo is the reply to query-status.
type StatusInfo struct {
	Status  string `json:"status"`
	Running bool   `json:"running"`
}

// Event is a QMP event, shaped like go-qemu's Event.
type Event struct {
	Event     string                 `json:"event"`
	Data      map[string]interface{} `json:"data"`
	Timestamp struct {
		Seconds      int64 `json:"seconds"`
		Microseconds int64 `json:"microseconds"`
	} `json:"timestamp"`
}

// Version is the QEMU version from the QMP greeting.
type Version struct {
	QEMU struct {
		Major int `json:"major"`
		Minor int `json:"minor"`
		Micro int `json:"micro"`
	} `json:"qemu"`
	Package string `json:"package"`
}

func (v Version) String() string {
	return fmt.Sprintf("%d.%d.%d", v.QEMU.Major, v.QEMU.Minor, v.QEMU.Micro)
}

// message is any line QEMU sends: a greeting, an event or a reply.
type message struct {
	QMP *struct {
		Version      Version  `json:"version"`
		Capabilities []string `json:"capabilities"`
	} `json:"QMP"`
	Event string `json:"event"`
	// Data stays raw: an event is decoded only when someone reads it.
	Data      json.RawMessage `json:"data"`
	Timestamp *struct {
		Seconds      int64 `json:"seconds"`
		Microseconds int64 `json:"microseconds"`
	} `json:"timestamp"`
	ID     json.RawMessage `json:"id"`
	Return json.RawMessage `json:"return"`
	Error  *QMPError       `json:"error"`
}

type reply struct {
	ret json.RawMessage
	err *QMPError
}

// Monitor is one QMP connection to one QEMU. It is safe for concurrent use.
// QEMU serves one QMP client per socket at a time: keep one Monitor per VM.
type Monitor struct {
	conn *net.UnixConn

	greeting chan struct{} // closed once the greeting has arrived
	version  Version

	writeMu sync.Mutex

	mu      sync.Mutex
	nextID  uint64
	pending map[string]chan reply
	evq     [][]byte      // raw event messages, oldest first, at most eventBuffer
	evReady chan struct{} // a token when evq gains an event
	dropped uint64

	events     chan Event // fed from evq once Events is called
	eventsOnce sync.Once

	// onViolation, when set, is called once if the reader drops the
	// connection for a protocol violation, before Done is closed; it must
	// not block.
	onViolation func(error)

	readDone  chan struct{} // closed when the reader goroutine ends
	readErr   error         // why it ended; set before readDone closes
	violation error         // readErr when it was a protocol violation

	closed    chan struct{} // closed by Close
	closeOnce sync.Once
}

// DialQMP connects to the QMP socket at path and negotiates capabilities;
// events before the greeting stay events. ctx bounds it (DefaultQMPTimeout).
func DialQMP(ctx context.Context, path string) (*Monitor, error) {
	return dialQMP(ctx, path, nil)
}

// dialQMP is DialQMP with onViolation (nil for none) set before the first
// byte is read.
func dialQMP(ctx context.Context, path string, onViolation func(error)) (*Monitor, error) {
	ctx, cancel := withDefaultTimeout(ctx, DefaultQMPTimeout)
	defer cancel()
	c, err := dialSocket(ctx, path)
	if err != nil {
		return nil, fmt.Errorf("dial qmp %s: %w", path, err)
	}
	m := newMonitor(c.(*net.UnixConn), onViolation)
	if err := m.handshake(ctx); err != nil {
		m.Close()
		return nil, fmt.Errorf("qmp handshake on %s: %w", path, err)
	}
	return m, nil
}

// A Unix socket's address is bounded by sun_path (108 bytes), and the QMP
// socket lies under the operator's --state-dir: <state-dir>/instances/<id>/
// qemu.sock with a 63-byte id leaves 23 bytes for the state dir. A path
// that does not fit is reached through its directory instead, opened
// O_PATH for the one bind or connect, as /proc/self/fd/<n>/<name>: the
// kernel follows the magic link to that directory itself, so bind and
// connect reach the same socket whatever the state dir's length.
func viaShortPath[T any](path string, use func(short string) (T, error)) (T, error) {
	if len(path) <= MaxSocketPath {
		return use(path)
	}
	dir, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		var zero T
		return zero, fmt.Errorf("open the directory of socket %s: %w", path, err)
	}
	defer unix.Close(dir)
	return use("/proc/self/fd/" + strconv.Itoa(dir) + "/" + filepath.Base(path))
}

// dialSocket connects to the Unix socket at path, of any length.
func dialSocket(ctx context.Context, path string) (net.Conn, error) {
	return viaShortPath(path, func(p string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", p)
	})
}

func newMonitor(c *net.UnixConn, onViolation func(error)) *Monitor {
	m := &Monitor{
		conn:        c,
		greeting:    make(chan struct{}),
		pending:     map[string]chan reply{},
		evReady:     make(chan struct{}, 1),
		events:      make(chan Event),
		onViolation: onViolation,
		readDone:    make(chan struct{}),
		closed:      make(chan struct{}),
	}
	go m.read()
	return m
}

func (m *Monitor) handshake(ctx context.Context) error {
	select {
	case <-m.greeting:
	case <-m.readDone:
		return fmt.Errorf("before the greeting: %w", m.readErr)
	case <-ctx.Done():
		return fmt.Errorf("waiting for the greeting: %w", ctx.Err())
	}
	// Commands other than qmp_capabilities are refused until it succeeds.
	return m.Execute(ctx, "qmp_capabilities", nil, nil)
}

// Version is the QEMU version from the greeting.
func (m *Monitor) Version() Version { return m.version }

// read owns the read side of the socket until it fails or is closed.
func (m *Monitor) read() {
	r := bufio.NewReaderSize(m.conn, 4<<10)
	var err error
	greeted := false
	for {
		var line []byte
		line, err = readLine(r)
		if err != nil {
			break
		}
		line = bytes.TrimSpace(line)
		if len(line) == 0 {
			continue
		}
		var msg message
		if jerr := json.Unmarshal(line, &msg); jerr != nil {
			err = fmt.Errorf("%w: undecodable line %.200q: %v", ErrQMPProtocol, line, jerr)
			break
		}
		switch {
		case msg.QMP != nil:
			if !greeted {
				m.version = msg.QMP.Version
				greeted = true
				close(m.greeting)
			}
		case msg.Event != "":
			m.pushEvent(line)
		case msg.Return != nil || msg.Error != nil:
			m.deliver(msg)
		}
	}
	violated := errors.Is(err, ErrQMPProtocol)
	if violated {
		// Drop the connection: whatever holds the socket is not a QEMU
		// speaking QMP, and nothing it sends next can be trusted.
		_ = m.conn.Close()
	}
	m.mu.Lock()
	m.readErr = fmt.Errorf("%w: %w", ErrMonitorClosed, err)
	if violated {
		m.violation = err
	}
	m.mu.Unlock()
	if violated && m.onViolation != nil {
		m.onViolation(err) // before Done: whoever waits on Done sees it reported
	}
	close(m.readDone)
}

// readLine reads one newline-terminated message of at most maxQMPMessage
// bytes; a longer one is a protocol violation, refused before it is held.
func readLine(r *bufio.Reader) ([]byte, error) {
	var buf []byte
	for {
		chunk, err := r.ReadSlice('\n')
		if len(buf)+len(chunk) > maxQMPMessage {
			return nil, fmt.Errorf("%w: message longer than %d bytes", ErrQMPProtocol, maxQMPMessage)
		}
		buf = append(buf, chunk...)
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		return buf, err
	}
}

// pushEvent keeps one event's raw message without blocking: when nobody drains
// Events the oldest is dropped so replies keep flowing.
func (m *Monitor) pushEvent(line []byte) {
	m.mu.Lock()
	if len(m.evq) == eventBuffer {
		m.evq[0] = nil
		m.evq = m.evq[1:]
		m.dropped++
	}
	m.evq = append(m.evq, line)
	m.mu.Unlock()
	select {
	case m.evReady <- struct{}{}:
	default:
	}
}

// popEvent takes the oldest kept event, if any.
func (m *Monitor) popEvent() ([]byte, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.evq) == 0 {
		return nil, false
	}
	line := m.evq[0]
	m.evq[0] = nil
	m.evq = m.evq[1:]
	return line, true
}

// feedEvents decodes kept events one at a time, as Events readers take
// them, until Close.
func (m *Monitor) feedEvents() {
	for {
		line, ok := m.popEvent()
		if !ok {
			select {
			case <-m.evReady:
				continue
			case <-m.closed:
				return
			}
		}
		ev, err := decodeEvent(line)
		if err != nil {
			continue // the reader checked it is an event; its data may still be no object
		}
		select {
		case m.events <- ev:
		case <-m.closed:
			return
		}
	}
}

func decodeEvent(line []byte) (Event, error) {
	var msg message
	if err := json.Unmarshal(line, &msg); err != nil {
		return Event{}, err
	}
	ev := Event{Event: msg.Event}
	if len(msg.Data) > 0 {
		if err := json.Unmarshal(msg.Data, &ev.Data); err != nil {
			return Event{}, err
		}
	}
	if msg.Timestamp != nil {
		ev.Timestamp.Seconds = msg.Timestamp.Seconds
		ev.Timestamp.Microseconds = msg.Timestamp.Microseconds
	}
	return ev, nil
}

func (m *Monitor) deliver(msg message) {
	m.mu.Lock()
	defer m.mu.Unlock()
	ch, ok := m.pending[string(msg.ID)]
	if !ok && len(msg.ID) == 0 && len(m.pending) == 1 {
		// QEMU answers a line it cannot parse with an error without an id;
		// with one call in flight it can only be that call's.
		for _, c := range m.pending {
			ch, ok = c, true
		}
	}
	if !ok {
		return // a late reply to a call that gave up: drop it
	}
	ch <- reply{ret: msg.Return, err: msg.Error} // buffered, never blocks
	for k, c := range m.pending {
		if c == ch {
			delete(m.pending, k)
		}
	}
}

// Events returns QEMU's events, oldest first (the latest 64 kept). Never
// closed: Done says when the connection ended.
func (m *Monitor) Events() <-chan Event {
	m.eventsOnce.Do(func() { go m.feedEvents() })
	return m.events
}

// DroppedEvents is how many events were dropped because nobody read Events.
func (m *Monitor) DroppedEvents() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.dropped
}

// Done is closed when the connection has ended. That is not QEMU's exit.
func (m *Monitor) Done() <-chan struct{} { return m.readDone }

// Violation is the protocol violation (ErrQMPProtocol) for which the monitor
// dropped the connection, else nil.
func (m *Monitor) Violation() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.violation
}

// Execute runs command with args and decodes "return" into out (nil: ignore).
// ctx bounds it (DefaultQMPTimeout); a late reply after giving up is dropped.
func (m *Monitor) Execute(ctx context.Context, command string, args, out any) error {
	ctx, cancel := withDefaultTimeout(ctx, DefaultQMPTimeout)
	defer cancel()

	m.mu.Lock()
	m.nextID++
	id := strconv.Quote("vmflow-" + strconv.FormatUint(m.nextID, 10))
	ch := make(chan reply, 1)
	m.pending[id] = ch
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		delete(m.pending, id)
		m.mu.Unlock()
	}()

	req := struct {
		Execute   string          `json:"execute"`
		Arguments any             `json:"arguments,omitempty"`
		ID        json.RawMessage `json:"id"`
	}{command, args, json.RawMessage(id)}
	b, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("qmp %s: encode: %w", command, err)
	}
	b = append(b, '\n')
	if err := m.write(ctx, b); err != nil {
		return fmt.Errorf("qmp %s: %w", command, err)
	}
	select {
	case r := <-ch:
		if r.err != nil {
			r.err.Command = command
			return r.err
		}
		if out != nil {
			if err := json.Unmarshal(r.ret, out); err != nil {
				return fmt.Errorf("qmp %s: decode reply %.200q: %w", command, r.ret, err)
			}
		}
		return nil
	case <-m.readDone:
		// The reply may have been delivered just before the reader ended.
		select {
		case r := <-ch:
			if r.err != nil {
				r.err.Command = command
				return r.err
			}
			if out != nil {
				if err := json.Unmarshal(r.ret, out); err != nil {
					return fmt.Errorf("qmp %s: decode reply: %w", command, err)
				}
			}
			return nil
		default:
		}
		m.mu.Lock()
		rerr := m.readErr
		m.mu.Unlock()
		return fmt.Errorf("qmp %s: %w", command, rerr)
	case <-ctx.Done():
		return fmt.Errorf("qmp %s: waiting for the reply: %w", command, ctx.Err())
	}
}

func (m *Monitor) write(ctx context.Context, b []byte) error {
	m.writeMu.Lock()
	defer m.writeMu.Unlock()
	dl, _ := ctx.Deadline() // withDefaultTimeout guarantees one
	if err := m.conn.SetWriteDeadline(dl); err != nil {
		return m.closedOr(fmt.Errorf("set write deadline: %w", err))
	}
	if _, err := m.conn.Write(b); err != nil {
		return m.closedOr(fmt.Errorf("write: %w", err))
	}
	return nil
}

// closedOr is why the connection ended when the reader has ended (a write
// fails on a socket the reader dropped), else err.
func (m *Monitor) closedOr(err error) error {
	if errors.Is(err, net.ErrClosed) {
		// Closed by the reader (a violation) or by Close: either way the
		// reader is ending, and its reason is the one to report.
		<-m.readDone
	}
	select {
	case <-m.readDone:
		m.mu.Lock()
		defer m.mu.Unlock()
		return fmt.Errorf("%w (%w)", m.readErr, err)
	default:
		return err
	}
}

// Status runs query-status.
func (m *Monitor) Status(ctx context.Context) (StatusInfo, error) {
	var st StatusInfo
	err := m.Execute(ctx, "query-status", nil, &st)
	return st, err
}

// SystemPowerdown presses the ACPI power button. The guest may ignore it;
// -machine none has no ACPI at all and ignores it always.
func (m *Monitor) SystemPowerdown(ctx context.Context) error {
	return m.Execute(ctx, "system_powerdown", nil, nil)
}

// Quit asks QEMU to exit (ErrMonitorClosed if the connection ends before the
// reply); neither the reply nor the EOF means QEMU is gone.
func (m *Monitor) Quit(ctx context.Context) error {
	return m.Execute(ctx, "quit", nil, nil)
}

// Close closes the connection and waits for the reader to end. It never
// affects QEMU.
func (m *Monitor) Close() error {
	var err error
	m.closeOnce.Do(func() {
		err = m.conn.Close()
		if errors.Is(err, net.ErrClosed) {
			err = nil // the reader dropped it for a violation
		}
		<-m.readDone // a closed socket ends the read at once
		close(m.closed)
	})
	return err
}

// withDefaultTimeout gives ctx a deadline d from now if it has none.
func withDefaultTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d)
}
