package vmm

import (
	"bytes"
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
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc"
)

// FindUnrecorded finds a launched QEMU by the nonce it was given, or (no
// nonce: a record from an older agent) by the -qmp argument Argv wrote, and
// only for exactly that socket path (a comma in the path is escaped both
// ways).
func TestFindUnrecorded(t *testing.T) {
	requiresQEMU(t)
	cfg := testLaunchConfig(t, "find")
	// A comma exercises the QemuOpts escaping Argv applies.
	dir := filepath.Dir(cfg.Paths.QMPSocket)
	cfg.Paths.QMPSocket = filepath.Join(dir, "q,emu.sock")
	nonce, err := NewLaunchNonce()
	require.NoError(t, err)
	require.Len(t, nonce, 32)
	cfg.Nonce = nonce
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)

	env, err := os.ReadFile("/proc/" + itoa(vm.Identity().PID) + "/environ")
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"PATH=" + os.Getenv("PATH"), "HOME=/", LaunchNonceEnv + "=" + nonce},
		strings.Split(string(bytes.TrimSuffix(env, []byte{0})), "\x00"), "QEMU gets a minimal environment, never the agent's")

	find := func(c FindConfig) []proc.Identity {
		t.Helper()
		ids, err := FindUnrecorded(ctxT(t, 10*time.Second), c)
		require.NoError(t, err)
		return ids
	}
	assert.Equal(t, []proc.Identity{vm.Identity()}, find(FindConfig{Paths: cfg.Paths, Nonce: nonce}), "by its nonce, with its identity")
	other, err := NewLaunchNonce()
	require.NoError(t, err)
	assert.Empty(t, find(FindConfig{Paths: cfg.Paths, Nonce: other}), "another launch's nonce")
	assert.Equal(t, []proc.Identity{vm.Identity()}, find(FindConfig{Paths: cfg.Paths}), "legacy: by its socket argument")
	assert.Empty(t, find(FindConfig{Paths: Paths{QMPSocket: filepath.Join(dir, "q"), PIDFile: cfg.Paths.PIDFile}}),
		"a prefix of the path is another instance")
	assert.Empty(t, find(FindConfig{Paths: Paths{QMPSocket: strings.TrimSuffix(cfg.Paths.QMPSocket, ".sock") + ".sock2"}}))
	sleep, err := exec.LookPath("sleep")
	require.NoError(t, err)
	assert.Empty(t, find(FindConfig{Binary: sleep, Paths: cfg.Paths, Nonce: nonce}), "another binary")
}

// A command line is not an identity. Copies of an instance's QEMU command
// line started by someone else (a debugging wrapper `timeout 600 qemu ...`,
// a second QEMU in a session of its own) are never found by the nonce, and
// the legacy search, which has only the command line, skips what is not
// the QEMU binary or not a session leader.
func TestFindUnrecordedIgnoresImpostors(t *testing.T) {
	qemu := requiresQEMU(t)
	cfg := testLaunchConfig(t, "impostor")
	nonce, err := NewLaunchNonce()
	require.NoError(t, err)
	argv, err := Argv(cfg.Spec, cfg.Paths)
	require.NoError(t, err)

	// `timeout 600 qemu <argv>`: timeout leads the session, QEMU does not.
	wrapper := exec.Command("timeout", append([]string{"600", qemu}, argv...)...)
	wrapper.Env = []string{"PATH=" + os.Getenv("PATH")}
	wc, err := proc.Start(wrapper)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = syscall.Kill(-wc.Identity().PID, syscall.SIGKILL) // its whole process group
		<-wc.Done()
		// The wrapped QEMU, if it was reparented to this process: reap it.
		for {
			var ws unix.WaitStatus
			if _, err := unix.Wait4(-wc.Identity().PID, &ws, 0, nil); err != nil {
				return // ECHILD: none left (or not ours)
			}
		}
	})
	require.Eventually(t, func() bool {
		_, err := os.Stat(cfg.Paths.QMPSocket)
		return err == nil
	}, 20*time.Second, 10*time.Millisecond, "the wrapped QEMU runs and listens")

	ids, err := FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Paths: cfg.Paths, Nonce: nonce})
	require.NoError(t, err)
	assert.Empty(t, ids, "nonce search")
	ids, err = FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Paths: cfg.Paths})
	require.NoError(t, err)
	assert.Empty(t, ids, "legacy search: the wrapper is not QEMU and its QEMU does not lead a session")

	// The same command line as a session leader running the QEMU binary,
	// with a nonce of its own: still not found by the launch's nonce.
	copyCmd := exec.Command(qemu, argv...)
	copyCmd.Env = []string{"PATH=" + os.Getenv("PATH"), LaunchNonceEnv + "=" + strings.Repeat("0", 32)}
	cc, err := proc.Start(copyCmd)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = proc.Signal(cc.Identity(), syscall.SIGKILL)
		<-cc.Done()
	})
	ids, err = FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Paths: cfg.Paths, Nonce: nonce})
	require.NoError(t, err)
	assert.Empty(t, ids, "nonce search: a copied command line is not the launch")
	assert.True(t, proc.Inspect(cc.Identity()).Alive && proc.Inspect(wc.Identity()).Alive, "nothing was signalled")
}

func itoa(n int) string { return strconv.Itoa(n) }
