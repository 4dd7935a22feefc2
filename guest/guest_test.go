package guest_test

import (
	"context"
	"fmt"
	"log/slog"
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
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
)

const (
	buildTimeout = 5 * time.Minute  // a first build downloads ~27 MB and compiles the init
	upTimeout    = 60 * time.Second // TCG boot to the init is ~3-4 s here
	exitTimeout  = 30 * time.Second
)

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestPowerButtonPowersOff boots the real guest under TCG (a Linux guest
// hangs after "Probing EDD" under this machine's nested KVM), waits for the
// init to be up, presses the ACPI power button over QMP and demands that
// QEMU exits by itself, status 0, after the init said it powers off. With
// no network parameter the init sets up no network; with a malformed one
// it says so and the power button still works.
func TestPowerButtonPowersOff(t *testing.T) {
	for _, tc := range []struct {
		name, extra string
		netError    string // the start of the net error line expected, "" for none
	}{
		{name: "no network"},
		{name: "malformed network parameter", extra: " " + guest.NetParam + "=10.88.0.2,10.88.0.1",
			netError: guest.NetErrorPrefix + guest.NetParam + "="},
		// The parameter without a NIC: the init gives up on eth0 after its
		// bound and the power button still works.
		{name: "network parameter without a NIC", extra: " " + guest.NetParam + "=10.88.0.2/24,10.88.0.1",
			netError: guest.NetErrorPrefix + "no interface eth0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := bootGuest(t, bootOptions{Cmdline: guest.KernelCmdline + tc.extra})
			g.waitLine(t, guest.UpLine, upTimeout)
			upAfter := time.Since(g.spawned)
			if tc.netError != "" {
				g.waitLine(t, tc.netError, upTimeout)
			}
			exitAfter := g.powerOff(t)

			out := g.serial()
			assert.Contains(t, out, guest.PowerOffLine)
			assert.NotContains(t, out, guest.FatalPrefix)
			assert.NotContains(t, out, "Kernel panic")
			assert.NotContains(t, out, guest.NetUpPrefix)
			if tc.netError == "" {
				assert.NotContains(t, out, guest.NetErrorPrefix)
			}
			t.Logf("kernel %s %s: spawn→%q %s, system_powerdown→QEMU reaped %s",
				g.artifacts.KernelPackage, g.artifacts.KernelVersion, guest.UpLine,
				upAfter.Round(time.Millisecond), exitAfter.Round(time.Millisecond))
		})
	}
}

// bootOptions say how bootGuest starts QEMU.
type bootOptions struct {
	Machine string   // "" is q35
	Cmdline string   // the kernel command line
	Args    []string // more QEMU arguments (a NIC)
	Files   []*os.File
}

// booted is a real guest running under QEMU for one test.
type booted struct {
	artifacts build.Artifacts
	cmd       *exec.Cmd
	logPath   string
	sock      string
	stderr    string
	spawned   time.Time
	exited    chan struct{}
	waitErr   error
}

// bootGuest builds the guest and starts it under TCG with its serial
// console in a file; the QEMU is killed and reaped when the test ends.
func bootGuest(t *testing.T, o bootOptions) *booted {
	t.Helper()
	qemu := vmmtest.RequiresQEMU(t)
	a := buildGuest(t)
	if o.Machine == "" {
		o.Machine = "q35"
	}
	// A short path without commas: QEMU's option syntax would split the
	// socket path at a comma (subtest names have them), and a unix socket
	// path holds at most 107 bytes.
	dir := proctest.ShortDir(t, "vmguest-")
	g := &booted{artifacts: a, logPath: filepath.Join(dir, "qemu.log"), sock: filepath.Join(dir, "qmp.sock"),
		stderr: filepath.Join(dir, "qemu.stderr"), exited: make(chan struct{})}
	stderr, err := os.Create(g.stderr)
	require.NoError(t, err)
	defer stderr.Close()

	args := []string{
		"-machine", o.Machine, "-accel", "tcg", "-m", "256",
		"-nodefaults", "-display", "none", "-no-reboot",
		"-serial", "file:" + g.logPath,
		"-kernel", a.Kernel, "-initrd", a.Initrd, "-append", o.Cmdline,
		"-qmp", "unix:" + g.sock + ",server=on,wait=off",
	}
	g.cmd = exec.Command(qemu, append(args, o.Args...)...)
	g.cmd.Stderr = stderr
	g.cmd.ExtraFiles = o.Files
	g.spawned = time.Now()
	require.NoError(t, g.cmd.Start())
	go func() {
		g.waitErr = g.cmd.Wait()
		close(g.exited)
	}()
	// Whatever happens below, no QEMU outlives the test.
	t.Cleanup(func() {
		select {
		case <-g.exited:
		default:
			_ = g.cmd.Process.Kill()
			<-g.exited
		}
	})
	return g
}

func (g *booted) serial() string {
	out, _ := os.ReadFile(g.logPath)
	return string(out)
}

// diag is the tail of the serial console and QEMU's stderr, for failures.
func (g *booted) diag() string {
	errOut, _ := os.ReadFile(g.stderr)
	return fmt.Sprintf("\n--- qemu.log (tail) ---\n%s\n--- stderr ---\n%s", tail(g.serial(), 2000), errOut)
}

func (g *booted) waitLine(t *testing.T, line string, timeout time.Duration) {
	t.Helper()
	require.NoError(t, waitForLine(g.logPath, line, g.exited, timeout), g.diag())
}

// powerOff presses the power button over QMP and demands that QEMU exits
// by itself with status 0, the guest having caused the shutdown; it
// returns how long that took.
func (g *booted) powerOff(t *testing.T) time.Duration {
	t.Helper()
	qctx, qcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer qcancel()
	mon, err := vmm.DialQMP(qctx, g.sock)
	require.NoError(t, err, g.diag())
	defer mon.Close()
	pressed := time.Now()
	require.NoError(t, mon.SystemPowerdown(qctx), g.diag())

	select {
	case <-g.exited:
	case <-time.After(exitTimeout):
		t.Fatalf("QEMU still running %s after system_powerdown%s", exitTimeout, g.diag())
	}
	took := time.Since(pressed)
	require.NoError(t, g.waitErr, "QEMU exit status%s", g.diag())
	assert.Equal(t, 0, g.cmd.ProcessState.ExitCode())

	// The monitor closes when QEMU exits: the stream up to then holds the
	// SHUTDOWN event, which says the guest (not the host) ended it.
	select {
	case <-mon.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("QMP connection still open after QEMU exited")
	}
	assert.True(t, sawGuestShutdown(mon), "no SHUTDOWN event with guest=true")
	return took
}

// TestBuildResolvesNetworkModules checks the real package's module set:
// the virtio NIC drivers of both machine types and everything they
// depend on, each after its dependencies.
func TestBuildResolvesNetworkModules(t *testing.T) {
	a := buildGuest(t)
	index := map[string]int{}
	for i, m := range a.Modules {
		index[m] = i
	}
	for _, m := range []string{"button", "evdev", "virtio_pci", "virtio_mmio", "virtio_net"} {
		assert.Contains(t, index, m, "root module in %v", a.Modules)
	}
	// Module dependencies of Debian's 6.1 cloud kernel (its depends= fields).
	for _, dep := range [][2]string{
		{"virtio_ring", "virtio"}, {"virtio", "virtio_pci"}, {"virtio_pci_modern_dev", "virtio_pci"},
		{"virtio_pci_legacy_dev", "virtio_pci"}, {"virtio", "virtio_mmio"}, {"virtio", "virtio_net"},
		{"failover", "net_failover"}, {"net_failover", "virtio_net"},
	} {
		if _, ok := index[dep[0]]; !ok {
			t.Errorf("dependency %s of %s missing from %v", dep[0], dep[1], a.Modules)
			continue
		}
		assert.Less(t, index[dep[0]], index[dep[1]], "%s loads before %s", dep[0], dep[1])
	}
	t.Logf("modules in load order: %v", a.Modules)
}

// buildGuest builds (or reuses) the guest, skipping where Debian's package
// tools are missing.
func buildGuest(t *testing.T) build.Artifacts {
	t.Helper()
	for _, tool := range []string{"apt-get", "apt-cache", "dpkg-deb"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("guest build needs %s: %v", tool, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	a, err := build.Build(ctx, build.Options{Log: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	require.NoError(t, err)
	return a
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

// sawGuestShutdown reads the events mon holds for a SHUTDOWN that the guest
// caused.
func sawGuestShutdown(mon *vmm.Monitor) bool {
	// The monitor keeps events as bytes and decodes them into Events from
	// a goroutine of its own once Events is first read: what it kept
	// arrives shortly, not at once, so the wait has a deadline, not a
	// default case.
	deadline := time.After(5 * time.Second)
	for {
		select {
		case ev := <-mon.Events():
			if ev.Event == "SHUTDOWN" && ev.Data["guest"] == true {
				return true
			}
		case <-deadline:
			return false
		}
	}
}
