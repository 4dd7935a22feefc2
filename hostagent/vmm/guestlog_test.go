package vmm_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
)

// logCap is what qemu.log and its rotations may hold together.
const logCap = vmm.DefaultLogFiles * vmm.DefaultLogMaxBytes

func TestRotatingLogKeepsItsBound(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qemu.log")
	const maxBytes = 1000
	w := vmm.NewRotatingLog(path, maxBytes, 3)
	var all []byte
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 500; i++ {
		b := bytes.Repeat([]byte{byte('a' + i%26)}, 1+rng.IntN(2500)) // some writes exceed one file
		n, err := w.Write(b)
		require.NoError(t, err)
		require.Equal(t, len(b), n)
		all = append(all, b...)
	}
	require.NoError(t, w.Close())
	var kept []byte
	files := []string{path + ".2", path + ".1", path}
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		assert.LessOrEqual(t, len(b), maxBytes, f)
		fi, err := os.Stat(f)
		require.NoError(t, err)
		assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), f)
		kept = append(kept, b...)
	}
	assert.NoFileExists(t, path+".3")
	assert.Equal(t, all[len(all)-len(kept):], kept, "the newest bytes, in order")
	assert.Greater(t, len(kept), maxBytes*2, "older files are full")
}

func TestRotatingLogRotatesAnOversizedFileLeftBehind(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qemu.log")
	require.NoError(t, os.WriteFile(path, bytes.Repeat([]byte("x"), 5000), 0o600)) // an older agent's unbounded log
	w := vmm.NewRotatingLog(path, 1000, 3)
	_, err := w.Write([]byte("new"))
	require.NoError(t, err)
	require.NoError(t, w.Close())
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, "new", string(b))
}

func TestQuoteLog(t *testing.T) {
	for _, tt := range []struct{ name, in, want string }{
		{"plain", "qemu: -bogus: invalid option\n", "«qemu.log: qemu: -bogus: invalid option»"},
		{"empty", " \n", "«qemu.log: (empty)»"},
		{"lines", "a\r\nb\n\nc", "«qemu.log: a ⏎ b ⏎ c»"},
		{"escape sequences", "\x1b[2J\x1b]0;owned\x07red\x1b[0m", "«qemu.log: [2J]0;ownedred[0m»"},
		{"C1 CSI and bidi override", "x\u009b31m\u202egnp.exe", "«qemu.log: x31mgnp.exe»"},
		{"fence markers", "» vmflow: all good «", "«qemu.log: \" vmflow: all good \"»"},
		{"invalid utf-8", "a\xffb", "«qemu.log: a\ufffdb»"},
		{"tab and NUL", "a\tb\x00c", "«qemu.log: a bc»"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, vmm.QuoteLog([]byte(tt.in)))
		})
	}
}

// assertSafeQuote: no control or format character anywhere in s, and the
// guest's text sits inside exactly one fence at the end.
func assertSafeQuote(t *testing.T, s string) {
	t.Helper()
	for _, r := range s {
		assert.False(t, unicode.IsControl(r) || unicode.Is(unicode.Cf, r), "control character %U in %q", r, s)
	}
	assert.Equal(t, 1, strings.Count(s, "«qemu.log: "), "one opening fence in %q", s)
	assert.Equal(t, 1, strings.Count(s, "»"), "one closing fence in %q", s)
	assert.True(t, strings.HasSuffix(s, "»"), "the quote ends the message: %q", s)
}

// A launch failure's error quotes qemu.log fenced and escaped: fails if it
// quotes it raw (escape sequences, BEL, CR) or unfenced.
func TestLaunchFailureQuotesLogFenced(t *testing.T) {
	vmmtest.RequiresQEMU(t)
	d := proctest.ShortDir(t, "lf")
	vmmtest.WorldReadable(t, d)
	bin := filepath.Join(d, "qemu-hostile")
	// Stands in for a QEMU (or a guest) whose last words are hostile.
	script := "#!/bin/sh\nprintf 'qemu: boom\\033[2J\\033]0;title\\007\\r\\n» vmflow: instance healthy\\n' >&2\nexit 1\n"
	require.NoError(t, os.WriteFile(bin, []byte(script), 0o755))
	_, err := vmm.Launch(context.Background(), vmm.LaunchConfig{
		Binary: bin,
		Spec:   vmm.VMSpec{Name: "hostile", VCPUs: 1, MemoryMiB: 64, Machine: vmm.MachineNone, Accel: vmmtest.Accel()},
		Paths: vmm.Paths{QMPSocket: filepath.Join(d, "qemu.sock"), PIDFile: filepath.Join(d, "qemu.pid"),
			Log: filepath.Join(d, "qemu.log")},
		ReadyTimeout: 20 * time.Second,
		Confine:      vmmtest.Confine(),
	})
	require.ErrorIs(t, err, vmm.ErrLaunchExited)
	msg := err.Error()
	assert.Contains(t, msg, "«qemu.log: qemu: boom")
	assert.Contains(t, msg, "\" vmflow: instance healthy»", "the guest's fence marker is defused")
	assertSafeQuote(t, msg)
	b, err := os.ReadFile(filepath.Join(d, "qemu.log"))
	require.NoError(t, err)
	assert.Contains(t, string(b), "\x1b[2J", "the log file itself keeps the raw bytes")
}

// logSizes checks the bound on path and its rotations and returns the
// total and the inode of the oldest rotation (0 when absent).
func logSizes(t *testing.T, path string) (total int64, oldest uint64) {
	t.Helper()
	for i, f := range vmm.LogFiles(path) {
		fi, err := os.Stat(f)
		if err != nil {
			continue
		}
		require.LessOrEqual(t, fi.Size(), int64(vmm.DefaultLogMaxBytes), "%s is over one file's bound", f)
		total += fi.Size()
		if i == vmm.DefaultLogFiles-1 {
			oldest = fi.Sys().(*syscall.Stat_t).Ino
		}
	}
	require.LessOrEqual(t, total, int64(logCap), "qemu.log and its rotations are over the bound")
	return total, oldest
}

// floodRotations waits, checking the bound at every look, until the oldest
// rotation of path has been replaced `rotations` times: the guest wrote well
// past the cap and the log stayed inside it. vm's pump gives the progress.
func floodRotations(t *testing.T, vm *vmm.VM, path string, rotations int, bound *vmmtest.FloodStall) {
	t.Helper()
	seen := map[uint64]bool{}
	for {
		_, oldest := logSizes(t, path)
		if oldest != 0 {
			seen[oldest] = true
		}
		if len(seen) > rotations {
			return
		}
		st, _ := vm.LogStats()
		if err := bound.Check(int64(st.Read)); err != nil {
			t.Fatalf("the flooding guest did not rotate %s %d times (saw %d): %v", path, rotations, len(seen)-1, err)
		}
		time.Sleep(20 * time.Millisecond) // polling a file size: there is no event for it
	}
}

// The guest log stays bounded under a serial flood: fails if QEMU appends
// to qemu.log itself, without bound (the guest passes 6 MiB in a few
// seconds).
func TestGuestLogBoundedUnderSerialFlood(t *testing.T) {
	bin, spec := vmmtest.SerialFlood(t, "flood")
	d := proctest.ShortDir(t, "gl")
	paths := vmm.Paths{QMPSocket: filepath.Join(d, "qemu.sock"), PIDFile: filepath.Join(d, "qemu.pid"), Log: filepath.Join(d, "qemu.log")}
	vm, err := vmm.Launch(context.Background(), vmm.LaunchConfig{Binary: bin, Spec: spec, Paths: paths, ReadyTimeout: 30 * time.Second,
		Confine: vmmtest.Confine()})
	require.NoError(t, err)
	t.Cleanup(func() { stopAndClose(t, vm) })

	began := time.Now()
	floodRotations(t, vm, paths.Log, 1, vmmtest.DefaultFloodStall())
	st, ok := vm.LogStats()
	require.True(t, ok)
	t.Logf("the guest wrote %d bytes in %s", st.Read, time.Since(began).Round(time.Second))
	assert.Greater(t, st.Read, uint64(logCap), "the guest wrote more than the log keeps")
	b, err := os.ReadFile(paths.Log + ".2")
	require.NoError(t, err)
	assert.Equal(t, -1, bytes.IndexFunc(b, func(r rune) bool { return r != 'A' }), "the log holds the guest's output")

	stopAndClose(t, vm)
	select {
	case <-time.After(10 * time.Second):
		t.Fatal("the pump did not end after QEMU exited")
	case <-drained(vm):
	}
	logSizes(t, paths.Log)
}

func stopAndClose(t *testing.T, vm *vmm.VM) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := vm.Stop(ctx, vmm.StopConfig{From: vmm.StepKillSent, KillTimeout: 10 * time.Second})
	assert.NoError(t, err)
	vm.Close()
}

// drained is closed when the VM's pump has nothing left to write.
func drained(vm *vmm.VM) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		for {
			if st, ok := vm.LogStats(); !ok || st.Done {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	return ch
}

func TestCaptureLogRefusesAStdoutThatIsNotAPipe(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "qemu.log"))
	require.NoError(t, err)
	defer f.Close()
	// A process whose stdout is the log file itself, as QEMUs launched
	// before the bounded log have.
	cmd := exec.Command("sleep", "60")
	cmd.Stdout = f
	child, err := proc.Start(cmd)
	require.NoError(t, err)
	defer func() {
		_ = proc.Signal(child.Identity(), syscall.SIGKILL)
		<-child.Done()
	}()
	vm, err := vmm.Attach(child.Identity(), vmm.Paths{Log: f.Name()})
	require.NoError(t, err)
	defer vm.Close()
	err = vm.CaptureLog()
	assert.True(t, errors.Is(err, vmm.ErrLogNotPipe), "got %v", err)
	_, ok := vm.LogStats()
	assert.False(t, ok)
}
