package proctest

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// childAccel, when set, makes TestAccelChoice print Accel's choice for the
// probe it names and exit: each value of AccelEnv needs a process of its
// own, since the choice is made once per process.
const childAccel = "PROCTEST_ACCEL_CHILD"

// TestAccelChoice: VMFLOW_TEST_ACCEL=tcg forces TCG even where KVM is
// usable, =kvm demands KVM even where it is not, empty (or auto) follows
// the probe and the node, and a typo is refused, never taken for another
// accelerator.
func TestAccelChoice(t *testing.T) {
	if probe, ok := os.LookupEnv(childAccel); ok {
		var kvmUsable error
		if probe == "unusable" {
			kvmUsable = errors.New("stat /dev/kvm: no such file or directory")
		}
		os.Stdout.WriteString(Accel(kvmUsable) + " " + AccelReason() + "\n")
		os.Exit(0)
	}
	auto := "tcg"
	if KVMOpens() {
		auto = "kvm"
	}
	for _, c := range []struct{ env, probe, want string }{
		{"tcg", "usable", "tcg " + AccelEnv + "=tcg"},
		{"TCG", "usable", "tcg " + AccelEnv + "=tcg"},
		{"kvm", "unusable", "kvm " + AccelEnv + "=kvm"},
		{"", "unusable", "tcg stat /dev/kvm: no such file or directory"},
		{"auto", "unusable", "tcg stat /dev/kvm: no such file or directory"},
		{"", "usable", auto},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestAccelChoice$")
		cmd.Env = append(os.Environ(), childAccel+"="+c.probe, AccelEnv+"="+c.env)
		out, err := cmd.Output()
		require.NoError(t, err, "%s=%q", AccelEnv, c.env)
		assert.True(t, strings.HasPrefix(string(out), c.want), "%s=%q, probe %s: %q", AccelEnv, c.env, c.probe, out)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestAccelChoice$")
	cmd.Env = append(os.Environ(), childAccel+"=usable", AccelEnv+"=hvf")
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "a value that is no accelerator fails the run")
	assert.Contains(t, string(out), `VMFLOW_TEST_ACCEL="hvf": want tcg, kvm, auto or empty`)
}

func TestScaleDeadline(t *testing.T) {
	assert.Equal(t, 30*time.Second, ScaleDeadline("tcg", 10*time.Second))
	assert.Equal(t, 10*time.Second, ScaleDeadline("kvm", 10*time.Second))
}
