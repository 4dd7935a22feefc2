package agent

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.uber.org/zap"

	"vmflow/daemon"
	"vmflow/hostagent/gpu"
	"vmflow/hostagent/lease"
	"vmflow/hostagent/network"
	"vmflow/hostagent/store"
	"vmflow/hostagent/topology"
	"vmflow/hostagent/vmm"
	"vmflow/internal/contract"
	"vmflow/platform"
)

// DefaultReconcileEvery is the reconcile Schedule's period: a safety net
// (about 9 billed actions a run) behind the agent's local scan, which
// triggers a round whenever it finds work.
const DefaultReconcileEvery = 24 * time.Hour

// Config is the command line of "vmflow-hostagent run".
type Config struct {
	daemon.Flags
	HostID     string
	StateDir   string
	SysfsRoot  string
	DevRoot    string
	ImageRoots []string
	QEMU       string
	// QEMUUIDs: every QEMU runs as a uid of its own from this range
	// (disjoint between agents sharing a machine).
	QEMUUIDs store.UIDRange
	// KVMDevice is the KVM node checked at start; its group is a KVM
	// QEMU's only supplementary group.
	KVMDevice string
	// VMIO is --vm-io-*: every VM's disk I/O bound (0: none), applied
	// through its cgroup on the block devices under its disk.
	VMIO vmm.IOLimits
	// Jail runs every QEMU in namespaces and a root of its own (vmm.Jail).
	Jail       bool
	VGPUAttach bool
	VGPUDriver string // auto, mdev, vendor, none
	// GPUPassthrough is --gpu-passthrough: which GPUs the host hands out
	// whole (the zero filter: none).
	GPUPassthrough gpu.GPUFilter
	// QuarantineAfter is --gpu-quarantine-after: failed releases of one
	// device before placement skips it.
	QuarantineAfter int
	// GPUScrub is --gpu-scrub: an executable run on a whole GPU between
	// tenants (lease.WholeConfig.Scrub); "" for none.
	GPUScrub       string
	OrphanGrace    time.Duration
	ReconcileEvery time.Duration
	// ReconcileScanEvery: how often the agent's local scan (no Temporal
	// call) looks for reconcile work; 0 turns it off.
	ReconcileScanEvery time.Duration
	GracefulTimeout    time.Duration
	GroupExitCap       time.Duration
	TaskQueue          string // where the reconcile schedule starts ReconcileVGPU
	// IgnoreUninspectable: pids whose open files cannot be read yet known
	// not to hold VFIO devices (a sandbox's init). Empty in production.
	IgnoreUninspectable []int
	// The host's network (hostagent/network): no network without a
	// subnet.
	NetBridge string
	NetSubnet netip.Prefix
	NetEgress string
	NetDeny   []netip.Prefix // ranges egress never reaches (network.ParseDeny)
	NetNetNS  string
	// NetPortPPS bounds each guest port's frames a second
	// (network.Config.PortPPS).
	NetPortPPS uint
	// The capacity ledger (lease.CapacityConfig): overcommit ratios, the
	// memory kept for the host (-1: lease.DefaultMemoryReserveMiB), how
	// long a reservation counts before its launch.
	CPUOvercommit, MemoryOvercommit float64
	MemoryReserveMiB                int64
	ReservationTTL                  time.Duration
	// LaunchConcurrency bounds the QEMU starts in flight (0: from the
	// host's CPUs, supervise.DefaultLaunchConcurrency).
	LaunchConcurrency int
	// DedicatedCPUs are kept for VMs with dedicated_cpus
	// (lease.CapacityConfig.DedicatedCPUs).
	DedicatedCPUs []int
	// The fleet view (viewPublisher): changes within the debounce go out
	// as one publish; a local look (no Temporal call) every check catches
	// changes made outside the activities (drain, expiry).
	FleetPublishDebounce, FleetCheckEvery time.Duration
}

type pidsFlag []int

func (p *pidsFlag) String() string { return fmt.Sprint(*p) }
func (p *pidsFlag) Set(v string) error {
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return fmt.Errorf("%q is not a pid", v)
	}
	*p = append(*p, n)
	return nil
}

type multiFlag []string

func (m *multiFlag) String() string     { return fmt.Sprint(*m) }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// ParseFlags parses the flags of "vmflow-hostagent run".
func ParseFlags(args []string, stderr io.Writer) (Config, error) {
	var c Config
	host, _ := os.Hostname()
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, `usage: vmflow-hostagent run --host-id ID --state-dir DIR [flags]

Runs the host agent: supervises this host's VMs first (re-attaches them, applies
restart policies; this never waits for Temporal), then serves the host
activities on task queue vmflow-host-<host-id>. A local scan (every
--reconcile-scan-every, no Temporal call) triggers ReconcileVGPU when it finds
work; the Schedule reconcile-vgpu/<host-id> runs it every --reconcile-every
as a safety net (an existing schedule with another interval is updated).
Temporal connection: TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_TLS_*,
TEMPORAL_API_KEY or a TEMPORAL_CONFIG_FILE profile.

flags:
`)
		fs.PrintDefaults()
	}
	c.Register(fs, daemon.Help{Work: "activities", Refused: "the agent supervises without Temporal and says why"})
	var roots multiFlag
	var ignore pidsFlag
	fs.StringVar(&c.HostID, "host-id", host, "this host's id ("+contract.IDPattern+")")
	fs.StringVar(&c.StateDir, "state-dir", contract.DefaultStateDir, "instance records, QMP sockets and logs")
	fs.StringVar(&c.SysfsRoot, "sysfs-root", gpu.DefaultSysfsRoot, "where the vGPU sysfs files are (the simulator's mount in tests)")
	fs.StringVar(&c.DevRoot, "dev-root", "/dev", "where the VFIO device nodes are")
	fs.Var(&roots, "image-root", "folder kernels, initrds and disks must lie in, root-owned and not group/other-writable; images are opened beneath it (repeatable)")
	fs.StringVar(&c.QEMU, "qemu", vmm.DefaultBinary, "QEMU binary")
	uidRange := store.DefaultQEMUUIDRange.String()
	fs.StringVar(&uidRange, "qemu-uid-range", uidRange, "`FIRST-LAST`: every QEMU is exec'd as a uid of its own from this range (no passwd entry needed); agents sharing a machine need disjoint ranges")
	fs.StringVar(&c.KVMDevice, "kvm-device", vmm.DefaultKVMDevice, "the KVM node, checked at start: its group must have rw (QEMU gets that group); otherwise KVM launches fail")
	fs.BoolVar(&c.Jail, "jail", true, "run every QEMU in network, mount, pid, IPC and UTS namespaces and a read-only root of its own; false only where the agent lacks CAP_SYS_ADMIN")
	fs.BoolVar(&c.VGPUAttach, "vgpu-attach", true, "attach claimed vGPUs to QEMU; false only with the vmflow-vgpusim simulator, whose devices QEMU cannot open")
	fs.StringVar(&c.VGPUDriver, "vgpu-driver", "auto", "auto, mdev, vendor or none")
	fs.IntVar(&c.QuarantineAfter, "gpu-quarantine-after", lease.DefaultQuarantineAfter, "failed releases of one GPU device in a row after which placement skips it until vmflow-hostagent devices clear (a failed reset or scrub: at once)")
	fs.Func("gpu-passthrough", "GPUs this host hands out whole by VFIO passthrough: a comma list of PCI vendor:device ids (10de:2335), or all for every display-class device not serving vGPUs; empty (the default): none",
		func(v string) error {
			f, err := gpu.ParseGPUFilter(v)
			c.GPUPassthrough = f
			return err
		})
	fs.StringVar(&c.GPUScrub, "gpu-scrub", "", "`PATH` of an executable run on every released whole GPU before its next tenant, with the GPU's PCI addresses as arguments (no shell); it must be idempotent, and its failure quarantines the GPU. A reset does not clear VRAM: without a scrub, a tenant's data may remain in it")
	fs.DurationVar(&c.OrphanGrace, "vgpu-orphan-grace", lease.DefaultOrphanGrace, "an unclaimed vGPU device is removed after this long")
	fs.DurationVar(&c.ReconcileEvery, "reconcile-every", DefaultReconcileEvery, "how often the Schedule runs ReconcileVGPU, the safety net behind the local scan")
	fs.DurationVar(&c.ReconcileScanEvery, "reconcile-scan-every", time.Minute, "how often the agent scans the host for reconcile work (read-only, no Temporal call) and, finding some, triggers ReconcileVGPU; 0: off")
	fs.DurationVar(&c.GracefulTimeout, "graceful-timeout", contract.DefaultGracefulTimeout, "default wait after system_powerdown before quit")
	fs.DurationVar(&c.GroupExitCap, "group-exit-cap", contract.DefaultGroupExitCap, "how long the stop ladder waits for the whole thread group after SIGKILL")
	fs.Uint64Var(&c.VMIO.ReadBPS, "vm-io-read-bps", 0, "every VM's disk reads in bytes/s, through its cgroup (io.max, v1 blkio.throttle); 0: unbounded")
	fs.Uint64Var(&c.VMIO.WriteBPS, "vm-io-write-bps", 0, "every VM's disk writes in bytes/s (on cgroup v1 only direct I/O: QEMU's cache.direct=on); 0: unbounded")
	fs.Uint64Var(&c.VMIO.ReadIOPS, "vm-io-read-iops", 0, "every VM's disk read operations/s; 0: unbounded")
	fs.Uint64Var(&c.VMIO.WriteIOPS, "vm-io-write-iops", 0, "every VM's disk write operations/s; 0: unbounded")
	fs.StringVar(&c.TaskQueue, "workflow-task-queue", contract.DefaultTaskQueue, "task queue of the workflow worker (where the reconcile schedule starts workflows)")
	var subnet string
	fs.StringVar(&c.NetBridge, "net-bridge", network.DefaultBridge, "the bridge VMs with a network are ports of (made when missing)")
	fs.StringVar(&subnet, "net-subnet", "", "`CIDR` (IPv4) of the VMs' network: the bridge takes its first address, the guests' gateway; empty: no network, and a spawn asking for one is refused")
	fs.StringVar(&c.NetEgress, "net-egress", "", "`IFACE` the guests' traffic leaves by, masqueraded (nftables); empty: no egress")
	fs.Func("net-deny", "`CIDR,...` (IPv4) the guests never reach through --net-egress (the operator's management networks); 127.0.0.0/8, 169.254.0.0/16 and the host's own addresses are always denied",
		func(v string) (err error) { c.NetDeny, err = network.ParseDeny(v); return err })
	fs.UintVar(&c.NetPortPPS, "net-port-pps", network.DefaultPortPPS, "frames a second each VM's TAP may send into the bridge (a tenth of a second's worth at once); over it frames are dropped and counted in vmflow_network_port_rate_dropped_frames_total")
	fs.StringVar(&c.NetNetNS, "net-netns", "", "`NAME` of the network namespace (/run/netns/NAME) the bridge and TAPs live in; empty: the agent's own (production)")
	fs.Float64Var(&c.CPUOvercommit, "cpu-overcommit", lease.DefaultCPUOvercommit, "vCPUs this host promises its VMs per CPU: spawns beyond CPUs × this are refused NoHostCapacity")
	fs.Float64Var(&c.MemoryOvercommit, "memory-overcommit", lease.DefaultMemoryOvercommit, "memory promised per MiB of the host's less --memory-reserve; a VM with a GPU (pinned memory) is admitted only within the memory itself, whatever this says")
	c.MemoryReserveMiB = -1
	fs.Func("memory-reserve", "`SIZE` of memory kept for the host (kernel, agent, page cache) and never promised to VMs: MiB, or with a suffix M, G or T (default 1G + 2% of the host's)",
		func(v string) (err error) { c.MemoryReserveMiB, err = parseMiB(v); return err })
	fs.DurationVar(&c.ReservationTTL, "reservation-ttl", lease.DefaultReservationTTL, "how long a new record's reservation of CPUs and memory counts before its launch: a spawn that died in between frees its room after this")
	fs.Func("dedicated-cpus", "`CPULIST` (0-3,8) kept for VMs that ask for dedicated_cpus, one CPU per vCPU: no other VM's cpuset holds them; empty (the default): none offered",
		func(v string) (err error) { c.DedicatedCPUs, err = topology.ParseCPUList(v); return err })
	fs.IntVar(&c.LaunchConcurrency, "launch-concurrency", 0, "QEMU starts in flight at once (fork to QMP ready); the rest wait their turn. 0: one per CPU, 2 to 16")
	fs.DurationVar(&c.FleetPublishDebounce, "fleet-publish-debounce", time.Second, "changes of the host's fleet view within this go out as one publish (one billed action)")
	fs.DurationVar(&c.FleetCheckEvery, "fleet-check-every", defaultFleetCheckEvery, "how often the agent looks, locally, for changes of its fleet view made outside its activities (a drain, an expired reservation); it publishes only on change")
	fs.Var(&ignore, "holders-ignore-pid", "a pid whose open files cannot be read but that holds no VFIO device (repeatable; for sandboxes whose init outranks the agent, never in production)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	c.ImageRoots = roots
	c.LogFields = []zap.Field{zap.String("host_id", c.HostID)}
	c.TraceAttributes = []attribute.KeyValue{attribute.String(platform.AttrHostID, c.HostID)}
	c.IgnoreUninspectable = ignore
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if err := store.ValidateID(c.HostID); err != nil {
		return c, fmt.Errorf("--host-id: %w (hostnames with dots or capitals need an explicit --host-id)", err)
	}
	for _, d := range []struct {
		name string
		path *string
	}{{"state-dir", &c.StateDir}, {"sysfs-root", &c.SysfsRoot}, {"dev-root", &c.DevRoot}} {
		abs, err := filepath.Abs(*d.path)
		if err != nil {
			return c, fmt.Errorf("--%s: %w", d.name, err)
		}
		*d.path = abs
	}
	if err := c.Check(); err != nil {
		return c, err
	}
	r, err := store.ParseUIDRange(uidRange)
	if err != nil {
		return c, fmt.Errorf("--qemu-uid-range: %w", err)
	}
	c.QEMUUIDs = r
	if c.QuarantineAfter < 1 {
		return c, fmt.Errorf("--gpu-quarantine-after must be at least 1, got %d", c.QuarantineAfter)
	}
	if c.GPUScrub != "" {
		if err := checkExecutable(c.GPUScrub); err != nil {
			return c, fmt.Errorf("--gpu-scrub: %w", err)
		}
	}
	if c.NetPortPPS < 1 || c.NetPortPPS > math.MaxUint32 {
		return c, fmt.Errorf("--net-port-pps must be 1 to %d, got %d", uint32(math.MaxUint32), c.NetPortPPS)
	}
	if subnet != "" {
		if c.NetSubnet, err = netip.ParsePrefix(subnet); err != nil {
			return c, fmt.Errorf("--net-subnet: %w", err)
		}
		if _, err := network.Gateway(c.NetSubnet); err != nil {
			return c, fmt.Errorf("--net-subnet: %w", err)
		}
	}
	switch c.VGPUDriver {
	case "auto", "mdev", "vendor", "none":
	default:
		return c, fmt.Errorf("--vgpu-driver %q: want auto, mdev, vendor or none", c.VGPUDriver)
	}
	for name, v := range map[string]time.Duration{"vgpu-orphan-grace": c.OrphanGrace, "reconcile-every": c.ReconcileEvery,
		"graceful-timeout": c.GracefulTimeout, "group-exit-cap": c.GroupExitCap} {
		if v <= 0 {
			return c, fmt.Errorf("--%s must be positive, got %s", name, v)
		}
	}
	if c.ReconcileScanEvery < 0 {
		return c, fmt.Errorf("--reconcile-scan-every %s is negative", c.ReconcileScanEvery)
	}
	for name, v := range map[string]float64{"cpu-overcommit": c.CPUOvercommit, "memory-overcommit": c.MemoryOvercommit} {
		if math.IsNaN(v) || v <= 0 || v > lease.MaxOvercommit {
			return c, fmt.Errorf("--%s must be above 0 and at most %g, got %g", name, lease.MaxOvercommit, v)
		}
	}
	if c.ReservationTTL <= 0 {
		return c, fmt.Errorf("--reservation-ttl must be positive, got %s", c.ReservationTTL)
	}
	if c.FleetPublishDebounce < 0 || c.FleetCheckEvery <= 0 {
		return c, fmt.Errorf("--fleet-publish-debounce must not be negative and --fleet-check-every must be positive, got %s and %s", c.FleetPublishDebounce, c.FleetCheckEvery)
	}
	if c.LaunchConcurrency < 0 || c.LaunchConcurrency > 1024 {
		return c, fmt.Errorf("--launch-concurrency must be 0 (from the CPUs) to 1024, got %d", c.LaunchConcurrency)
	}
	if c.TaskQueue == "" {
		return c, errors.New("--workflow-task-queue must not be empty")
	}
	return c, nil
}

// parseMiB reads a size in MiB: a number, or one with a suffix M, G or T
// (binary units).
func parseMiB(v string) (int64, error) {
	num, mul := v, int64(1)
	if n := len(v); n > 0 {
		switch v[n-1] {
		case 'M', 'm':
			num = v[:n-1]
		case 'G', 'g':
			num, mul = v[:n-1], 1<<10
		case 'T', 't':
			num, mul = v[:n-1], 1<<20
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n < 0 || n > math.MaxInt64/mul/(1<<20) {
		return 0, fmt.Errorf("%q is not a size (MiB, or a number with M, G or T)", v)
	}
	return n * mul, nil
}

// checkExecutable refuses a path that is not absolute or not an
// executable regular file, so a typo fails at start, not at the first
// release.
func checkExecutable(path string) error {
	if !filepath.IsAbs(path) {
		return fmt.Errorf("%q is not an absolute path", path)
	}
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() || st.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file (mode %v)", path, st.Mode())
	}
	return nil
}
