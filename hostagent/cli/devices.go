package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/hostagent/topology"
	"vmflow/internal/contract"
	"vmflow/internal/safetext"
)

const devicesHelp = `usage: vmflow-hostagent devices [--state-dir DIR] [--sysfs-root DIR] [--gpu-passthrough LIST] [--vgpu-driver KIND] [-o table|json]
       vmflow-hostagent devices clear ID --reason TEXT [--state-dir DIR]
       vmflow-hostagent devices clear --reset --reason TEXT [--state-dir DIR]

Lists every GPU device of this host with its state: free, claimed (by
which instance), quarantined (and why: its release or reset failed
--gpu-quarantine-after times; placement skips it), or not vmflow's (not
named by --gpu-passthrough, bound to vfio-pci by someone else, in an IOMMU
group vmflow cannot take whole: "group 42 also holds 0000:82:00.0 (network
controller)", any device not of the GPU's own card, with a driver or not). Give it the agent's --sysfs-root,
--gpu-passthrough and --vgpu-driver. Read-only.

Each device says where it sits: NUMA is the node the kernel reports
(numa_node; "-" when the platform did not say, which placement counts as
the host's node when it has one), PCIE-ROOT its PCI root complex (a vGPU
sits where its parent GPU does; -o json adds the root port). Above the
devices, the host's NUMA nodes: their CPUs, memory (total and free) and
hugepage pools (free/total pages of 2 MiB and 1 GiB); a kernel without
NUMA is one node 0.

devices clear puts a quarantined device back into placement once an
operator fixed it; the reason is required and logged, with the time and
the quarantine it ends, to <state-dir>/gpu-quarantine.log. It is the one
CLI command that writes, under the quarantine's own lock, beside a running
agent.

A quarantine file that cannot be read (torn, not JSON, null) counts every
device as quarantined: no GPU is handed out. devices clear --reset sets it
aside (renamed <file>.unreadable-<time>, kept) and starts an empty one:
every device it may have named is offered again, so look at it first.
`

// QuarantineLogFile is the audit log of devices clear, in the state dir.
const QuarantineLogFile = "gpu-quarantine.log"

// Devices is `vmflow-hostagent devices`.
func Devices(ctx context.Context, args []string, out IO) int {
	if len(args) > 0 && args[0] == "clear" {
		return devicesClear(ctx, args[1:], out)
	}
	fs := flag.NewFlagSet("devices", flag.ContinueOnError)
	fs.SetOutput(out.Stderr)
	fs.Usage = func() { fmt.Fprint(out.Stderr, devicesHelp) }
	var v viewFlags
	v.register(fs)
	sysfs := fs.String("sysfs-root", gpu.DefaultSysfsRoot, "sysfs root (as given to run)")
	filter := fs.String("gpu-passthrough", "", "the agent's --gpu-passthrough")
	driver := fs.String("vgpu-driver", "auto", "the agent's --vgpu-driver: auto, mdev, vendor or none")
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK
		}
		return ExitUsage
	}
	if len(pos) > 0 {
		fmt.Fprintf(out.Stderr, "devices: unexpected arguments %q\n", pos)
		return ExitUsage
	}
	if err := v.check(); err != nil {
		fmt.Fprintf(out.Stderr, "devices: %v\n", err)
		return ExitUsage
	}
	f, err := gpu.ParseGPUFilter(*filter)
	if err != nil {
		fmt.Fprintf(out.Stderr, "devices: %v\n", err)
		return ExitUsage
	}
	st, err := store.Open(v.stateDir)
	if err != nil {
		fmt.Fprintf(out.Stderr, "devices: %v\n", err)
		return ExitError
	}
	whole := gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot: *sysfs, StateDir: v.stateDir, Filter: f})
	var drv gpu.Driver
	if *driver != "none" {
		kind := gpu.Kind("")
		if *driver != "auto" {
			kind = gpu.Kind(*driver)
		}
		if d, err := gpu.New(gpu.Config{SysfsRoot: *sysfs, StateDir: v.stateDir, Kind: kind}); err == nil {
			if _, perr := d.Profiles(ctx); perr == nil {
				drv = d // a host without vGPU sysfs lists whole GPUs only
			}
		}
	}
	rows, err := lease.HostInventory(ctx, st, lease.NewQuarantine(v.stateDir, 0, nil), whole, drv)
	if err != nil {
		fmt.Fprintf(out.Stderr, "devices: %v\n", err)
		if errors.Is(err, lease.ErrQuarantineUnreadable) {
			fmt.Fprintf(out.Stderr, "devices: no GPU is handed out until it is mended: read %s, then vmflow-hostagent devices clear --reset --reason TEXT\n",
				filepath.Join(v.stateDir, lease.QuarantineFile))
		}
		return ExitError
	}
	located := make([]deviceRow, len(rows))
	for i, r := range rows {
		located[i] = deviceRow{DeviceRow: r, PCILocality: topology.PCILocality{NUMANode: topology.NoNode}}
		if l, err := gpu.Locate(*sysfs, r.ID); err == nil {
			located[i].PCILocality = l
		}
	}
	if v.output == "json" {
		writeJSON(out.Stdout, located)
		return ExitOK
	}
	if topo, err := topology.Read(*sysfs); err != nil {
		fmt.Fprintf(out.Stderr, "devices: the host's NUMA nodes: %v\n", err)
	} else {
		writeNodes(out.Stdout, topo)
		fmt.Fprintln(out.Stdout)
	}
	table(out.Stdout, []string{"DEVICE", "KIND", "NUMA", "PCIE-ROOT", "STATE", "INSTANCE", "WHY"}, len(located), func(i int) []string {
		r := located[i]
		return []string{r.ID, r.Kind, nodeName(r.NUMANode), orDash(r.PCIeRoot), r.State, orDash(r.Instance), orDash(r.Why)}
	})
	return ExitOK
}

// deviceRow is a row of devices: the inventory's, and where the device
// sits (NUMANode topology.NoNode, no root, when sysfs cannot say).
type deviceRow struct {
	lease.DeviceRow
	topology.PCILocality
}

// writeNodes is the table of the host's NUMA nodes.
func writeNodes(w io.Writer, topo topology.Topology) {
	pages := func(n topology.Node, size uint64) string {
		p, ok := n.Hugepages[size]
		if !ok {
			return "-"
		}
		return fmt.Sprintf("%d/%d", p.Free, p.Total)
	}
	table(w, []string{"NODE", "CPUS", "MEMORY", "FREE", "2M-PAGES", "1G-PAGES"}, len(topo.Nodes), func(i int) []string {
		n := topo.Nodes[i]
		return []string{strconv.Itoa(n.ID), orDash(topology.FormatCPUList(n.CPUs)), gib(n.MemoryBytes), gib(n.FreeBytes),
			pages(n, topology.PageSize2M), pages(n, topology.PageSize1G)}
	})
}

// table writes a header and n rows, aligned, every cell escaped.
func table(w io.Writer, header []string, n int, row func(i int) []string) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	for i := range n {
		cols := row(i)
		for j, c := range cols {
			cols[j] = safetext.Escape(c)
		}
		fmt.Fprintln(tw, strings.Join(cols, "\t"))
	}
	_ = tw.Flush()
}

// nodeName is a NUMA node as the tables show it: "-" for none.
func nodeName(n int) string {
	if n == topology.NoNode {
		return "-"
	}
	return strconv.Itoa(n)
}

// gib is a size in GiB with one decimal ("62.8 GiB").
func gib(b uint64) string { return fmt.Sprintf("%.1f GiB", float64(b)/(1<<30)) }

func devicesClear(ctx context.Context, args []string, out IO) int {
	fs := flag.NewFlagSet("devices clear", flag.ContinueOnError)
	fs.SetOutput(out.Stderr)
	fs.Usage = func() { fmt.Fprint(out.Stderr, devicesHelp) }
	stateDir := fs.String("state-dir", contract.DefaultStateDir, "the agent's state directory (as given to run)")
	reason := fs.String("reason", "", "why the device may be used again (required, logged)")
	reset := fs.Bool("reset", false, "set an unreadable quarantine file aside and start an empty one")
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK
		}
		return ExitUsage
	}
	var id string
	switch len(pos) {
	case 0:
	case 1:
		id = pos[0]
	default:
		fmt.Fprintf(out.Stderr, "devices clear: one device id at a time, got %q\n", pos)
		return ExitUsage
	}
	if (id == "") == !*reset || strings.TrimSpace(*reason) == "" {
		fmt.Fprint(out.Stderr, "devices clear: a device id (or --reset) and --reason are required\n"+devicesHelp)
		return ExitUsage
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if *reset {
		return devicesReset(ctx, *stateDir, *reason, out)
	}
	was, err := lease.NewQuarantine(*stateDir, 0, nil).Clear(ctx, id)
	if err != nil {
		fmt.Fprintf(out.Stderr, "devices clear: %v\n", err)
		if errors.Is(err, lease.ErrNotQuarantined) {
			return ExitUsage
		}
		return ExitError
	}
	entry := map[string]string{"time": time.Now().UTC().Format(time.RFC3339), "device_id": id, "reason": *reason,
		"was": was.Reason, "quarantined_since": was.Since.Format(time.RFC3339), "instance_id": was.Instance}
	if err := appendLog(filepath.Join(*stateDir, QuarantineLogFile), entry); err != nil {
		// Cleared already: say so, and that the log line is missing.
		fmt.Fprintf(out.Stderr, "devices clear: %s cleared, but the log line was not written: %v\n", id, err)
		return ExitError
	}
	fmt.Fprintf(out.Stdout, "%s cleared (was quarantined since %s: %s)\n", safetext.Escape(id), was.Since.Format(time.RFC3339), safetext.Escape(was.Reason))
	return ExitOK
}

// devicesReset is devices clear --reset: an unreadable quarantine set
// aside for an empty one, logged like a clear.
func devicesReset(ctx context.Context, stateDir, reason string, out IO) int {
	aside, err := lease.NewQuarantine(stateDir, 0, nil).Reset(ctx)
	if err != nil {
		fmt.Fprintf(out.Stderr, "devices clear --reset: %v\n", err)
		if errors.Is(err, lease.ErrQuarantineReadable) {
			return ExitUsage
		}
		return ExitError
	}
	entry := map[string]string{"time": time.Now().UTC().Format(time.RFC3339), "reset": "unreadable quarantine set aside", "set_aside": aside, "reason": reason}
	if err := appendLog(filepath.Join(stateDir, QuarantineLogFile), entry); err != nil {
		fmt.Fprintf(out.Stderr, "devices clear --reset: done, but the log line was not written: %v\n", err)
		return ExitError
	}
	fmt.Fprintf(out.Stdout, "quarantine reset: the unreadable file is kept as %s\n", safetext.Escape(aside))
	return ExitOK
}

// appendLog appends one JSON line to path and syncs it.
func appendLog(path string, entry map[string]string) error {
	b, err := json.Marshal(entry)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
