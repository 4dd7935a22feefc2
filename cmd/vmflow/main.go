// Command vmflow is the platform side's command line: `vmflow place`
// (where a spawn would land, scored, without reserving) and `vmflow hosts`
// (the fleet view). main is wiring only: the commands are platform/fleet's.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"vmflow/platform/fleet"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := fleet.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
