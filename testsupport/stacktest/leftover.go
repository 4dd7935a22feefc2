package stacktest

import (
	"context"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
)

// KillLeftoverVMs kills by verified identity every QEMU a record in st still
// names, each a test error, and waits until gone. Register it before the
// agent's cleanup, so the QEMU is then this subreaper's; adopt is told each pid first.
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
		killAndWait(t, id)
	}
}

// killAndWait sends SIGKILL to the leftover id by its verified identity and
// waits (10 s at most) until it is gone, reporting what fails.
func killAndWait(t testing.TB, id proc.Identity) {
	if err := proc.Signal(id, syscall.SIGKILL); err != nil {
		t.Errorf("kill leftover %v: %v", id, err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := PollUntil(ctx, 20*time.Millisecond, func() bool { return !proc.Inspect(id).Alive }); err != nil {
		t.Errorf("leftover %v: %v", id, err)
	}
}

// KillUIDRange kills by verified identity every live process with a real uid
// in r, each a test error, and waits until gone: after the agent stopped, what
// KillLeftoverVMs missed (no record names it) is an orphan nobody else stops.
func KillUIDRange(t testing.TB, r store.UIDRange) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Errorf("scan processes: %v", err)
		return
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		uids, err := proc.ReadUIDs(pid)
		if err != nil || !r.Contains(uids[0]) {
			continue // gone meanwhile, or not of the range
		}
		id, err := proc.ReadIdentity(pid)
		if err != nil || !proc.Inspect(id).Alive {
			continue // exited meanwhile, or a zombie
		}
		t.Errorf("process %v of the agent's uid range %s still running at the end of the test; killing it", id, r)
		killAndWait(t, id)
	}
}
