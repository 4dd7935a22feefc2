package vmm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
)

// The fake QMP server is used only for protocol cases real QEMU cannot be
// made to produce on demand (an event before the greeting, a reply that
// never comes, a flood of events). Everything else runs against real QEMU.

const greeting = `{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": "fake"}, "capabilities": ["oob"]}}`

type fakeConn struct {
	t *testing.T
	c net.Conn
	r *bufio.Reader
}

// read returns the next command the client sent. The fake runs in its own
// goroutine, so it reports with assert (t.Errorf), never t.FailNow.
func (f *fakeConn) read() (execute string, id json.RawMessage) {
	f.t.Helper()
	line, err := f.r.ReadBytes('\n')
	if !assert.NoError(f.t, err) {
		return "", json.RawMessage(`null`)
	}
	var cmd struct {
		Execute string          `json:"execute"`
		ID      json.RawMessage `json:"id"`
	}
	assert.NoError(f.t, json.Unmarshal(line, &cmd), "line %q", line)
	return cmd.Execute, cmd.ID
}

func (f *fakeConn) send(s string) {
	f.t.Helper()
	_, err := f.c.Write([]byte(s + "\n"))
	assert.NoError(f.t, err)
}

func (f *fakeConn) reply(id json.RawMessage, ret string) {
	f.send(`{"return": ` + ret + `, "id": ` + string(id) + `}`)
}

func event(name string) string {
	return `{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "` + name + `"}`
}

// fakeQMP listens on a fresh socket and runs serve on the first connection.
// The returned channel is closed when serve returns.
func fakeQMP(t *testing.T, serve func(f *fakeConn)) (path string, done <-chan struct{}) {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "vm")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	path = filepath.Join(dir, "q.sock")
	l, err := net.Listen("unix", path)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		serve(&fakeConn{t: t, c: c, r: bufio.NewReader(c)})
	}()
	return path, ch
}

func TestQMPEventBeforeGreeting(t *testing.T) {
	path, done := fakeQMP(t, func(f *fakeConn) {
		// QEMU can emit an event before its greeting and between a command
		// and its reply; go-qemu's Connect takes the first for the greeting.
		f.send(event("RESUME"))
		f.send(greeting)
		cmd, id := f.read()
		assert.Equal(t, "qmp_capabilities", cmd)
		f.send(event("NIC_RX_FILTER_CHANGED"))
		f.reply(id, `{}`)
		cmd, id = f.read()
		assert.Equal(t, "query-status", cmd)
		f.send(event("POWERDOWN"))
		f.reply(id, `{"status": "running", "singlestep": false, "running": true}`)
		_, _ = f.r.ReadByte() // hold the connection until the client closes
	})
	m, err := DialQMP(ctxT(t, 5*time.Second), path)
	require.NoError(t, err)
	assert.Equal(t, "7.2.0", m.Version().String())
	st, err := m.Status(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	assert.Equal(t, StatusInfo{Status: "running", Running: true}, st)

	var got []string
	for len(got) < 3 {
		select {
		case ev := <-m.Events():
			got = append(got, ev.Event)
		case <-time.After(5 * time.Second):
			t.Fatalf("events so far %v", got)
		}
	}
	assert.Equal(t, []string{"RESUME", "NIC_RX_FILTER_CHANGED", "POWERDOWN"}, got)
	require.NoError(t, m.Close())
	<-done
}

func TestQMPUnreadEventsNeverBlockReplies(t *testing.T) {
	const flood = 10 * eventBuffer
	path, done := fakeQMP(t, func(f *fakeConn) {
		f.send(greeting)
		_, id := f.read()
		f.reply(id, `{}`)
		_, id = f.read()
		for range flood {
			f.send(event("RTC_CHANGE"))
		}
		f.reply(id, `{"status": "paused", "running": false}`)
		_, _ = f.r.ReadByte()
	})
	m, err := DialQMP(ctxT(t, 5*time.Second), path)
	require.NoError(t, err)
	defer m.Close()
	// Nobody reads Events: the reply must still come.
	st, err := m.Status(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	assert.Equal(t, "paused", st.Status)
	assert.Equal(t, uint64(flood-eventBuffer), m.DroppedEvents())
	m.Close()
	<-done
}

func TestQMPLateReplyIsDropped(t *testing.T) {
	release := make(chan struct{})
	path, done := fakeQMP(t, func(f *fakeConn) {
		f.send(greeting)
		_, id := f.read()
		f.reply(id, `{}`)
		_, slow := f.read() // the call that gives up
		<-release
		f.reply(slow, `{"status": "stale", "running": false}`)
		_, id = f.read()
		f.reply(id, `{"status": "running", "running": true}`)
		_, _ = f.r.ReadByte()
	})
	m, err := DialQMP(ctxT(t, 5*time.Second), path)
	require.NoError(t, err)
	defer m.Close()

	_, err = m.Status(ctxT(t, 50*time.Millisecond))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	close(release)
	// go-qemu would hand the stale reply to this call; ids route it away.
	st, err := m.Status(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	assert.Equal(t, "running", st.Status)
	m.Close()
	<-done
}

func TestQMPErrorReply(t *testing.T) {
	path, done := fakeQMP(t, func(f *fakeConn) {
		f.send(greeting)
		_, id := f.read()
		f.reply(id, `{}`)
		_, id = f.read()
		f.send(`{"id": ` + string(id) + `, "error": {"class": "GenericError", "desc": "nope"}}`)
		_, _ = f.r.ReadByte()
	})
	m, err := DialQMP(ctxT(t, 5*time.Second), path)
	require.NoError(t, err)
	defer m.Close()
	err = m.SystemPowerdown(ctxT(t, 5*time.Second))
	var qe *QMPError
	require.True(t, errors.As(err, &qe), "%v", err)
	assert.Equal(t, "system_powerdown", qe.Command)
	assert.Equal(t, "GenericError", qe.Class)
	m.Close()
	<-done
}

func TestQMPEOFBeforeReply(t *testing.T) {
	path, done := fakeQMP(t, func(f *fakeConn) {
		f.send(greeting)
		_, id := f.read()
		f.reply(id, `{}`)
		f.read()
		f.send(event("SHUTDOWN"))
		// and hang up without a reply, as QEMU may after quit
	})
	m, err := DialQMP(ctxT(t, 5*time.Second), path)
	require.NoError(t, err)
	defer m.Close()
	err = m.Quit(ctxT(t, 5*time.Second))
	require.ErrorIs(t, err, ErrMonitorClosed)
	<-done
}

func TestQMPNoGreetingTimesOut(t *testing.T) {
	path, done := fakeQMP(t, func(f *fakeConn) {
		_, _ = f.r.ReadByte() // say nothing until the client gives up
	})
	start := time.Now()
	_, err := DialQMP(ctxT(t, 100*time.Millisecond), path)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(start), 2*time.Second)
	<-done
}

func TestQMPGarbageIsProtocolError(t *testing.T) {
	path, done := fakeQMP(t, func(f *fakeConn) {
		f.send("SSH-2.0-OpenSSH_9.2")
	})
	_, err := DialQMP(ctxT(t, 5*time.Second), path)
	require.ErrorIs(t, err, ErrQMPProtocol)
	<-done
}

// A QEMU a guest took over may send a message of any length: one longer
// than maxQMPMessage is a violation, never read whole. The monitor drops
// the connection and says why; a call waiting on it ends.
func TestQMPOversizedMessageDropsTheConnection(t *testing.T) {
	for _, tc := range []struct {
		name string
		send func(f *fakeConn)
	}{
		{"event", func(f *fakeConn) {
			f.send(`{"event": "X", "data": {"pad": "` + strings.Repeat("a", maxQMPMessage) + `"}}`)
		}},
		{"reply", func(f *fakeConn) {
			_, id := f.read()
			f.reply(id, `"`+strings.Repeat("a", maxQMPMessage)+`"`)
		}},
		{"no newline", func(f *fakeConn) {
			_, _ = f.c.Write(bytes.Repeat([]byte(" "), 4*maxQMPMessage))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peerSaw := make(chan error, 1)
			path, done := fakeQMP(t, func(f *fakeConn) {
				f.send(greeting)
				_, id := f.read()
				f.reply(id, `{}`)
				tc.send(f)
				// The client hangs up: the fake's reads end (EOF, or
				// ECONNRESET when the client left bytes unread).
				for {
					if _, err := f.r.ReadBytes('\n'); err != nil {
						peerSaw <- err
						return
					}
				}
			})
			violations := make(chan error, 2)
			m, err := dialQMP(ctxT(t, 5*time.Second), path, func(err error) { violations <- err })
			require.NoError(t, err)
			defer m.Close()
			_, err = m.Status(ctxT(t, 5*time.Second))
			require.ErrorIs(t, err, ErrMonitorClosed)
			assert.ErrorIs(t, err, ErrQMPProtocol)
			<-m.Done()
			assert.ErrorIs(t, m.Violation(), ErrQMPProtocol)
			select {
			case v := <-violations:
				assert.ErrorIs(t, v, ErrQMPProtocol)
			default:
				t.Fatal("onViolation was not called")
			}
			assert.Error(t, <-peerSaw, "the monitor dropped the connection")
			<-done
			assert.Empty(t, violations, "onViolation is called once")
		})
	}
}

// An orderly end of the connection (QEMU's EOF after quit) is no violation.
func TestQMPEOFIsNoViolation(t *testing.T) {
	path, done := fakeQMP(t, func(f *fakeConn) {
		f.send(greeting)
		_, id := f.read()
		f.reply(id, `{}`)
	})
	m, err := dialQMP(ctxT(t, 5*time.Second), path, func(error) { t.Error("onViolation called on EOF") })
	require.NoError(t, err)
	defer m.Close()
	<-done
	<-m.Done()
	assert.NoError(t, m.Violation())
}

// Events are kept as bytes and decoded when read: the data of the latest
// eventBuffer events survives, whole, in order.
func TestQMPEventsDecodedWhenRead(t *testing.T) {
	const n = eventBuffer + 3
	path, done := fakeQMP(t, func(f *fakeConn) {
		f.send(greeting)
		_, id := f.read()
		f.reply(id, `{}`)
		_, id = f.read()
		for i := range n {
			f.send(`{"event": "E", "data": {"i": ` + strconv.Itoa(i) + `}, "timestamp": {"seconds": 5, "microseconds": 6}}`)
		}
		f.reply(id, `{"status": "running", "running": true}`)
		_, _ = f.r.ReadByte()
	})
	m, err := DialQMP(ctxT(t, 5*time.Second), path)
	require.NoError(t, err)
	defer m.Close()
	_, err = m.Status(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	assert.Equal(t, uint64(n-eventBuffer), m.DroppedEvents())
	for i := n - eventBuffer; i < n; i++ {
		select {
		case ev := <-m.Events():
			assert.Equal(t, "E", ev.Event)
			assert.Equal(t, map[string]any{"i": float64(i)}, ev.Data)
			assert.Equal(t, int64(5), ev.Timestamp.Seconds)
		case <-time.After(5 * time.Second):
			t.Fatalf("event %d never came", i)
		}
	}
	m.Close()
	<-done
}

// A VM hands its monitors' violations to whoever supervises it (who marks
// it needing attention); its next Monitor call dials afresh.
func TestVMReportsQMPViolation(t *testing.T) {
	path, done := fakeQMP(t, func(f *fakeConn) {
		f.send(greeting)
		_, id := f.read()
		f.reply(id, `{}`)
		f.send(`{"event": "` + strings.Repeat("X", 2*maxQMPMessage) + `"}`)
		_, _ = f.r.ReadBytes('\n')
	})
	self, err := proc.ReadIdentity(os.Getpid()) // a live process stands in for QEMU
	require.NoError(t, err)
	vm, err := Attach(self, Paths{QMPSocket: path})
	require.NoError(t, err)
	m, err := vm.Monitor(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	select {
	case err := <-vm.QMPViolation():
		assert.ErrorIs(t, err, ErrQMPProtocol)
	case <-time.After(10 * time.Second):
		t.Fatal("no violation reported")
	}
	<-m.Done()
	<-done
	select {
	case <-vm.Closed():
		t.Fatal("closed before Close")
	default:
	}
	require.NoError(t, vm.Close())
	<-vm.Closed()
}

// A QMP socket path past sun_path's 107 bytes (a 63-byte id under a 90-byte
// state dir) is bound and dialled through its directory: QEMU, jailed or
// not, launches and answers; a second VM attached by identity (as after an
// agent restart) dials it again; the stop removes the socket. Before, the
// launch failed ("qmp socket path is 174 bytes").
func TestLongQMPSocketPath(t *testing.T) {
	requiresQEMU(t)
	for _, jail := range []bool{false, true} {
		t.Run("jail="+strconv.FormatBool(jail), func(t *testing.T) {
			if jail {
				requiresRoot(t)
			}
			cfg := testLaunchConfig(t, "long")
			stateDir := filepath.Join(filepath.Dir(cfg.Paths.QMPSocket), strings.Repeat("s", 90))
			stateDir = stateDir[:90]
			dir := filepath.Join(stateDir, "instances", strings.Repeat("v", 63))
			require.NoError(t, os.MkdirAll(dir, 0o700))
			cfg.Paths.QMPSocket = filepath.Join(dir, "qemu.sock")
			require.Greater(t, len(cfg.Paths.QMPSocket), MaxSocketPath)
			if jail {
				cfg = jailed(t, cfg)
			}
			vm, err := Launch(ctxT(t, 30*time.Second), cfg)
			require.NoError(t, err, "log: %s", readLog(cfg.Paths.Log))
			killOnCleanup(t, vm)
			assert.FileExists(t, cfg.Paths.QMPSocket)
			vm.Close() // the agent gone: its QMP connection with it

			again, err := Attach(vm.Identity(), cfg.Paths)
			require.NoError(t, err)
			defer again.Close()
			mon, err := again.Monitor(ctxT(t, 10*time.Second))
			require.NoError(t, err, "dialled through the directory")
			st, err := mon.Status(ctxT(t, 10*time.Second))
			require.NoError(t, err)
			assert.True(t, st.Running)
			_, err = again.Stop(ctxT(t, 30*time.Second), StopConfig{GracefulTimeout: time.Millisecond})
			require.NoError(t, err)
			assert.NoFileExists(t, cfg.Paths.QMPSocket)
		})
	}
}
