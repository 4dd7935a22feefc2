// Command vmflow-hostagent is vmflow's per-host agent. main is wiring only:
// run is daemon/agent, the other subcommands are hostagent/cli's.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"vmflow/daemon"
	"vmflow/daemon/agent"
	"vmflow/hostagent/cli"
	"vmflow/hostagent/vmm"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == vmm.JailSetupCommand {
		// The agent re-executed between fork and QEMU's exec (vmm.Jail):
		// nothing else of main runs.
		os.Exit(vmm.JailMain(os.Args[2:]))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	run := func(ctx context.Context, args []string) int {
		return daemon.Main(ctx, "vmflow-hostagent", args, agent.ParseFlags, agent.Run)
	}
	code := cli.Main(ctx, os.Args[1:], cli.IO{Stdout: os.Stdout, Stderr: os.Stderr}, run)
	stop()
	os.Exit(code)
}
