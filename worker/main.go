// Command vmflow-worker runs vmflow's workflows. main is wiring only: the
// worker is daemon/worker.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"vmflow/daemon"
	"vmflow/daemon/worker"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := daemon.Main(ctx, "vmflow-worker", os.Args[1:], worker.ParseFlags, worker.Run)
	stop()
	os.Exit(code)
}
