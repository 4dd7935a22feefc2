// Command vmflow-hostagent is vmflow's per-host agent. main is wiring only:
// run is daemon/agent, the other subcommands live in hostagent/cli.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"vmflow/daemon"
	"vmflow/daemon/agent"
	"vmflow/hostagent/cli"
	"vmflow/hostagent/vmm"
	"vmflow/internal/service"
)

const usage = `usage: vmflow-hostagent <command> [flags]

commands:
  run        run the host agent: supervise VMs, serve host activities
  ls         list this host's instances from their records (read-only)
  show       show one instance: record, process liveness, vGPU claim (read-only)
  proc       inspect a process's thread group, or wait until it is gone
  version    print the build's version and revision (also --version)
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(cli.ExitUsage)
	}
	if os.Args[1] == vmm.JailSetupCommand {
		// The agent re-executed between fork and QEMU's exec (vmm.Jail):
		// nothing else of main runs.
		os.Exit(vmm.JailMain(os.Args[2:]))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	io := cli.IO{Stdout: os.Stdout, Stderr: os.Stderr}
	args := os.Args[2:]
	var code int
	switch os.Args[1] {
	case "run":
		code = daemon.Main(ctx, "vmflow-hostagent", args, agent.ParseFlags, agent.Run)
	case "ls":
		code = cli.Ls(args, io)
	case "show":
		code = cli.Show(args, io)
	case "proc":
		code = cli.Proc(ctx, args, io)
	case "version", "--version", "-version":
		fmt.Fprintln(os.Stdout, service.Info().String("vmflow-hostagent"))
	case "-h", "--help", "help":
		fmt.Fprint(os.Stdout, usage)
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n%s", os.Args[1], usage)
		code = cli.ExitUsage
	}
	stop()
	os.Exit(code)
}
