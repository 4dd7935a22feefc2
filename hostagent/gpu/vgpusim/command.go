package vgpusim

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"

	"vmflow/internal/service"
)

const vgpuSimHelp = `usage: vmflow-vgpusim --mount DIR [--control CTL] [--mdev-parents N] [--vendor-vfs N] [--pci-gpus N --dev-root DEV]

Mounts a FUSE file system at DIR that answers like the kernel's vGPU sysfs
files (mdev and NVIDIA vendor VFIO) and, with --pci-gpus, like its PCI
files for whole GPUs (IOMMU groups, driver_override, bind/unbind,
drivers_probe, reset), for tests and development; point the agent's
--sysfs-root at DIR (and --dev-root at DEV). Runs until SIGINT or SIGTERM,
then unmounts. DEV gets nvidia<N> per PCI GPU and vfio/<group> while a
function of the group is bound to vfio-pci; unbinding waits while a process
holds the node open.

Fault injection: files in CTL, checked at every write, effective while they exist:
  CTL/fail-release   an errno name (EBUSY, EIO, EAGAIN, ENODEV): release writes fail with it
  CTL/block-release  release writes block until the file is removed
  CTL/fail-create    an errno name: create writes fail with it
  CTL/fail-unbind    an errno name: PCI driver unbind writes fail with it
  CTL/block-unbind   PCI driver unbind writes block until the file is removed
  CTL/fail-reset     an errno name: PCI reset writes fail with it
Writers blocked by block-release complete before the simulator unmounts.

Drive it from a shell:
  echo $(uuidgen) > DIR/class/mdev_bus/0000:3b:00.0/mdev_supported_types/nvidia-471/create
  echo 1 > DIR/bus/mdev/devices/<uuid>/remove
  echo 592 > DIR/bus/pci/devices/0000:c1:00.4/nvidia/current_vgpu_type
  echo vfio-pci > DIR/bus/pci/devices/0000:81:00.0/driver_override
  echo 0000:81:00.0 > DIR/bus/pci/drivers/nvidia/unbind
  echo 0000:81:00.0 > DIR/bus/pci/drivers_probe

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
	gpus := fs.Int("pci-gpus", 0, "number of whole PCI GPUs for passthrough")
	dev := fs.String("dev-root", "", "where the device nodes (nvidia<N>, vfio/<group>) are kept")
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
	srv, err := Mount(*mount, Options{MdevParents: *parents, VendorVFs: *vfs, PCIGPUs: *gpus, DevRoot: *dev, Control: *ctl})
	if err != nil {
		fmt.Fprintf(stderr, "vmflow-vgpusim: %v\n", err)
		return service.ExitError
	}
	fmt.Fprintf(stderr, "vmflow-vgpusim: mounted at %s (mdev parents %d, vendor VFs %d, PCI GPUs %d, dev root %q, control %q)\n", *mount, *parents, *vfs, *gpus, *dev, *ctl)
	<-ctx.Done()
	if err := srv.Unmount(); err != nil {
		fmt.Fprintf(stderr, "vmflow-vgpusim: %v\n", err)
		return service.ExitError
	}
	fmt.Fprintf(stderr, "vmflow-vgpusim: unmounted %s\n", *mount)
	return service.ExitOK
}
