package cli

import (
	"context"
	"flag"
	"fmt"

	"vmflow/internal/service"
)

const usage = `usage: vmflow-hostagent <command> [flags]

commands:
  run        run the host agent: supervise VMs, serve host activities
  ls         list this host's instances from their records (read-only)
  show       show one instance: record, process liveness, vGPU claim (read-only)
  proc       inspect a process's thread group, or wait until it is gone
  devices    list this host's GPU devices (free, claimed, quarantined); devices clear puts one back
  drain      take no new VMs (running ones stay): out of fleet placement until undrain
  undrain    take new VMs again
  version    print the build's version and revision (also --version)
`

// Main is vmflow-hostagent's command line and returns the exit code; run is
// the run subcommand (daemon/agent, which hostagent/... may not import).
func Main(ctx context.Context, args []string, io IO, run func(context.Context, []string) int) int {
	if len(args) < 1 {
		fmt.Fprint(io.Stderr, usage)
		return ExitUsage
	}
	rest := args[1:]
	switch args[0] {
	case "run":
		return run(ctx, rest)
	case "ls":
		return Ls(rest, io)
	case "show":
		return Show(rest, io)
	case "proc":
		return Proc(ctx, rest, io)
	case "devices":
		return Devices(ctx, rest, io)
	case "drain":
		return Drain(ctx, rest, io)
	case "undrain":
		return Undrain(ctx, rest, io)
	case "version", "--version", "-version":
		fmt.Fprintln(io.Stdout, service.Info().String("vmflow-hostagent"))
		return ExitOK
	case "-h", "--help", "help":
		fmt.Fprint(io.Stdout, usage)
		return ExitOK
	default:
		fmt.Fprintf(io.Stderr, "unknown command %q\n%s", args[0], usage)
		return ExitUsage
	}
}

// parseAnywhere parses fs's flags wherever they stand among args, before
// or after the positional arguments, as virsh, kubectl and the temporal
// CLI take them (Go's flag package stops at the first positional
// argument, so "show ID --state-dir D" would leave --state-dir unread).
// "--" ends the flags. It returns the positional arguments in order.
func parseAnywhere(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if used := len(args) - len(rest); used > 0 && args[used-1] == "--" {
			return append(pos, rest...), nil
		}
		pos, args = append(pos, rest[0]), rest[1:]
	}
}
