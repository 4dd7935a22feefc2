package vmm

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
)

// legacyQMPArg is the -qmp value agents before the QMP fd gave QEMU for a
// socket path: what a decoy copies.
func legacyQMPArg(socket string) string { return "unix:" + optValue(socket) + ",server=on,wait=off" }

// FindUnrecorded finds a launched QEMU by its uid and guest name (its
// environment is minimal and carries no nonce), and only with both. A legacy
// marker's nonce (records older agents left) still finds the QEMU an older
// agent started. A record with neither is never matched by its -qmp
// argument: a decoy with the instance's command line, the QEMU binary and a
// session of its own would otherwise be found (and then adopted and
// SIGKILLed by the agent).
func TestFindUnrecorded(t *testing.T) {
	qemu := requiresQEMU(t)
	requiresRoot(t)
	cfg := testLaunchConfig(t, "find")
	vm, err := Launch(ctxT(t, 30*time.Second), cfg)
	require.NoError(t, err)
	killOnCleanup(t, vm)

	find := func(c FindConfig) []proc.Identity {
		t.Helper()
		ids, err := FindUnrecorded(ctxT(t, 10*time.Second), c)
		require.NoError(t, err)
		return ids
	}
	uid := cfg.Confine.UID
	assert.Equal(t, []proc.Identity{vm.Identity()}, find(FindConfig{Paths: cfg.Paths, UID: uid, Name: "find"}), "by uid and name, with its identity")
	assert.Empty(t, find(FindConfig{Paths: cfg.Paths, UID: uid + 1, Name: "find"}), "another instance's uid")
	assert.Empty(t, find(FindConfig{Paths: cfg.Paths, UID: uid, Name: "fin"}), "another name")
	_, err = FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Paths: cfg.Paths, UID: uid})
	assert.Error(t, err, "a uid search needs the name")
	sleep, err := exec.LookPath("sleep")
	require.NoError(t, err)
	assert.Empty(t, find(FindConfig{Binary: sleep, Paths: cfg.Paths, UID: uid, Name: "find"}), "another binary")

	// A QEMU an older agent started: root, -qmp on the socket path (with
	// a comma, which QemuOpts escaping doubles), the nonce in its
	// environment.
	dir := filepath.Dir(cfg.Paths.QMPSocket)
	legacy := Paths{QMPSocket: filepath.Join(dir, "q,emu.sock")}
	nonce := strings.Repeat("ab", 16)
	old := exec.Command(qemu, "-name", "guest=find", "-machine", "none", "-accel", string(testAccel()), "-nodefaults",
		"-no-user-config", "-display", "none", "-qmp", legacyQMPArg(legacy.QMPSocket))
	old.Env = []string{"PATH=" + os.Getenv("PATH"), LaunchNonceEnv + "=" + nonce}
	oc, err := proc.Start(old)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = proc.Signal(oc.Identity(), syscall.SIGKILL)
		<-oc.Done()
	})
	assert.Equal(t, []proc.Identity{oc.Identity()}, find(FindConfig{Paths: legacy, Nonce: nonce}), "legacy: by its nonce")
	assert.Empty(t, find(FindConfig{Paths: legacy, Nonce: strings.Repeat("cd", 16)}), "another launch's nonce")
	require.Eventually(t, func() bool {
		_, err := os.Stat(legacy.QMPSocket)
		return err == nil
	}, 20*time.Second, 10*time.Millisecond, "the decoy runs and listens")
	ids, err := FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Paths: legacy})
	assert.ErrorIs(t, err, ErrNoLaunchIdentity, "neither uid nor nonce: nothing is looked for")
	assert.Empty(t, ids, "a command line is no identity")
	assert.Equal(t, []proc.Identity{vm.Identity()}, find(FindConfig{Paths: cfg.Paths, UID: uid, Name: "find"}),
		"the root QEMU named find is not the uid's")
}

// A command line is not an identity. Copies of an instance's QEMU command
// line started by someone else are never found by the uid search: a
// debugging wrapper `timeout 600 qemu ...` run as the instance's uid (the
// wrapper is not QEMU, its QEMU does not lead a session), a second QEMU in
// a session of its own as root (another uid). The legacy search, which has
// only the command line, skips what is not the QEMU binary or not a session
// leader.
func TestFindUnrecordedIgnoresImpostors(t *testing.T) {
	qemu := requiresQEMU(t)
	requiresRoot(t)
	cfg := testLaunchConfig(t, "impostor")
	uid := cfg.Confine.UID
	argv := []string{"-name", "guest=impostor", "-machine", "none", "-accel", string(testAccel()), "-nodefaults",
		"-no-user-config", "-display", "none", "-qmp", legacyQMPArg(cfg.Paths.QMPSocket)}

	wrapper := exec.Command("timeout", append([]string{"600", qemu}, argv...)...)
	wrapper.Env = []string{"PATH=" + os.Getenv("PATH")}
	wrapper.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{cfg.Confine.KVM.GID}}}
	require.NoError(t, os.Chown(filepath.Dir(cfg.Paths.QMPSocket), int(uid), int(uid)))
	wc, err := proc.Start(wrapper)
	require.NoError(t, err)
	proctest.KillGroupOnCleanup(t, wc)
	require.Eventually(t, func() bool {
		_, err := os.Stat(cfg.Paths.QMPSocket)
		return err == nil
	}, 20*time.Second, 10*time.Millisecond, "the wrapped QEMU runs and listens")

	ids, err := FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Paths: cfg.Paths, UID: uid, Name: "impostor"})
	require.NoError(t, err)
	assert.Empty(t, ids, "uid search: the wrapper is not QEMU and its QEMU does not lead a session")
	ids, err = FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Paths: cfg.Paths})
	require.ErrorIs(t, err, ErrNoLaunchIdentity)
	assert.Empty(t, ids, "no search by command line at all")

	// The same command line as a session leader running the QEMU binary,
	// as root: not the instance's uid.
	copyCmd := exec.Command(qemu, append(argv[:len(argv)-2:len(argv)-2], "-qmp", legacyQMPArg(cfg.Paths.QMPSocket+"2"))...)
	copyCmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	cc, err := proc.Start(copyCmd)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = proc.Signal(cc.Identity(), syscall.SIGKILL)
		<-cc.Done()
	})
	require.Eventually(t, func() bool {
		_, err := os.Stat(cfg.Paths.QMPSocket + "2")
		return err == nil
	}, 20*time.Second, 10*time.Millisecond, "the copy runs")
	ids, err = FindUnrecorded(ctxT(t, 10*time.Second), FindConfig{Paths: cfg.Paths, UID: uid, Name: "impostor"})
	require.NoError(t, err)
	assert.Empty(t, ids, "uid search: a copied command line as another uid is not the instance's")
	assert.True(t, proc.Inspect(cc.Identity()).Alive && proc.Inspect(wc.Identity()).Alive, "nothing was signalled")
}
