// Package cli is vmflow-hostagent's command line: the dispatch (Main) and
// the read-only subcommands, so that main stays wiring and every command
// can be tested without building the binary. Its run subcommand is
// daemon/agent, which main hands to Main (hostagent/... never imports it).
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/internal/service"
)

// Exit codes of the subcommands: service's, and proc's own.
const (
	ExitOK       = service.ExitOK
	ExitError    = service.ExitError
	ExitUsage    = service.ExitUsage // also: (proc) no such pid
	ExitTimedOut = 3
)

// IO is where a command writes.
type IO struct {
	Stdout, Stderr io.Writer
}

const procHelp = `usage: vmflow-hostagent proc [--wait [--timeout D]] <pid>

Prints the liveness of pid's whole thread group as one JSON object:
  {"pid":N,"start_time":N,"boot_id":"...","state":"running|zombie-leader|exited|unknown","tasks":N,"alive":bool}
A zombie leader whose other tasks still run is alive; "unknown" (unreadable
/proc) counts as alive.

With --wait, blocks until the thread group is gone (through a pidfd; works
for processes that are not this one's children) and prints the final state.

exit status:
  0  printed (without --wait), or the group is gone (--wait; also when the pid
     was already gone)
  1  an error reading /proc or opening the pidfd
  2  usage error, or the pid does not exist (without --wait)
  3  --timeout passed with the group still alive
`

// Proc implements "vmflow-hostagent proc".
func Proc(ctx context.Context, args []string, out IO) int {
	fs := flag.NewFlagSet("proc", flag.ContinueOnError)
	fs.SetOutput(out.Stderr)
	fs.Usage = func() { fmt.Fprint(out.Stderr, procHelp) }
	wait := fs.Bool("wait", false, "block until the thread group is gone")
	timeout := fs.Duration("timeout", 0, "with --wait: give up after this long (0 = no limit)")
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK
		}
		return ExitUsage
	}
	if len(pos) != 1 {
		fs.Usage()
		return ExitUsage
	}
	pid, err := strconv.Atoi(pos[0])
	if err != nil || pid <= 0 {
		fmt.Fprintf(out.Stderr, "proc: %q is not a pid\n", pos[0])
		return ExitUsage
	}

	st, err := proc.InspectPID(pid)
	if errors.Is(err, proc.ErrNotFound) {
		printJSON(out.Stdout, st)
		if *wait {
			fmt.Fprintf(out.Stderr, "proc: pid %d does not exist: already gone\n", pid)
			return ExitOK
		}
		fmt.Fprintf(out.Stderr, "proc: pid %d does not exist\n", pid)
		return ExitUsage
	}
	if !*wait {
		printJSON(out.Stdout, st)
		return ExitOK
	}
	return procWait(ctx, st.Identity, *timeout, out)
}

func procWait(ctx context.Context, id proc.Identity, timeout time.Duration, out IO) int {
	h, err := proc.Open(id)
	if errors.Is(err, proc.ErrNotFound) || errors.Is(err, proc.ErrIdentityMismatch) {
		printJSON(out.Stdout, proc.Inspect(id))
		return ExitOK // gone between the two reads
	}
	if err != nil {
		fmt.Fprintf(out.Stderr, "proc: %v\n", err)
		return ExitError
	}
	defer h.Close()
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	if err := h.Wait(ctx); err != nil {
		printJSON(out.Stdout, h.Status())
		if errors.Is(err, context.DeadlineExceeded) {
			fmt.Fprintf(out.Stderr, "proc: pid %d still alive after %s\n", id.PID, timeout)
			return ExitTimedOut
		}
		fmt.Fprintf(out.Stderr, "proc: wait for pid %d: %v\n", id.PID, err)
		return ExitError
	}
	printJSON(out.Stdout, h.Status())
	return ExitOK
}

func printJSON(w io.Writer, st proc.Status) {
	b, _ := json.Marshal(st) // a Status always marshals
	fmt.Fprintln(w, string(b))
}
