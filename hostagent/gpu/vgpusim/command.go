package vgpusim

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"

	"vmflow/internal/service"
)

const vgpuSimHelp = `usage: vmflow-vgpusim --mount DIR [--control CTL] [--mdev-parents N] [--vendor-vfs N] [--pci-gpus N --dev-root DEV]
                      [--numa-nodes N [--node-cpus N] [--node-memory-mib N] [--node-hugepages-2m TOTAL[/FREE]]
                       [--node-hugepages-1g TOTAL[/FREE]] [--gpu-nodes ADDR=NODE,...]]

Mounts a FUSE file system at DIR that answers like the kernel's vGPU sysfs
files (mdev and NVIDIA vendor VFIO) and, with --pci-gpus, like its PCI
files for whole GPUs (IOMMU groups, driver_override, bind/unbind,
drivers_probe, reset), for tests and development; point the agent's
--sysfs-root at DIR (and --dev-root at DEV). Runs until SIGINT or SIGTERM,
then unmounts. DEV gets nvidia<N> per PCI GPU and vfio/<group> while a
function of the group is bound to vfio-pci; unbinding waits while a process
holds the node open.

NUMA: --numa-nodes N serves devices/system/node/node<k> (cpulist, meminfo,
hugepages/hugepages-{2048,1048576}kB/{nr,free}_hugepages), devices/system/cpu/online
and kernel/mm/hugepages: each node --node-cpus CPUs (default 2), --node-memory-mib
of memory (default 4096) and the given pools (FREE defaults to TOTAL). Each
GPU's numa_node says its node: round robin (PCI GPU i and mdev parent i on
node i % N, the vendor PF on 0) unless --gpu-nodes names it. Without
--numa-nodes the kernel has no NUMA: every numa_node reads -1. Every PCI
function sits under a root port of its node's root complex (node 0: pci0000:00,
node 1: pci0000:10, ...):
bus/pci/devices/<addr> links to devices/pci0000:00/0000:00:01.0/<addr>.

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
	var o Options
	fs.IntVar(&o.NUMANodes, "numa-nodes", 0, "number of NUMA nodes (0: a kernel without NUMA)")
	fs.IntVar(&o.NodeCPUs, "node-cpus", 0, "CPUs per NUMA node (default 2)")
	fs.IntVar(&o.NodeMemoryMiB, "node-memory-mib", 0, "memory per NUMA node in MiB (default 4096)")
	fs.Var((*hugepagesFlag)(&o.NodeHugepages2M), "node-hugepages-2m", "2 MiB hugepages per node: TOTAL or TOTAL/FREE")
	fs.Var((*hugepagesFlag)(&o.NodeHugepages1G), "node-hugepages-1g", "1 GiB hugepages per node: TOTAL or TOTAL/FREE")
	fs.Var((*gpuNodesFlag)(&o.GPUNodes), "gpu-nodes", "GPUs' NUMA nodes: ADDR=NODE,... (others round robin)")
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
	o.MdevParents, o.VendorVFs, o.PCIGPUs, o.DevRoot, o.Control = *parents, *vfs, *gpus, *dev, *ctl
	srv, err := Mount(*mount, o)
	if err != nil {
		fmt.Fprintf(stderr, "vmflow-vgpusim: %v\n", err)
		return service.ExitError
	}
	fmt.Fprintf(stderr, "vmflow-vgpusim: mounted at %s (mdev parents %d, vendor VFs %d, PCI GPUs %d, NUMA nodes %d, dev root %q, control %q)\n", *mount, *parents, *vfs, *gpus, o.NUMANodes, *dev, *ctl)
	<-ctx.Done()
	if err := srv.Unmount(); err != nil {
		fmt.Fprintf(stderr, "vmflow-vgpusim: %v\n", err)
		return service.ExitError
	}
	fmt.Fprintf(stderr, "vmflow-vgpusim: unmounted %s\n", *mount)
	return service.ExitOK
}

// hugepagesFlag is a pool flag's TOTAL or TOTAL/FREE (FREE defaults to
// TOTAL: a pool nobody uses).
type hugepagesFlag Hugepages

func (h *hugepagesFlag) String() string {
	if h == nil {
		return ""
	}
	return fmt.Sprintf("%d/%d", h.Total, h.Free)
}

func (h *hugepagesFlag) Set(v string) error {
	total, free, hasFree := strings.Cut(v, "/")
	t, err := strconv.Atoi(total)
	if err != nil {
		return fmt.Errorf("hugepages %q: TOTAL or TOTAL/FREE: %w", v, err)
	}
	f := t
	if hasFree {
		if f, err = strconv.Atoi(free); err != nil {
			return fmt.Errorf("hugepages %q: TOTAL or TOTAL/FREE: %w", v, err)
		}
	}
	*h = hugepagesFlag{Total: t, Free: f}
	return nil
}

// gpuNodesFlag is --gpu-nodes: ADDR=NODE, comma-separated, repeatable.
type gpuNodesFlag map[string]int

func (g *gpuNodesFlag) String() string {
	if g == nil {
		return ""
	}
	parts := make([]string, 0, len(*g))
	for a, n := range *g {
		parts = append(parts, a+"="+strconv.Itoa(n))
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

func (g *gpuNodesFlag) Set(v string) error {
	if *g == nil {
		*g = map[string]int{}
	}
	for part := range strings.SplitSeq(v, ",") {
		addr, node, ok := strings.Cut(part, "=")
		n, err := strconv.Atoi(node)
		if !ok || err != nil {
			return fmt.Errorf("GPU node %q: not ADDR=NODE", part)
		}
		(*g)[addr] = n
	}
	return nil
}
