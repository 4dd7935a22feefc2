package vmm

import (
	"context"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// unixPair is a connected pair of unix stream sockets, no file on disk.
func unixPair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("socketpair: %v", err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "qmp-fuzz")
		defer f.Close() // FileConn dups the descriptor
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatalf("file conn: %v", err)
		}
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// FuzzQMPReplies feeds whatever a QEMU (or whatever holds the socket) might
// send to the monitor: the reader, the handshake and a query-status whose
// reply is decoded. Nothing may panic or hang; every call returns once the
// peer has sent its bytes and closed.
func FuzzQMPReplies(f *testing.F) {
	for _, s := range []string{
		greeting + "\n" + `{"return": {}, "id": "vmflow-1"}` + "\n" + `{"return": {"status": "running", "running": true, "singlestep": false}, "id": "vmflow-2"}` + "\n",
		event("RESUME") + "\n" + greeting + "\n" + `{"return": {}, "id": "vmflow-1"}` + "\n" + event("STOP") + "\n" + `{"return": {"status": "paused", "running": false}, "id": "vmflow-2"}` + "\n",
		greeting + "\n" + `{"error": {"class": "CommandNotFound", "desc": "nope"}}` + "\n",
		greeting + "\n" + `{"return": {}, "id": "vmflow-1"}` + "\n" + `{"return": "running", "id": "vmflow-2"}` + "\n",
		greeting + "\n" + `{"return": {}, "id": "vmflow-1"}` + "\n" + `{"return": {"status": 7}, "id": "vmflow-2"}` + "\n",
		`{"QMP": null}` + "\n",
		`{"QMP": {"version": {"qemu": {"major": "x"}}}}` + "\n",
		`{"event": "SHUTDOWN", "data": {"guest": false, "reason": "host-qmp-quit"}, "timestamp": {"seconds": -1}}` + "\n",
		`{"return": {}, "id": {"nested": [1, 2]}}` + "\n",
		"\n\n   \n" + greeting,
		"not json\n",
		`{"id": "vmflow-1", "return": null, "error": null}` + "\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		a, b := unixPair(t)
		m := newMonitor(a, nil)
		defer m.Close()
		go func() {
			_, _ = b.Write(data)
			// EOF after the data: the reader must end, and every call
			// waiting on it with it.
			_ = b.Close()
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := m.handshake(ctx); err == nil {
			_, _ = m.Status(ctx)
		}
		select {
		case <-m.Done():
		case <-ctx.Done():
			t.Fatalf("the monitor's reader did not end after EOF (input %q)", data)
		}
		if ctx.Err() != nil {
			t.Fatalf("a call outlived the connection (input %q)", data)
		}
	})
}
