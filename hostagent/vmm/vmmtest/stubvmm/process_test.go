package stubvmm_test

import (
	"bufio"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
	"vmflow/testsupport/stacktest"
)

// stub is the built stub running with a QMP listener as fd 3, as the
// agent runs it (unjailed here: the e2e smoke runs it jailed).
type stub struct {
	t    *testing.T
	bin  string
	cmd  *exec.Cmd
	sock string
	done chan struct{} // closed once Wait returned, with its error in err
	err  error
}

func startStub(t *testing.T) *stub {
	t.Helper()
	dir := proctest.ShortDir(t, "stub")
	s := &stub{t: t, bin: stacktest.BuildStubVMM(t), sock: filepath.Join(dir, "qmp.sock"), done: make(chan struct{})}
	l, err := net.Listen("unix", s.sock)
	require.NoError(t, err)
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	f, err := l.(*net.UnixListener).File()
	require.NoError(t, err)
	s.cmd = exec.Command(s.bin, "-name", "guest=stub", "-machine", "none", "-nodefaults",
		"-chardev", "socket,id=qmp,fd=3,server=on,wait=off", "-mon", "chardev=qmp,mode=control",
		"-sandbox", "on", "-m", "16", "-smp", "1")
	s.cmd.ExtraFiles = []*os.File{f}
	require.NoError(t, s.cmd.Start())
	f.Close()
	l.Close()
	go func() { s.err = s.cmd.Wait(); close(s.done) }()
	t.Cleanup(func() {
		_ = s.cmd.Process.Kill()
		<-s.done
	})
	return s
}

// dial connects and negotiates: the greeting, then qmp_capabilities.
func (s *stub) dial() (net.Conn, *bufio.Reader) {
	s.t.Helper()
	c, err := net.Dial("unix", s.sock)
	require.NoError(s.t, err)
	s.t.Cleanup(func() { c.Close() })
	require.NoError(s.t, c.SetDeadline(time.Now().Add(10*time.Second)))
	r := bufio.NewReader(c)
	greet, err := r.ReadString('\n')
	require.NoError(s.t, err)
	var g struct {
		QMP struct {
			Version vmm.Version `json:"version"`
		} `json:"QMP"`
	}
	require.NoError(s.t, json.Unmarshal([]byte(greet), &g), greet)
	assert.Equal(s.t, "7.2.0", g.QMP.Version.String(), "the greeting's version")
	assert.Equal(s.t, `{"return": {}, "id": 1}`+"\n", s.ask(c, r, `{"execute": "qmp_capabilities", "id": 1}`))
	return c, r
}

func (s *stub) ask(c net.Conn, r *bufio.Reader, cmd string) string {
	s.t.Helper()
	_, err := c.Write([]byte(cmd + "\n"))
	require.NoError(s.t, err)
	line, err := r.ReadString('\n')
	require.NoError(s.t, err)
	return line
}

func (s *stub) wait() error {
	s.t.Helper()
	select {
	case <-s.done:
		return s.err
	case <-time.After(10 * time.Second):
		s.t.Fatal("the stub did not exit within 10 s")
		return nil
	}
}

func status(t *testing.T, pid int, key string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s in /proc/%d/status", key, pid)
	return ""
}

// TestOneThreadAndQuit: the built stub is static (the jail binds nothing
// else), answers --version as vmm reads it, runs as one thread with a few
// hundred KiB resident, serves a client after the one before went away
// (a restarted agent), and exits 0 on quit.
func TestOneThreadAndQuit(t *testing.T) {
	s := startStub(t)
	f, err := elf.Open(s.bin)
	require.NoError(t, err)
	defer f.Close()
	for _, p := range f.Progs {
		assert.NotEqual(t, elf.PT_INTERP, p.Type, "static: no interpreter")
	}
	libs, err := f.ImportedLibraries()
	require.NoError(t, err)
	assert.Empty(t, libs)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	v, err := vmm.DetectVersion(ctx, s.bin)
	require.NoError(t, err)
	assert.Equal(t, "7.2.0", v.String())

	c, r := s.dial()
	assert.Equal(t, `{"return": {"status": "running", "singlestep": false, "running": true}, "id": "vmflow-2"}`+"\n",
		s.ask(c, r, `{"execute":"query-status","id":"vmflow-2"}`))
	assert.Equal(t, "1", status(t, s.cmd.Process.Pid, "Threads"), "one thread: Go's runtime never started")
	t.Logf("stub: VmRSS %s, RssAnon %s", status(t, s.cmd.Process.Pid, "VmRSS"), status(t, s.cmd.Process.Pid, "RssAnon"))
	c.Close()

	c, r = s.dial()
	assert.Equal(t, `{"return": {}, "id": "q"}`+"\n", s.ask(c, r, `{"execute":"quit","id":"q"}`))
	require.NoError(t, s.wait(), "quit: exit status 0")
}

func TestPowerdownEndsIt(t *testing.T) {
	s := startStub(t)
	c, r := s.dial()
	assert.Equal(t, `{"return": {}}`+"\n", s.ask(c, r, `{"execute":"system_powerdown"}`))
	require.NoError(t, s.wait(), "a guest that obeys the button: exit status 0")
}

// TestSIGTERMEndsIt: the stub handles SIGTERM (it exits 0, as QEMU does),
// which a namespace's PID 1 must for the agent's SIGTERM to reach it.
func TestSIGTERMEndsIt(t *testing.T) {
	s := startStub(t)
	_, _ = s.dial() // serving: the handler is installed
	require.NoError(t, s.cmd.Process.Signal(syscall.SIGTERM))
	err := s.wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		t.Fatalf("SIGTERM: %v (want a clean exit through the handler)", ee)
	}
	require.NoError(t, err)
}

// TestAgentGoneMidReply: a client that sends and goes away (an agent
// killed -9) costs the stub nothing: no SIGPIPE; the next client is served.
func TestAgentGoneMidReply(t *testing.T) {
	s := startStub(t)
	c, _ := s.dial()
	_, err := c.Write([]byte(strings.Repeat(`{"execute":"query-status"}`+"\n", 2000)))
	require.NoError(t, err)
	c.Close()
	c, r := s.dial()
	assert.Contains(t, s.ask(c, r, `{"execute":"query-status"}`), `"running": true`)
}
