package stacktest

import (
	"context"
	"syscall"
	"testing"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
)

// KillLeftoverVMs kills, by verified identity, every QEMU a record in st
// still names, and waits until it is gone; each one it finds is a test
// error. Run it after the host agent has stopped (register it as a cleanup
// before the agent's own): such a QEMU is then this process's child, which
// the subreaper's reaper reaps. adopt, when not nil, is told the pid first,
// for a reaper that takes only the pids it was given.
func KillLeftoverVMs(t testing.TB, st *store.Store, adopt func(pid int)) {
	recs, err := st.List()
	if err != nil {
		t.Errorf("list records: %v", err)
		return
	}
	for _, r := range recs {
		p := r.GetProcess()
		if p == nil {
			continue
		}
		id := store.IdentityOf(p)
		if !proc.Inspect(id).Alive {
			continue
		}
		t.Errorf("instance %s: QEMU %v still running at the end of the test; killing it", r.GetId(), id)
		if adopt != nil {
			adopt(id.PID)
		}
		if err := proc.Signal(id, syscall.SIGKILL); err != nil {
			t.Errorf("kill leftover QEMU %v: %v", id, err)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := PollUntil(ctx, 20*time.Millisecond, func() bool { return !proc.Inspect(id).Alive }); err != nil {
			t.Errorf("leftover QEMU %v: %v", id, err)
		}
		cancel()
	}
}
