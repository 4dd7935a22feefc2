package vgpusim

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"

	"vmflow/internal/service"
)

const vgpuSimHelp = `usage: vmflow-vgpusim --mount DIR [--control CTL] [--mdev-parents N] [--vendor-vfs N]

Mounts a FUSE file system at DIR that answers like the kernel's vGPU sysfs
files (mdev and NVIDIA vendor VFIO), for tests and development; point the
agent's --sysfs-root at DIR. Runs until SIGINT or SIGTERM, then unmounts.

Fault injection: files in CTL, checked at every write, effective while they exist:
  CTL/fail-release   an errno name (EBUSY, EIO, EAGAIN, ENODEV): release writes fail with it
  CTL/block-release  release writes block until the file is removed
  CTL/fail-create    an errno name: create writes fail with it
Writers blocked by block-release complete before the simulator unmounts.

Drive it from a shell:
  echo $(uuidgen) > DIR/class/mdev_bus/0000:3b:00.0/mdev_supported_types/nvidia-471/create
  echo 1 > DIR/bus/mdev/devices/<uuid>/remove
  echo 592 > DIR/bus/pci/devices/0000:c1:00.4/nvidia/current_vgpu_type

exit status: 0 after a clean unmount, 1 on a mount or unmount error, 2 usage
`

// Command is the vmflow-vgpusim command: mount, serve until ctx ends,
// unmount. It returns the exit code.
func Command(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("vmflow-vgpusim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, vgpuSimHelp) }
	mount := fs.String("mount", "", "mount point (must exist)")
	ctl := fs.String("control", "", "fault-injection directory (must exist)")
	parents := fs.Int("mdev-parents", 2, "number of mdev-capable GPUs")
	vfs := fs.Int("vendor-vfs", 4, "number of NVIDIA vendor-VFIO virtual functions")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return service.ExitOK
		}
		return service.ExitUsage
	}
	if *mount == "" || fs.NArg() != 0 {
		fs.Usage()
		return service.ExitUsage
	}
	srv, err := Mount(*mount, Options{MdevParents: *parents, VendorVFs: *vfs, Control: *ctl})
	if err != nil {
		fmt.Fprintf(stderr, "vmflow-vgpusim: %v\n", err)
		return service.ExitError
	}
	fmt.Fprintf(stderr, "vmflow-vgpusim: mounted at %s (mdev parents %d, vendor VFs %d, control %q)\n", *mount, *parents, *vfs, *ctl)
	<-ctx.Done()
	if err := srv.Unmount(); err != nil {
		fmt.Fprintf(stderr, "vmflow-vgpusim: %v\n", err)
		return service.ExitError
	}
	fmt.Fprintf(stderr, "vmflow-vgpusim: unmounted %s\n", *mount)
	return service.ExitOK
}
