package vmm

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
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

// stageEnv makes the re-executed test binary a stage of a launch:
// "wrapper" waits for a line on stdin, then execs what follows "--" as
// prlimit does (as stage "qemu"); "qemu" runs until stdin closes.
const stageEnv = "VMFLOW_VMM_TEST_STAGE"

func runStage(stage string) {
	switch stage {
	case "wrapper":
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		i := slices.Index(os.Args, "--")
		if i < 0 || i+1 >= len(os.Args) {
			fmt.Fprintln(os.Stderr, "wrapper stage: no command after --")
			os.Exit(2)
		}
		err := syscall.Exec(os.Args[i+1], os.Args[i+1:], []string{stageEnv + "=qemu"})
		fmt.Fprintln(os.Stderr, "wrapper stage:", err)
		os.Exit(2)
	case "qemu":
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}
}

// stagedProc is a stage helper started as uid in a session of its own; a
// line on stdin lets a wrapper exec.
type stagedProc struct {
	child *proc.Child
	stdin io.WriteCloser
}

func startStage(t *testing.T, uid uint32, stage, bin string, args ...string) stagedProc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = []string{stageEnv + "=" + stage}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	c, err := proc.Start(cmd)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = proc.Signal(c.Identity(), syscall.SIGKILL)
		<-c.Done()
	})
	return stagedProc{child: c, stdin: stdin}
}

// waitExec waits until pid has exec'd bin: its exe, comm and argv[0] are bin's.
func waitExec(pid int, bin string) error {
	dir := "/proc/" + strconv.Itoa(pid)
	deadline := time.Now().Add(10 * time.Second)
	for {
		exe, _ := os.Readlink(dir + "/exe")
		comm, _ := os.ReadFile(dir + "/comm")
		argv, _ := os.ReadFile(dir + "/cmdline")
		if exe == bin && strings.TrimSpace(string(comm)) == proc.CommOf(bin) && strings.HasPrefix(string(argv), bin+"\x00") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pid %d never exec'd %s: exe %q, comm %q", pid, bin, exe, comm)
		}
		time.Sleep(time.Millisecond) // polling /proc: there is no event for an exec
	}
}

// A launch is the rlimit wrapper (prlimit, the same uid and argv with the
// guest name) until it execs QEMU, with the same pid and start time.
// FindUnrecorded finds it once whenever that exec happens: between the
// scans (here while the QEMU scan reads a decoy's cmdline, after it passed
// the launch as a wrapper), or while a scan reads the launch's own cmdline.
// Looking for QEMU before the wrapper missed it in the first case: a QEMU
// that ran was taken for none and its launch marker cleared.
func TestFindUnrecordedFollowsTheLaunchAcrossExec(t *testing.T) {
	requiresRoot(t)
	dir := testDir(t)
	require.NoError(t, os.Chmod(dir, 0o755)) // the stages' uid execs from it
	self, err := os.ReadFile(os.Args[0])
	require.NoError(t, err)
	wrapper, qemu := filepath.Join(dir, LimitWrapper), filepath.Join(dir, "qemu-stage")
	for _, p := range []string{wrapper, qemu} {
		require.NoError(t, os.WriteFile(p, self, 0o755)) // copies: exe is matched by inode
	}
	t.Setenv("PATH", dir+":"+os.Getenv("PATH")) // FindUnrecorded's wrapper is PATH's prlimit

	for _, tc := range []struct {
		name     string
		onDecoy  bool // released on the decoy's read, else on the launch's own
		released string
	}{
		{"exec between the scans", true, "the QEMU scan's read of the decoy"},
		{"exec during the launch's read", false, "the read of the launch's cmdline"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			uid := testUID()
			var launch, decoy stagedProc
			// /proc is scanned in name order: the decoy must come after the
			// launch, so the QEMU scan has passed the launch when the
			// decoy's read lets it exec. Only pids across a digit-count
			// boundary (9999, 10000) are out of that order: start again.
			for try := 0; ; try++ {
				launch = startStage(t, uid, "wrapper", wrapper, "--nofile=64:64", "--", qemu, "-name", "guest=vm1")
				decoy = startStage(t, uid, "qemu", qemu, "-name", "guest=other")
				if strconv.Itoa(launch.child.Identity().PID) < strconv.Itoa(decoy.child.Identity().PID) {
					break
				}
				require.Less(t, try, 5, "pids never came in name order")
			}
			trigger := launch.child.Identity().PID
			if tc.onDecoy {
				trigger = decoy.child.Identity().PID
			}
			var once sync.Once
			var fired error = errors.New("never released")
			readMem := func(path string) ([]byte, error) {
				if path == "/proc/"+strconv.Itoa(trigger)+"/cmdline" {
					once.Do(func() {
						if _, fired = io.WriteString(launch.stdin, "go\n"); fired == nil {
							fired = waitExec(launch.child.Identity().PID, qemu)
						}
					})
				}
				return os.ReadFile(path)
			}
			ids, err := FindUnrecorded(ctxT(t, 20*time.Second), FindConfig{Binary: qemu, Paths: Paths{QMPSocket: "unused"},
				UID: uid, Name: "vm1", ReadMem: readMem})
			require.NoError(t, err)
			require.NoError(t, fired, "released on %s", tc.released)
			assert.Equal(t, []proc.Identity{launch.child.Identity()}, ids, "released on %s", tc.released)
		})
	}
}
