package stacktest

import (
	"fmt"
	"os/exec"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
)

// errorsTB records Errorf instead of failing: the leftovers KillUIDRange
// reports are what this test expects.
type errorsTB struct {
	testing.TB
	errs []string
}

func (e *errorsTB) Errorf(format string, args ...any) {
	e.errs = append(e.errs, fmt.Sprintf(format, args...))
}

// A process of the agent's uid range still alive at the end of a test is
// reported and killed; a range nothing runs in reports nothing.
func TestKillUIDRange(t *testing.T) {
	r := QEMUUIDRange()
	cmd := exec.Command("sleep", "600")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: r.First, Gid: r.First}}
	child, err := proc.Start(cmd)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proc.Signal(child.Identity(), syscall.SIGKILL); <-child.Done() })

	rec := &errorsTB{TB: t}
	KillUIDRange(rec, r)
	require.Len(t, rec.errs, 1, "%q", rec.errs)
	assert.Contains(t, rec.errs[0], "still running")
	<-child.Done()
	assert.False(t, proc.Inspect(child.Identity()).Alive)

	rec = &errorsTB{TB: t}
	KillUIDRange(rec, QEMUUIDRange())
	assert.Empty(t, rec.errs)
}
