package guest_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/guest"
	"vmflow/guest/build"
)

const (
	buildTimeout = 5 * time.Minute  // a first build downloads ~27 MB and compiles the init
	upTimeout    = 60 * time.Second // TCG boot to the init is ~3-4 s here
	exitTimeout  = 30 * time.Second
)

// requiresQEMU skips when QEMU is missing (make tools installs it).
func requiresQEMU(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("qemu-system-x86_64 not installed (make qemu installs Debian's qemu-system-x86)")
	}
	return p
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestPowerButtonPowersOff boots the real guest under TCG (a Linux guest
// hangs after "Probing EDD" under this machine's nested KVM), waits for the
// init to be up, presses the ACPI power button over QMP and demands that
// QEMU exits by itself, status 0, after the init said it powers off.
func TestPowerButtonPowersOff(t *testing.T) {
	qemu := requiresQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	a, err := build.Build(ctx, build.Options{Log: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	require.NoError(t, err)

	dir := t.TempDir()
	logPath := filepath.Join(dir, "qemu.log")
	sock := filepath.Join(dir, "qmp.sock")
	stderr, err := os.Create(filepath.Join(dir, "qemu.stderr"))
	require.NoError(t, err)
	defer stderr.Close()

	cmd := exec.Command(qemu,
		"-machine", "q35", "-accel", "tcg", "-m", "256",
		"-nodefaults", "-display", "none", "-no-reboot",
		"-serial", "file:"+logPath,
		"-kernel", a.Kernel, "-initrd", a.Initrd, "-append", guest.KernelCmdline,
		"-qmp", "unix:"+sock+",server=on,wait=off")
	cmd.Stderr = stderr
	spawned := time.Now()
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	// Whatever happens below, no QEMU outlives the test.
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	diag := func() string {
		out, _ := os.ReadFile(logPath)
		errOut, _ := os.ReadFile(stderr.Name())
		return fmt.Sprintf("\n--- qemu.log (tail) ---\n%s\n--- stderr ---\n%s", tail(string(out), 2000), errOut)
	}

	require.NoError(t, waitForLine(logPath, guest.UpLine, exited, upTimeout), diag())
	upAfter := time.Since(spawned)

	conn, err := net.DialTimeout("unix", sock, 5*time.Second)
	require.NoError(t, err, diag())
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(time.Now().Add(exitTimeout+10*time.Second)))
	q := &qmp{r: bufio.NewScanner(conn), w: conn}
	require.NoError(t, q.greeting(), diag())
	require.NoError(t, q.execute("qmp_capabilities"), diag())
	pressed := time.Now()
	require.NoError(t, q.execute("system_powerdown"), diag())

	select {
	case <-exited:
	case <-time.After(exitTimeout):
		t.Fatalf("QEMU still running %s after system_powerdown%s", exitTimeout, diag())
	}
	exitAfter := time.Since(pressed)
	require.NoError(t, waitErr, "QEMU exit status%s", diag())
	assert.Equal(t, 0, cmd.ProcessState.ExitCode())

	// The monitor closes when QEMU exits: the rest of the stream holds the
	// SHUTDOWN event, which says the guest (not the host) ended it.
	q.drain()
	assert.True(t, q.sawGuestShutdown(), "no SHUTDOWN event with guest=true; events: %v", q.events)
	out, err := os.ReadFile(logPath)
	require.NoError(t, err)
	assert.Contains(t, string(out), guest.PowerOffLine)
	assert.NotContains(t, string(out), guest.FatalPrefix)
	assert.NotContains(t, string(out), "Kernel panic")

	t.Logf("kernel %s %s: spawn→%q %s, system_powerdown→QEMU reaped %s",
		a.KernelPackage, a.KernelVersion, guest.UpLine,
		upAfter.Round(time.Millisecond), exitAfter.Round(time.Millisecond))
}

// waitForLine polls the serial log until it holds line, QEMU exits, or the
// timeout passes.
func waitForLine(path, line string, exited <-chan struct{}, timeout time.Duration) error {
	deadline := time.After(timeout)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if data, err := os.ReadFile(path); err == nil && strings.Contains(string(data), line) {
			return nil
		}
		select {
		case <-exited:
			if data, err := os.ReadFile(path); err == nil && strings.Contains(string(data), line) {
				return nil
			}
			return fmt.Errorf("QEMU exited before %q", line)
		case <-deadline:
			return fmt.Errorf("no %q in %s after %s", line, path, timeout)
		case <-tick.C:
		}
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// qmp is the smallest QMP client a test needs: one JSON object per line,
// events kept aside (they may come before the greeting and between a
// command and its reply).
type qmp struct {
	r      *bufio.Scanner
	w      net.Conn
	events []map[string]any
}

func (q *qmp) next() (map[string]any, error) {
	if !q.r.Scan() {
		if err := q.r.Err(); err != nil {
			return nil, fmt.Errorf("qmp read: %w", err)
		}
		return nil, errors.New("qmp: connection closed")
	}
	var msg map[string]any
	if err := json.Unmarshal(q.r.Bytes(), &msg); err != nil {
		return nil, fmt.Errorf("qmp decode %q: %w", q.r.Text(), err)
	}
	return msg, nil
}

func (q *qmp) greeting() error {
	for {
		msg, err := q.next()
		if err != nil {
			return err
		}
		if _, ok := msg["QMP"]; ok {
			return nil
		}
		q.events = append(q.events, msg)
	}
}

func (q *qmp) execute(command string) error {
	if _, err := fmt.Fprintf(q.w, "{\"execute\": %q}\n", command); err != nil {
		return fmt.Errorf("qmp %s: %w", command, err)
	}
	for {
		msg, err := q.next()
		if err != nil {
			return fmt.Errorf("qmp %s: %w", command, err)
		}
		if _, ok := msg["return"]; ok {
			return nil
		}
		if e, ok := msg["error"]; ok {
			return fmt.Errorf("qmp %s: %v", command, e)
		}
		q.events = append(q.events, msg)
	}
}

// drain keeps the events up to EOF (or the connection deadline).
func (q *qmp) drain() {
	for {
		msg, err := q.next()
		if err != nil {
			return
		}
		q.events = append(q.events, msg)
	}
}

func (q *qmp) sawGuestShutdown() bool {
	for _, ev := range q.events {
		if ev["event"] != "SHUTDOWN" {
			continue
		}
		if data, ok := ev["data"].(map[string]any); ok && data["guest"] == true {
			return true
		}
	}
	return false
}
