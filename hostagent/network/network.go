// Package network puts VMs on their host's network: one bridge per host
// (the guests' gateway, on the first address of the host's subnet, its MAC
// pinned), a TAP per VM that is a port of it (owned by the VM's uid,
// isolated from the other ports, learning nothing, flooded nothing, its
// guest's MAC a static FDB entry; l2.go), an address per VM from the
// subnet, and optional egress NAT. A VM's
// TAP, MAC and address are a lease in its record (store.KindNetwork),
// written before the TAP exists and held until the TAP is removed after the
// VM's thread group is gone; an address is named by at most one record on
// the host. Everything lives in one network namespace (Config.NetNS, the
// host's own in production); QEMU gets only the TAP's open descriptor.
package network

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"go.uber.org/zap"

	"vmflow/hostagent/lease"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
)

// Errors, each in its class.
var (
	// ErrInvalid: a configuration value or a recorded lease is malformed.
	ErrInvalid = errdefs.InvalidInput.New("network: invalid")
	// ErrNoNetwork: the host has no network (no --net-subnet) and a VM asks
	// for one.
	ErrNoNetwork = errdefs.Refused.New("network: this host has no network")
	// ErrMisconfigured: what the host has under the configured names is not
	// what the agent would make (a link named like the bridge that is no
	// bridge, a namespace that cannot be entered).
	ErrMisconfigured = errdefs.Misconfigured.New("network: host misconfigured")
	// ErrNoAddress: every address of the subnet is named by a record.
	ErrNoAddress = errdefs.NoCapacity.New("network: no free address in the subnet")
	// ErrRecordsUnreadable: a record that cannot be read may name an
	// address, so none is placed until it is repaired ("can't tell" is
	// taken).
	ErrRecordsUnreadable = errdefs.Unavailable.New("network: records unreadable")
	// ErrNotOurs: a link under the lease's TAP name is not a TAP (another
	// tool made it); it is never touched.
	ErrNotOurs = errdefs.Conflict.New("network: link is not this lease's TAP")
	// ErrVMAlive: the VM may still run, so its TAP and address are kept
	// (invariant 2): the lease engine's one refusal, for every kind.
	ErrVMAlive = lease.ErrVMAlive
	// ErrLeaseNotActive: the lease is releasing: no launch may use it.
	ErrLeaseNotActive = errdefs.DeviceMissing.New("network: lease not active")
)

// Defaults.
const (
	DefaultBridge = "vmflow0"
	// TAPPrefix starts every TAP name the agent makes: reconcile removes
	// only TAPs with it that no record leases.
	TAPPrefix = "vmtap"
	// DefaultOrphanGrace is how long a TAP no record leases is left before
	// reconcile removes it: an operator who made one by hand, or is
	// repairing a record, sees it named in the log first.
	DefaultOrphanGrace = 5 * time.Minute
	// DefaultPortPPS is each guest port's frames a second: enough for a
	// guest's bulk TCP (QEMU hands the bridge segments of up to 64 KiB,
	// one frame each: 10 Gbit/s is about 20,000) and for small-packet
	// traffic of about 1 Gbit/s at 1,200 bytes, while a flood of minimum
	// frames from one guest is cut to a bounded share of the host.
	DefaultPortPPS = 100_000
	// netlinkTimeout bounds every netlink request's send and receive.
	netlinkTimeout = 10 * time.Second
	// lockFile is the host-wide placement lock, in the state dir.
	lockFile = "network.lock"
)

// Config configures Net.
type Config struct {
	// Bridge is the bridge's name (DefaultBridge when empty).
	Bridge string
	// Subnet is the host's IPv4 subnet: the bridge takes its first address
	// (the guests' gateway), VMs the others. Required.
	Subnet netip.Prefix
	// Egress, when set, is the uplink whose address guests' traffic is
	// masqueraded behind (nftables).
	Egress string
	// Deny are IPv4 ranges guests never reach through Egress (the
	// operator's management networks), besides those always denied
	// (hostpath.go).
	Deny []netip.Prefix
	// NetNS names the network namespace (/run/netns/NAME) the bridge and
	// TAPs live in; empty: the agent's own.
	NetNS string
	// Store holds the records whose leases name the addresses.
	Store *store.Store
	// PortPPS bounds the frames a second each guest's TAP may send into
	// the bridge (DefaultPortPPS when 0); over it frames are dropped and
	// counted (guard.go).
	PortPPS uint32
	// OrphanGrace: see DefaultOrphanGrace.
	OrphanGrace time.Duration
	Logger      *zap.Logger
	// Now stamps the records (time.Now when nil).
	Now func() time.Time
}

// WithDefaults is c with every zero field that has a default set to it.
func (c Config) WithDefaults() Config {
	if c.Bridge == "" {
		c.Bridge = DefaultBridge
	}
	if c.PortPPS == 0 {
		c.PortPPS = DefaultPortPPS
	}
	if c.OrphanGrace <= 0 {
		c.OrphanGrace = DefaultOrphanGrace
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// Net is a host's network: its bridge, its address pool over the records,
// the VMs' TAPs.
type Net struct {
	cfg     Config
	gateway netip.Addr
	ns      netns.NsHandle // -1: the agent's own namespace
	h       *netlink.Handle
	lock    string
	mu      sync.Mutex
	seen    map[string]time.Time // reconcile's first sightings of unleased TAPs, under mu
	// afterList, set by tests only, runs in ReconcileTAPs between its read
	// of the records and its removals: where a placement would race it.
	afterList func()
	gmu       sync.Mutex // orders changes of the guard's set (guard.go)
	kmu       sync.Mutex // guards key
	key       []byte     // the host's MAC key once read (mackey.go), under kmu
	fdbOnce   sync.Once  // says once that the kernel has no FDB bound (l2.go)
}

// New checks cfg and opens a netlink handle in its namespace. It changes
// nothing on the host: EnsureBridge does.
func New(cfg Config) (*Net, error) {
	cfg = cfg.WithDefaults()
	if cfg.Store == nil {
		return nil, fmt.Errorf("%w: no store", ErrInvalid)
	}
	gw, err := Gateway(cfg.Subnet)
	if err != nil {
		return nil, err
	}
	if err := checkIfName("bridge", cfg.Bridge); err != nil {
		return nil, err
	}
	if strings.HasPrefix(cfg.Bridge, TAPPrefix) {
		return nil, fmt.Errorf("%w: bridge %q starts with the TAP prefix %q", ErrInvalid, cfg.Bridge, TAPPrefix)
	}
	if cfg.Egress != "" {
		if err := checkIfName("egress", cfg.Egress); err != nil {
			return nil, err
		}
	}
	if err := checkHostPath(cfg); err != nil {
		return nil, err
	}
	n := &Net{cfg: cfg, gateway: gw, ns: netns.None(), lock: filepath.Join(cfg.Store.StateDir(), lockFile), seen: map[string]time.Time{}}
	if cfg.NetNS != "" {
		if strings.ContainsAny(cfg.NetNS, "/\x00") || cfg.NetNS == "." || cfg.NetNS == ".." {
			return nil, fmt.Errorf("%w: netns %q: want a name under /run/netns", ErrInvalid, cfg.NetNS)
		}
		if n.ns, err = netns.GetFromName(cfg.NetNS); err != nil {
			return nil, fmt.Errorf("%w: open netns %q: %w", ErrMisconfigured, cfg.NetNS, err)
		}
		n.h, err = netlink.NewHandleAt(n.ns)
	} else {
		n.h, err = netlink.NewHandle()
	}
	if err != nil {
		n.Close()
		return nil, fmt.Errorf("network: netlink handle: %w", err)
	}
	// The kernel answers at once; a bound keeps a wedged answer from
	// holding an instance's lock for ever.
	if err := n.h.SetSocketTimeout(netlinkTimeout); err != nil {
		n.Close()
		return nil, fmt.Errorf("network: netlink handle: %w", err)
	}
	return n, nil
}

// Close releases the handle and the namespace's descriptor.
func (n *Net) Close() {
	if n.h != nil {
		n.h.Close()
	}
	if n.ns.IsOpen() {
		n.ns.Close()
	}
}

// Bridge is the bridge's name.
func (n *Net) Bridge() string { return n.cfg.Bridge }

// Subnet is the host's subnet.
func (n *Net) Subnet() netip.Prefix { return n.cfg.Subnet }

// Gateway is subnet's first address, the bridge's own: the guests' gateway.
// The subnet must be IPv4, masked, and leave room for at least one guest.
func Gateway(subnet netip.Prefix) (netip.Addr, error) {
	if !subnet.IsValid() || !subnet.Addr().Is4() {
		return netip.Addr{}, fmt.Errorf("%w: subnet %q: want an IPv4 CIDR", ErrInvalid, subnet)
	}
	if subnet.Masked() != subnet {
		return netip.Addr{}, fmt.Errorf("%w: subnet %s: host bits set (want %s)", ErrInvalid, subnet, subnet.Masked())
	}
	if subnet.Bits() > 30 {
		return netip.Addr{}, fmt.Errorf("%w: subnet %s: want a prefix of at most /30 (a gateway and a guest)", ErrInvalid, subnet)
	}
	return subnet.Addr().Next(), nil
}

// checkIfName accepts a Linux interface name: 1-15 bytes, no '/', ':',
// whitespace or NUL, not "." or "..".
func checkIfName(field, name string) error {
	if name == "" || len(name) > 15 || name == "." || name == ".." || strings.ContainsAny(name, "/: \t\n\x00") {
		return fmt.Errorf("%w: %s %q: want an interface name of 1-15 bytes", ErrInvalid, field, name)
	}
	return nil
}

// TAPName is the TAP of the lease on addr: the prefix and the address in
// hex, unique among held leases as their addresses are.
func TAPName(addr netip.Addr) string {
	b := addr.As4()
	return fmt.Sprintf("%s%08x", TAPPrefix, binary.BigEndian.Uint32(b[:]))
}

// hostLock takes the host-wide placement lock: two launches never pick one
// address. flock excludes two descriptors of one process as it does two
// processes.
func (n *Net) hostLock(ctx context.Context) (*fsx.Lock, error) {
	l, err := fsx.LockFile(ctx, n.lock)
	if err != nil {
		if errors.Is(err, fsx.ErrLockHeld) {
			return nil, fmt.Errorf("network: host lock: %w: %w", store.ErrBusy, err)
		}
		return nil, fmt.Errorf("network: host lock: %w", err)
	}
	return l, nil
}
