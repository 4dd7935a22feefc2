//go:build vmflow_crashpoints

package crashpoint

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// helperEnv switches the re-executed test binary into the helper: it hits
// LaunchForked three times and StopGone once, printing a line before each.
const helperEnv = "VMFLOW_CRASHPOINT_TEST_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		for i := 1; i <= 3; i++ {
			fmt.Printf("before %s #%d\n", LaunchForked, i)
			Hit(LaunchForked)
		}
		fmt.Printf("before %s #1\n", StopGone)
		Hit(StopGone)
		fmt.Println("survived")
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func runHelper(t *testing.T, spec string) (stdout, stderr string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1", EnvVar+"="+spec)
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

func killedBySIGKILL(t *testing.T, err error) {
	t.Helper()
	var ee *exec.ExitError
	require.True(t, errors.As(err, &ee), "the helper exited abnormally: %v", err)
	ws, ok := ee.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled(), "killed by a signal, not exit: %v", ws)
	assert.Equal(t, syscall.SIGKILL, ws.Signal())
}

func TestHitKillsAtTheArmedHit(t *testing.T) {
	for _, tc := range []struct {
		spec     string
		lastLine string // the last line printed before the kill
	}{
		{LaunchForked, "before " + LaunchForked + " #1"},
		{LaunchForked + "@2", "before " + LaunchForked + " #2"},
		{LaunchForked + "@3", "before " + LaunchForked + " #3"},
		{StopGone, "before " + StopGone + " #1"},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			out, errOut, err := runHelper(t, tc.spec)
			killedBySIGKILL(t, err)
			lines := strings.Split(strings.TrimSpace(out), "\n")
			assert.Equal(t, tc.lastLine, lines[len(lines)-1], "died at the armed hit and not before")
			name, _, _ := strings.Cut(tc.spec, "@")
			assert.Equal(t, "crashpoint "+name+": SIGKILL\n", errOut)
		})
	}
}

func TestHitUnarmedOrNeverReached(t *testing.T) {
	for _, spec := range []string{"", LaunchForked + "@4", StopGone + "@2", AgentReattached} {
		t.Run("spec="+spec, func(t *testing.T) {
			out, errOut, err := runHelper(t, spec)
			require.NoError(t, err, "stderr: %s", errOut)
			assert.Contains(t, out, "survived")
			assert.Empty(t, errOut)
		})
	}
}

func TestMalformedSpecArmsNothingAndSaysSo(t *testing.T) {
	for _, spec := range []string{"no.such.point", LaunchForked + "@0", LaunchForked + "@x"} {
		t.Run(spec, func(t *testing.T) {
			out, errOut, err := runHelper(t, spec)
			require.NoError(t, err)
			assert.Contains(t, out, "survived")
			assert.Contains(t, errOut, "crashpoint: "+EnvVar)
		})
	}
}
