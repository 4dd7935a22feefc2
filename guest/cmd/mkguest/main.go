// Command mkguest builds vmflow's small real guest (kernel + initramfs) into
// a cache folder and prints the paths: `make guest` runs it.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"vmflow/guest/build"
)

func main() {
	dir := flag.String("dir", "", "cache folder (default $"+build.DirEnv+" or <module root>/.cache/guest)")
	meta := flag.String("meta", build.DefaultMetaPackage, "Debian meta package naming the kernel")
	quiet := flag.Bool("q", false, "print only the paths")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	opts := build.Options{Dir: *dir, MetaPackage: *meta}
	if !*quiet {
		opts.Log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	a, err := build.Build(ctx, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "mkguest:", err)
		os.Exit(1)
	}
	fmt.Printf("kernel=%s\ninitrd=%s\npackage=%s %s\nmodules=%s\n", a.Kernel, a.Initrd, a.KernelPackage, a.KernelVersion,
		strings.Join(a.Modules, " "))
}
