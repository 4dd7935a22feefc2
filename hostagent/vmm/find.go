package vmm

import (
	"context"
	"fmt"

	"vmflow/hostagent/proc"
)

// FindBySocket returns every process whose command line carries
// "-qmp <the value Argv writes for socket>": the QEMUs launched for that
// socket path, whether or not any record names them. A socket path belongs
// to one instance, so this finds the instance's QEMU after an agent died
// between the fork and recording the pid (ARCHITECTURE invariant 11).
//
// The pre-exec window: a child forked but not yet exec'd still shows its
// parent's (the agent's) command line and is not found. Callers close that
// window by scanning under the instance's store lock: the lock is an flock
// on a file the agent opened close-on-exec, and a forked child shares that
// open file, so the lock stays held until the child has exec'd QEMU (or
// died). Whoever holds the lock therefore sees QEMU's own command line or
// no child at all.
func FindBySocket(ctx context.Context, socket string) ([]proc.Identity, error) {
	want := qmpArg(socket)
	ids, err := proc.FindByCmdline(ctx, func(argv []string) bool {
		for i := 0; i+1 < len(argv); i++ {
			if argv[i] == "-qmp" && argv[i+1] == want {
				return true
			}
		}
		return false
	})
	if err != nil {
		return nil, fmt.Errorf("find qemu of %s: %w", socket, err)
	}
	return ids, nil
}
