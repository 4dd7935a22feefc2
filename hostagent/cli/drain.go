package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"vmflow/hostagent/store"
	"vmflow/internal/contract"
	"vmflow/internal/safetext"
)

const drainHelp = `usage: vmflow-hostagent drain --reason TEXT [--state-dir DIR]
       vmflow-hostagent undrain [--state-dir DIR]

drain keeps this host out of placement: the agent grants no new VM (a
spawn named to it, or placed on it, is refused HostDraining with the
reason, and placement moves on to another host) while its running VMs,
their restarts and deletes go on. The marker (<state-dir>/draining) is the
host's own, kept across agent restarts and reboots; the running agent
republishes its view (draining, with the reason) within seconds. A second
drain keeps the first one's reason and time. undrain removes it.
`

// Drain writes the drain marker in the state dir, under the admission
// lock a running agent's grants take, so a grant either came before it or
// is refused.
func Drain(ctx context.Context, args []string, out IO) int {
	fs := flag.NewFlagSet("drain", flag.ContinueOnError)
	fs.SetOutput(out.Stderr)
	fs.Usage = func() { fmt.Fprint(out.Stderr, drainHelp) }
	stateDir := fs.String("state-dir", contract.DefaultStateDir, "the agent's state directory (as given to run)")
	reason := fs.String("reason", "", "why the host takes no new VMs (required; shown in the fleet view and every refusal)")
	st, code := openForDrain(fs, args, stateDir, out)
	if st == nil {
		return code
	}
	if strings.TrimSpace(*reason) == "" {
		fmt.Fprint(out.Stderr, "drain: --reason is required\n"+drainHelp)
		return ExitUsage
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	d, err := st.Drain(ctx, *reason, time.Now())
	if err != nil {
		fmt.Fprintf(out.Stderr, "drain: %v\n", err)
		return ExitError
	}
	fmt.Fprintf(out.Stdout, "draining since %s: %s (no new VMs; running ones stay)\n", d.Since.Format(time.RFC3339), safetext.Escape(d.Reason))
	return ExitOK
}

// Undrain removes the drain marker.
func Undrain(ctx context.Context, args []string, out IO) int {
	fs := flag.NewFlagSet("undrain", flag.ContinueOnError)
	fs.SetOutput(out.Stderr)
	fs.Usage = func() { fmt.Fprint(out.Stderr, drainHelp) }
	stateDir := fs.String("state-dir", contract.DefaultStateDir, "the agent's state directory (as given to run)")
	st, code := openForDrain(fs, args, stateDir, out)
	if st == nil {
		return code
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	was, err := st.Undrain(ctx)
	if err != nil {
		fmt.Fprintf(out.Stderr, "undrain: %v\n", err)
		return ExitError
	}
	if !was {
		fmt.Fprintln(out.Stdout, "not draining")
		return ExitOK
	}
	fmt.Fprintln(out.Stdout, "undrained: the host grants new VMs again")
	return ExitOK
}

// openForDrain parses fs (no positional argument) and opens the store; a
// nil store comes with the exit code.
func openForDrain(fs *flag.FlagSet, args []string, stateDir *string, out IO) (*store.Store, int) {
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, ExitOK
		}
		return nil, ExitUsage
	}
	if len(pos) > 0 {
		fmt.Fprintf(out.Stderr, "%s: no arguments expected, got %q\n%s", fs.Name(), pos, drainHelp)
		return nil, ExitUsage
	}
	st, err := store.Open(*stateDir)
	if err != nil {
		fmt.Fprintf(out.Stderr, "%s: %v\n", fs.Name(), err)
		return nil, ExitError
	}
	return st, ExitOK
}
