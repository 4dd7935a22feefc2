// Command vmflow-vgpusim mounts a FUSE file system that answers like the
// kernel's vGPU sysfs (mdev and NVIDIA vendor VFIO), for tests and make dev.
// It is a binary of its own so that the root agent carries no simulator.
// main is wiring only: the command is vgpusim.Command.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"vmflow/hostagent/gpu/vgpusim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := vgpusim.Command(ctx, os.Args[1:], os.Stderr)
	stop()
	os.Exit(code)
}
