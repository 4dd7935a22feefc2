package gpu

// Whole GPUs by VFIO passthrough: the kernel ABI (bus/pci/devices/<addr>/
// {driver,driver_override,iommu_group,reset}, bus/pci/drivers/<drv>/unbind,
// bus/pci/drivers_probe). The claim, its lease and reconcile are the
// lease layer's; this file only reads and writes sysfs. The lease
// layer's use:
//
//	p := gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot, StateDir, DevRoot, Filter})
//	gpus, _ := p.GPUs(ctx) // place on one with Offered && Viable && !Marked, unclaimed
//	b, err := p.Bind(ctx, gpu.BindRequest{Group: gpu.Group, Intent: writeLease})
//	node, _ := p.NodeOf(b) // the group read live: the jail's node ("" when the card is gone)
//	p.DevicePath(addr)     // QEMU's sysfsdev per b.Addrs()
//	err = p.Return(ctx, b) // b as the lease recorded it; retry until nil
//
// A Binding names its card by identity: each function's address with the
// vendor:device (and PCIe serial number, where the card has one) it held
// when bound. The IOMMU group is read live at every use, since the kernel
// numbers groups anew when a card is added or removed; a function that
// is gone or holds another card counts as returned (ErrCardGone where a
// caller needs the card itself), and the card now there is a new device.
//
// BindRequest.Taken keeps invariant 10 under the host lock, as
// CreateRequest.Taken does; before Return the lease layer checks
// NotClaimedByOther for the functions, as it does before a vGPU release.
// No lock is held while a sysfs write is in flight (any may wait on a
// driver's remove): Bind holds the host lock only to decide and write
// its intent, and Return takes none: the lease says whose the group is.
//
// vmflow's mark is driver_override=vfio-pci: written before anything else
// and cleared last, so a function bound to vfio-pci without it was bound
// by someone else and Return never touches it.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"

	"vmflow/hostagent/topology"
	"vmflow/internal/errdefs"
)

// KindPassthrough names a whole GPU handed to a VM with vfio-pci.
const KindPassthrough Kind = "passthrough"

// Errors of passthrough callers branch on. Kernel errnos stay reachable
// (errors.Is(err, syscall.EIO)). A blocked unbind (the NVIDIA driver waits
// while a host process uses the GPU; vfio-pci waits while a VFIO user
// holds the device) is a *ReleaseInProgressError: ErrReleaseInProgress,
// Busy, retryable; a later call joins the write still in flight.
var (
	// ErrGroupNotViable: the group holds an endpoint the bind would not
	// take (not the GPU's card) bound to a kernel driver, so vfio cannot
	// own the group. Nothing was written.
	ErrGroupNotViable = errdefs.Refused.New("vgpu: IOMMU group not viable")
	// ErrNotGPU: the group holds no display-class function.
	ErrNotGPU = errdefs.Refused.New("vgpu: IOMMU group holds no GPU")
	// ErrVGPUParent: a GPU of the group serves vGPUs; one GPU is never
	// both.
	ErrVGPUParent = errdefs.Refused.New("vgpu: GPU serves vGPUs")
	// ErrNoGroup: no IOMMU group of that number (or a function vanished).
	ErrNoGroup = errdefs.NotFound.New("vgpu: no such IOMMU group")
	// ErrCardGone: a function a binding names is gone, or its address
	// holds another card (another vendor:device or serial number, or, for
	// a binding recorded without identities, another IOMMU group) than the
	// one bound. The card bound is not there to bind again; Return counts
	// it as returned.
	ErrCardGone = errdefs.NotFound.New("gpu: the bound card is no longer at its PCI address")
	// ErrAlreadyBound: a function of the group already has
	// driver_override set or is bound to vfio-pci, and the request does
	// not resume a recorded binding of it: another user may hold it.
	ErrAlreadyBound = errdefs.Conflict.New("vgpu: PCI function already bound to vfio-pci")
	// ErrNotOurs: Return met a function vmflow did not bind (bound to
	// vfio-pci without vmflow's driver_override, or another override).
	// It was left alone.
	ErrNotOurs = errdefs.Conflict.New("vgpu: PCI function not bound by vmflow")
	// ErrUnbindFailed: an unbind write failed.
	ErrUnbindFailed = errdefs.Unavailable.New("vgpu: unbind failed")
	// ErrResetFailed: the reset write failed; the function stays bound
	// to vfio-pci and claimed.
	ErrResetFailed = errdefs.Unavailable.New("vgpu: reset failed")
	// ErrProbeFailed: after drivers_probe the function is not bound to
	// the driver it should be (vfio-pci on bind, the previous driver on
	// return), or a driver_override or drivers_probe write failed.
	ErrProbeFailed = errdefs.Unavailable.New("vgpu: driver bind failed")
)

// GPUFilter is --gpu-passthrough: which display-class functions a host
// hands out whole. The zero value offers none.
type GPUFilter struct {
	all bool
	ids []string // vendor:device, lower case
}

// ParseGPUFilter reads "" (none), "all" (every display-class function not
// serving vGPUs) or a comma list of vendor:device ids ("10de:2335,10de:2330").
func ParseGPUFilter(s string) (GPUFilter, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return GPUFilter{}, nil
	}
	if strings.EqualFold(s, "all") {
		return GPUFilter{all: true}, nil
	}
	var f GPUFilter
	for _, id := range strings.Split(s, ",") {
		id = strings.ToLower(strings.TrimSpace(id))
		if !ValidPCIID(id) {
			return GPUFilter{}, fmt.Errorf("vgpu: --gpu-passthrough: %q is not a PCI vendor:device id (like 10de:2335) or all: %w", id, ErrInvalid)
		}
		f.ids = append(f.ids, id)
	}
	return f, nil
}

// ValidPCIID reports whether s is vendor:device in lower-case hex, 4 digits
// each ("10de:2335").
func ValidPCIID(s string) bool {
	v, d, ok := strings.Cut(s, ":")
	return ok && isHex4(v) && isHex4(d)
}

func isHex4(s string) bool {
	if len(s) != 4 {
		return false
	}
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Enabled reports whether the filter offers anything.
func (f GPUFilter) Enabled() bool { return f.all || len(f.ids) > 0 }

// String is the filter as --gpu-passthrough takes it.
func (f GPUFilter) String() string {
	if f.all {
		return "all"
	}
	return strings.Join(f.ids, ",")
}

// Match reports whether fn is offered by the filter (a display-class
// function of a listed id, or any with all). vGPU parents are excluded by
// GPU.Offered, not here.
func (f GPUFilter) Match(fn PCIFunction) bool {
	if !fn.IsDisplay() {
		return false
	}
	if f.all {
		return true
	}
	for _, id := range f.ids {
		if id == fn.ID() {
			return true
		}
	}
	return false
}

// GPU is one display-class function and what its IOMMU group allows.
type GPU struct {
	PCIFunction
	// PCILocality is where the GPU sits: its NUMA node and PCIe root
	// (unknown when sysfs cannot say).
	topology.PCILocality
	// Others are the other endpoint functions of its group (a companion
	// audio function, a second GPU, a foreign device); Bridges the
	// group's PCI bridges, which a bind leaves alone.
	Others  []PCIFunction `json:"others,omitempty"`
	Bridges []PCIFunction `json:"bridges,omitempty"`
	// Marked: vmflow bound it (driver_override is vfio-pci). Whether a
	// claim still holds it is the lease layer's to say.
	Marked bool `json:"marked,omitempty"`
	// VGPUParent: it serves vGPUs (mdev parent, SR-IOV PF with VFs, VF).
	VGPUParent bool `json:"vgpu_parent,omitempty"`
	// Viable: Bind could take its group now; NotViable says why not.
	Viable    bool   `json:"viable"`
	NotViable string `json:"not_viable,omitempty"`
	// Offered: the host's filter names it, it serves no vGPUs and its
	// group is viable (every endpoint of a GPU's own card): the lease
	// layer may place on it when unmarked and unclaimed.
	Offered bool `json:"offered,omitempty"`
}

// BoundFunction is one function of a Binding.
type BoundFunction struct {
	// Addr is the PCI address; QEMU gets one vfio-pci device per function.
	Addr string `json:"addr"`
	// Previous is the driver the function had before the bind ("" none);
	// Return binds it back. AnyDriver: not known (a marked function no
	// lease names, from MarkedGroups); Return lets drivers_probe choose.
	Previous string `json:"previous_driver,omitempty"`
	// Display: a GPU (not its companion audio function).
	Display bool `json:"display,omitempty"`
	// ID (vendor:device) and Serial (the PCIe device serial number, ""
	// when the card has none) are the card the function held when bound.
	// A function without an ID (a binding from before identities) is the
	// card bound while it is in the binding's recorded Group.
	ID     string `json:"id,omitempty"`
	Serial string `json:"serial,omitempty"`
}

// Holds reports whether live function f is still the card bf names
// (recorded is the binding's Group, which identifies a function recorded
// without an ID).
func (bf BoundFunction) Holds(f PCIFunction, recorded string) bool {
	if bf.ID == "" {
		return f.Group != "" && f.Group == recorded
	}
	return bf.ID == f.ID() && bf.Serial == f.Serial
}

// AnyDriver as a BoundFunction's Previous makes Return accept whatever
// driver drivers_probe binds, or none, so long as it is not vfio-pci.
const AnyDriver = "*"

// Binding is a group handed to vfio-pci: what the lease records. Its
// Functions may hold more than one display function (GPUs that share a
// group travel together). Group is the group when bound: a record for
// operators, and the identity of functions recorded without an ID.
type Binding struct {
	Group     string          `json:"iommu_group"`
	Functions []BoundFunction `json:"functions"`
}

// Addrs lists the functions' addresses, in address order.
func (b Binding) Addrs() []string {
	out := make([]string, len(b.Functions))
	for i, f := range b.Functions {
		out[i] = f.Addr
	}
	return out
}

// GPUs lists the display functions' addresses: what a failure of the
// binding counts against toward quarantine.
func (b Binding) GPUs() []string {
	var out []string
	for _, f := range b.Functions {
		if f.Display {
			out = append(out, f.Addr)
		}
	}
	return out
}

func (b Binding) find(addr string) (BoundFunction, bool) {
	for _, f := range b.Functions {
		if f.Addr == addr {
			return f, true
		}
	}
	return BoundFunction{}, false
}

// BindRequest asks for one IOMMU group.
type BindRequest struct {
	// Group is the IOMMU group's number, as GPUs listed it, for a fresh
	// bind; a resumed one reads the group of Resume's functions live.
	Group string
	// Resume is the binding a lease recorded (a retried or crashed bind,
	// or a launch after a reboot): its Previous drivers are kept, and
	// functions already bound to vfio-pci with vmflow's mark are taken as
	// done. A card no longer at its address refuses (ErrCardGone).
	// Nil: a fresh bind, which refuses a group any function of which is
	// bound to vfio-pci or has an override (ErrAlreadyBound).
	Resume *Binding
	// Intent, if set, is called under the host lock with the binding
	// (every function and the driver it has) before the first write: the
	// place to write the lease ahead. It is called on a resumed bind too,
	// so it must be idempotent. Its error aborts the bind.
	Intent func(Binding) error
	// Taken, if set, is called under the host lock before the lease and
	// any write, as CreateRequest.Taken: it maps the PCI addresses other
	// instances' held leases name to the instance (not group numbers,
	// which a reboot may give to another card). Invariant 10: a group any
	// of whose functions is in the map is refused (ErrClaimedByOther), so a lease written ahead by an
	// agent that died before its first write still keeps its group. Records
	// that cannot be read (ErrRecordsUnreadable) refuse a fresh bind, which
	// chooses among existing groups, and not a resumed one.
	Taken func(ctx context.Context) (map[string]string, error)
}

// PassthroughConfig configures the passthrough driver.
type PassthroughConfig struct {
	// SysfsRoot is where sysfs is mounted (default /sys).
	SysfsRoot string
	// StateDir holds the host-wide lock file vGPU placement uses too
	// (default /var/lib/vmflow).
	StateDir string
	// DevRoot holds the VFIO group nodes (default /dev).
	DevRoot string
	// Filter is --gpu-passthrough.
	Filter GPUFilter
	// Cmdline is the kernel command line's file (default /proc/cmdline),
	// which IOMMUUnsafe reads.
	Cmdline string
	// AfterWrite, if set, is called after each sysfs write of Bind or
	// Return succeeded, with the function and what was written
	// ("driver_override", "unbind", "drivers_probe", "reset"): where the
	// lease layer puts a crash point, so a kill between any two writes is
	// tried.
	AfterWrite func(addr, attr string)
}

// WithDefaults is c with every empty field that has a default set to it.
func (c PassthroughConfig) WithDefaults() PassthroughConfig {
	v := Config{SysfsRoot: c.SysfsRoot, StateDir: c.StateDir}.WithDefaults()
	c.SysfsRoot, c.StateDir = v.SysfsRoot, v.StateDir
	if c.DevRoot == "" {
		c.DevRoot = "/dev"
	}
	if c.Cmdline == "" {
		c.Cmdline = "/proc/cmdline"
	}
	return c
}

// Unsafe is IOMMUUnsafe of the host: why no GPU is offered or bound, ""
// when the IOMMU isolates. It is read at every listing and bind (a few
// small files), so a module reloaded with allow_unsafe_interrupts is seen
// at the next claim, not at the next agent start.
func (p *Passthrough) Unsafe() string { return IOMMUUnsafe(p.cfg.SysfsRoot, p.cfg.Cmdline) }

// Passthrough binds whole IOMMU groups to vfio-pci and returns them to the
// drivers they had.
type Passthrough struct {
	cfg      PassthroughConfig
	lock     *hostLock
	releases *releases // writes in flight, one per function (any may wait)
	// returning counts the Returns under way per function. Return holds
	// no lock, and between its writes (override cleared, probe not yet
	// written) a function looks unmarked and free: a fresh Bind in this
	// process must not take it then, or it would record no driver to go
	// back to and race the probe.
	mu        sync.Mutex
	returning map[string]int
}

// NewPassthrough returns the passthrough driver.
func NewPassthrough(cfg PassthroughConfig) *Passthrough {
	cfg = cfg.WithDefaults()
	return &Passthrough{cfg: cfg, lock: newHostLock(cfg.StateDir), releases: newReleases(nil), returning: map[string]int{}}
}

// Filter is the host's --gpu-passthrough.
func (p *Passthrough) Filter() GPUFilter { return p.cfg.Filter }

// DevicePath is the function's sysfs directory: QEMU's
// -device vfio-pci,sysfsdev=<it>.
func (p *Passthrough) DevicePath(addr string) string { return vfPath(p.cfg.SysfsRoot, addr) }

// VFIONode is the group's VFIO node, <DevRoot>/vfio/<group>, which the
// VM's jail needs and no other process may hold at release.
func (p *Passthrough) VFIONode(group string) string {
	return filepath.Join(p.cfg.DevRoot, "vfio", group)
}

// LiveGroup is the IOMMU group b's functions are in now, read from sysfs:
// ErrCardGone when any of them is gone or holds another card than b names
// (BoundFunction.Holds), or when they no longer share one group.
func (p *Passthrough) LiveGroup(b Binding) (string, error) {
	group := ""
	for _, bf := range b.Functions {
		f, err := p.read(bf.Addr)
		if errors.Is(err, ErrNoGroup) {
			return "", fmt.Errorf("vgpu: %s: %w: %w", bf.Addr, ErrCardGone, err)
		}
		if err != nil {
			return "", err
		}
		if !bf.Holds(f, b.Group) {
			return "", fmt.Errorf("vgpu: %s holds %s (serial %q, IOMMU group %q), not the card bound (%s, serial %q, IOMMU group %s): %w",
				bf.Addr, f.ID(), f.Serial, f.Group, orUnrecorded(bf.ID), bf.Serial, b.Group, ErrCardGone)
		}
		if group != "" && f.Group != group {
			return "", fmt.Errorf("vgpu: %s is in IOMMU group %s, apart from the rest of its binding (%s): %w", bf.Addr, f.Group, group, ErrCardGone)
		}
		group = f.Group
	}
	if group == "" {
		return "", fmt.Errorf("vgpu: a binding without functions: %w", ErrInvalid)
	}
	return group, nil
}

func orUnrecorded(id string) string {
	if id == "" {
		return "not recorded"
	}
	return id
}

// NodeOf is the VFIO node of b's group read live, "" when b's card is no
// longer there (nothing can hold it).
func (p *Passthrough) NodeOf(b Binding) (string, error) {
	g, err := p.LiveGroup(b)
	if errors.Is(err, ErrCardGone) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return p.VFIONode(g), nil
}

// GPUs lists every display-class PCI function on the host, in address
// order.
func (p *Passthrough) GPUs(ctx context.Context) ([]GPU, error) {
	fns, err := pciFunctions(ctx, p.cfg.SysfsRoot)
	if err != nil {
		return nil, err
	}
	groups := map[string][]PCIFunction{}
	for _, f := range fns {
		if f.Group != "" {
			groups[f.Group] = append(groups[f.Group], f)
		}
	}
	unsafe := p.Unsafe()
	var out []GPU
	for _, f := range fns {
		if !f.IsDisplay() {
			continue
		}
		g := GPU{PCIFunction: f, PCILocality: locality(p.cfg.SysfsRoot, f.Addr), Marked: f.Override == DriverVFIO, VGPUParent: isVGPUParent(p.cfg.SysfsRoot, f.Addr)}
		sharesWithVGPU, others := false, false
		for _, o := range groups[f.Group] {
			others = others || someoneElses(o)
			switch {
			case o.Addr == f.Addr:
			case o.IsBridge():
				g.Bridges = append(g.Bridges, o)
			default:
				g.Others = append(g.Others, o)
				sharesWithVGPU = sharesWithVGPU || (o.IsDisplay() && isVGPUParent(p.cfg.SysfsRoot, o.Addr))
			}
		}
		_, why := viable(groups[f.Group])
		if why == "" {
			why = noReset(groups[f.Group])
		}
		switch {
		case unsafe != "":
			g.NotViable = "passthrough refused on this host: " + unsafe
		case f.Group == "":
			g.NotViable = "no IOMMU group"
		case why != "":
			g.NotViable = why
		default:
			g.Viable = true
		}
		g.Offered = p.cfg.Filter.Match(f) && !g.VGPUParent && !sharesWithVGPU && !others && g.Viable
		out = append(out, g)
	}
	return out, nil
}

// viable is vmflow's rule for a group it hands out whole: every endpoint
// is a function of a GPU's own card (the slot of a display function: its
// audio function; the bind takes them all), and bridges are on pcieport
// or none. Any other endpoint refuses the group, with a driver or
// without: a NIC whose driver has not loaded yet (right after boot) is
// still someone else's device, and binding it to vfio-pci would hand it to
// the guest. The kernel does not refuse such a group at bind: since Linux
// 5.19 vfio-pci binds in a group that is not viable and only the VFIO
// user's open fails (EPERM), and a driverless endpoint does not make it
// unviable at all. It returns the cards' slots, or why the group is not
// offered ("group 42 also holds 0000:82:00.0 (network controller)").
func viable(fns []PCIFunction) (map[string]bool, string) {
	cards := map[string]bool{}
	group := ""
	for _, f := range fns {
		group = f.Group
		if f.IsDisplay() {
			cards[f.slot()] = true
		}
	}
	if len(cards) == 0 {
		return nil, fmt.Sprintf("group %s holds no GPU", group)
	}
	var foreign []string
	for _, f := range fns {
		switch {
		case f.IsBridge():
			if f.Driver != "" && f.Driver != DriverPCIePort {
				return nil, fmt.Sprintf("group %s: bridge %s is bound to %s", f.Group, f.Addr, f.Driver)
			}
		case cards[f.slot()]:
		default:
			foreign = append(foreign, fmt.Sprintf("%s (%s)", f.Addr, ClassName(f.Class)))
		}
	}
	if len(foreign) > 0 {
		return nil, fmt.Sprintf("group %s also holds %s", group, strings.Join(foreign, ", "))
	}
	return cards, ""
}

// noReset says which GPU of group fns has no reset method (the kernel
// shows no reset attribute for it), "" when each has one. Such a GPU is
// never handed out: nothing would clear what one tenant left in it before
// the next (Bind resets every function that can be, and so does Return).
func noReset(fns []PCIFunction) string {
	for _, f := range fns {
		if f.IsDisplay() && !f.HasReset {
			return fmt.Sprintf("%s has no reset method (no reset in sysfs): what a tenant leaves in it would reach the next", f.Addr)
		}
	}
	return ""
}

// viableErr is viable as Bind's error: ErrNotGPU or ErrGroupNotViable.
func viableErr(fns []PCIFunction) error {
	cards, why := viable(fns)
	switch {
	case why == "":
		return nil
	case cards == nil && !slices.ContainsFunc(fns, PCIFunction.IsDisplay):
		return fmt.Errorf("vgpu: %s: %w", why, ErrNotGPU)
	}
	return fmt.Errorf("vgpu: %s: %w", why, ErrGroupNotViable)
}

// plan is the binding Bind would make of group fns, or why it cannot:
// every endpoint is taken, bridges are left alone. resume supplies the
// previous drivers a lease recorded; without it a function already on
// vfio-pci or with an override refuses (another user may hold it).
func (p *Passthrough) plan(fns []PCIFunction, resume *Binding) (Binding, error) {
	if err := viableErr(fns); err != nil {
		return Binding{}, err
	}
	var b Binding
	for _, f := range fns {
		b.Group = f.Group
		if f.IsDisplay() && isVGPUParent(p.cfg.SysfsRoot, f.Addr) {
			return Binding{}, fmt.Errorf("vgpu: %s serves vGPUs: %w", f.Addr, ErrVGPUParent)
		}
	}
	if why := noReset(fns); why != "" {
		return Binding{}, fmt.Errorf("vgpu: %s: %w", why, ErrGroupNotViable)
	}
	for _, f := range fns {
		if f.IsBridge() {
			continue
		}
		if resume != nil {
			if rec, ok := resume.find(f.Addr); ok {
				rec.Display = f.IsDisplay()
				b.Functions = append(b.Functions, rec)
				continue
			}
		}
		if f.Override != "" || f.Driver == DriverVFIO {
			return Binding{}, fmt.Errorf("vgpu: %s (driver %q, driver_override %q): %w", f.Addr, f.Driver, f.Override, ErrAlreadyBound)
		}
		b.Functions = append(b.Functions, BoundFunction{Addr: f.Addr, Previous: f.Driver, Display: f.IsDisplay(), ID: f.ID(), Serial: f.Serial})
	}
	sort.Slice(b.Functions, func(i, j int) bool { return b.Functions[i].Addr < b.Functions[j].Addr })
	return b, nil
}

// someoneElses reports a function another user moved: on vfio-pci without
// vmflow's mark, or with an override of someone else's. Bind refuses its
// group (ErrAlreadyBound) and Return never touches it.
func someoneElses(f PCIFunction) bool {
	return (f.Driver == DriverVFIO && f.Override != DriverVFIO) || (f.Override != "" && f.Override != DriverVFIO)
}

// MarkedGroups lists every IOMMU group with a function that carries
// vmflow's mark (driver_override=vfio-pci), as a Binding of its marked
// functions with Previous AnyDriver: what reconcile returns when no claim
// names the group (it compares them with the leases, whose Previous
// drivers win).
func (p *Passthrough) MarkedGroups(ctx context.Context) ([]Binding, error) {
	fns, err := pciFunctions(ctx, p.cfg.SysfsRoot)
	if err != nil {
		return nil, err
	}
	var out []Binding
	at := map[string]int{}
	for _, f := range fns {
		if f.Override != DriverVFIO || f.Group == "" {
			continue
		}
		i, ok := at[f.Group]
		if !ok {
			i = len(out)
			at[f.Group] = i
			out = append(out, Binding{Group: f.Group})
		}
		out[i].Functions = append(out[i].Functions, BoundFunction{Addr: f.Addr, Previous: AnyDriver, Display: f.IsDisplay()})
	}
	return out, nil
}

// Bind hands every endpoint function of req.Group to vfio-pci: per
// function, driver_override=vfio-pci, unbind from its driver,
// drivers_probe, and a check that vfio-pci has it. Bridges are left
// alone. A group that is not viable is refused before any write. It is
// idempotent with req.Resume: a half-done bind completes.
func (p *Passthrough) Bind(ctx context.Context, req BindRequest) (Binding, error) {
	b, err := p.intend(ctx, req)
	if err != nil {
		return Binding{}, err
	}
	// The writes run without the host lock: an unbind may wait on a
	// driver's remove for as long as a host process holds the GPU, and
	// every other claim on the host would wait behind it. The intent (and
	// Taken, for the others) already keeps the group this claim's.
	for _, bf := range b.Functions {
		if err := p.bindOne(ctx, bf.Addr); err != nil {
			return b, err
		}
	}
	// Reset on vfio-pci, before the tenant's QEMU opens it: whatever the
	// host driver or an earlier tenant left in the card does not reach
	// this one (the release resets too; this one also covers a card a
	// crash left unreset, and the first tenant after boot).
	for _, bf := range b.Functions {
		if err := p.reset(ctx, bf.Addr); err != nil {
			return b, err
		}
	}
	return b, nil
}

// reset resets addr's function when it offers a reset method.
func (p *Passthrough) reset(ctx context.Context, addr string) error {
	f, err := p.settled(ctx, addr)
	if err != nil {
		return err
	}
	if !f.HasReset {
		return nil
	}
	if err := p.write(ctx, addr, "reset", "1"); err != nil {
		return failed(err, ErrResetFailed, "reset "+addr)
	}
	return nil
}

// intend is Bind's decision, under the host lock: the group read live,
// Taken checked, the binding planned and its intent written. It writes
// nothing to sysfs.
func (p *Passthrough) intend(ctx context.Context, req BindRequest) (Binding, error) {
	if why := p.Unsafe(); why != "" {
		return Binding{}, fmt.Errorf("vgpu: %s: %w", why, ErrUnsafeIOMMU)
	}
	unlock, err := p.lock.lock(ctx)
	if err != nil {
		return Binding{}, err
	}
	defer unlock()
	group := req.Group
	if req.Resume != nil {
		if group, err = p.LiveGroup(*req.Resume); err != nil {
			return Binding{}, err
		}
	}
	fns, err := groupFunctions(ctx, p.cfg.SysfsRoot, group)
	if err != nil {
		return Binding{}, err
	}
	taken, err := readTaken(ctx, req.Taken, req.Resume == nil)
	if err != nil {
		return Binding{}, fmt.Errorf("vgpu: bind group %s: %w", group, err)
	}
	for _, f := range fns {
		if err := claimedBy(taken, f.Addr); err != nil {
			return Binding{}, fmt.Errorf("vgpu: IOMMU group %s: %w", group, err)
		}
		if req.Resume == nil && p.beingReturned(f.Addr) {
			return Binding{}, fmt.Errorf("vgpu: %s: a return to its driver is under way: %w", f.Addr, ErrAlreadyBound)
		}
	}
	if req.Resume != nil {
		for _, rf := range req.Resume.Functions {
			if !hasAddr(fns, rf.Addr) {
				return Binding{}, fmt.Errorf("vgpu: recorded function %s is not in IOMMU group %s: %w", rf.Addr, group, ErrCardGone)
			}
		}
	}
	b, err := p.plan(fns, req.Resume)
	if err != nil {
		return Binding{}, err
	}
	if req.Intent != nil {
		if err := req.Intent(b); err != nil {
			return Binding{}, fmt.Errorf("vgpu: bind group %s: intent: %w", group, err)
		}
	}
	return b, nil
}

func hasAddr(fns []PCIFunction, addr string) bool {
	for _, f := range fns {
		if f.Addr == addr {
			return true
		}
	}
	return false
}

// bindOne moves one function to vfio-pci, from whatever step a previous
// attempt reached.
func (p *Passthrough) bindOne(ctx context.Context, addr string) error {
	f, err := p.settled(ctx, addr)
	if err != nil {
		return err
	}
	if f.Override != DriverVFIO {
		if err := p.write(ctx, addr, "driver_override", DriverVFIO); err != nil {
			return failed(err, ErrProbeFailed, addr+" driver_override")
		}
	}
	if f.Driver == DriverVFIO {
		return nil
	}
	if f.Driver != "" {
		if err := p.unbind(ctx, f.Addr, f.Driver); err != nil {
			return err
		}
	}
	return p.probe(ctx, addr, DriverVFIO)
}

// Return resets each function of b (where it offers reset), unbinds it
// from vfio-pci, clears driver_override and binds it back to the driver it
// had (drivers_probe), checking that driver has it. It is idempotent: a
// function already back ("already returned") is success, and a half-done
// return completes. Unbind comes before clearing the override so that
// vmflow's mark outlives every step but the last. A function vmflow did not
// bind is never touched (ErrNotOurs).
//
// It takes no host lock: the lease, not the lock, says whose the group is
// (the lease layer checks that no other lease names it first), and a
// blocked unbind must not stop every other claim on the host. A function
// that is gone, or whose address holds another card than b names
// (BoundFunction.Holds), counts as returned: the card bound is not there,
// and the one there now is a new device, never touched for b.
func (p *Passthrough) Return(ctx context.Context, b Binding, opts ...ReturnOption) error {
	var o returnOptions
	for _, opt := range opts {
		opt(&o)
	}
	defer p.beginReturn(b)()
	for _, bf := range b.Functions {
		if err := p.returnOne(ctx, bf, b.Group, o); err != nil {
			return err
		}
	}
	return nil
}

// ReturnOption shapes one Return.
type ReturnOption func(*returnOptions)

type returnOptions struct {
	resetFailed func(addr string, cause error) error
}

// QuarantineOnResetFailure lets a Return whose reset failed go on
// returning the function to its driver once quarantine(addr, cause) has
// taken the card out of placement (nil error): the card may still hold
// what its tenant left, but no tenant gets it until an operator clears
// it, and the tenant's delete (or the claim's rollback) is not stuck on a
// reset that keeps failing. Without it, or when quarantine fails, the
// Return fails with ErrResetFailed and the function stays on vfio-pci.
func QuarantineOnResetFailure(quarantine func(addr string, cause error) error) ReturnOption {
	return func(o *returnOptions) { o.resetFailed = quarantine }
}

// beginReturn counts b's functions as being returned until the function
// it returns is called.
func (p *Passthrough) beginReturn(b Binding) func() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, bf := range b.Functions {
		p.returning[bf.Addr]++
	}
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, bf := range b.Functions {
			if p.returning[bf.Addr]--; p.returning[bf.Addr] <= 0 {
				delete(p.returning, bf.Addr)
			}
		}
	}
}

// beingReturned reports whether a Return of addr is under way.
func (p *Passthrough) beingReturned(addr string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.returning[addr] > 0
}

func (p *Passthrough) returnOne(ctx context.Context, bf BoundFunction, group string, o returnOptions) error {
	f, err := p.settled(ctx, bf.Addr)
	if errors.Is(err, ErrNoGroup) {
		return nil // gone: nothing left to return
	}
	if err != nil {
		return err
	}
	switch {
	case !bf.Holds(f, group):
		return nil // another card: not the one bound
	case someoneElses(f):
		return fmt.Errorf("vgpu: %s (driver %q, driver_override %q) was moved by someone else: %w", f.Addr, f.Driver, f.Override, ErrNotOurs)
	case f.Override == "" && f.Driver == "" && bf.Previous != "" && bf.Previous != AnyDriver:
		// Cleared but not yet probed: finish.
		return p.probe(ctx, f.Addr, bf.Previous)
	case f.Override == "":
		return nil // already returned (or someone bound it elsewhere since)
	}
	// Ours: driver_override is vfio-pci.
	if f.Driver != "" && f.Driver != DriverVFIO && f.Driver != bf.Previous && bf.Previous != AnyDriver {
		return fmt.Errorf("vgpu: %s is bound to %s, neither vfio-pci nor its previous driver %q: %w", f.Addr, f.Driver, bf.Previous, ErrNotOurs)
	}
	if f.Driver == DriverVFIO {
		if err := p.reset(ctx, f.Addr); err != nil {
			if o.resetFailed == nil || !errors.Is(err, ErrResetFailed) {
				return err
			}
			if qerr := o.resetFailed(f.Addr, err); qerr != nil {
				return fmt.Errorf("%w; quarantining the card: %w", err, qerr)
			}
		}
		if err := p.unbind(ctx, f.Addr, DriverVFIO); err != nil {
			return err
		}
	}
	if err := p.write(ctx, f.Addr, "driver_override", "\n"); err != nil {
		return failed(err, ErrProbeFailed, f.Addr+" clear driver_override")
	}
	if f.Driver == bf.Previous || bf.Previous == "" || (bf.Previous == AnyDriver && f.Driver != DriverVFIO && f.Driver != "") {
		return nil
	}
	return p.probe(ctx, f.Addr, bf.Previous)
}

func (p *Passthrough) read(addr string) (PCIFunction, error) {
	f, err := readPCIFunction(p.cfg.SysfsRoot, addr)
	if errors.Is(err, os.ErrNotExist) {
		return PCIFunction{}, fmt.Errorf("vgpu: PCI function %s: %w: %w", addr, ErrNoGroup, err)
	}
	return f, err
}

// writeKey names addr's writes in the registry of writes in flight: one
// at a time per function, as the kernel's device lock allows.
func writeKey(addr string) Device { return Device{Kind: KindPassthrough, ID: addr} }

// settled waits for a write to addr an earlier call left in flight (it
// holds the function's device lock in the kernel, so nothing else would
// get through), then reads the function.
func (p *Passthrough) settled(ctx context.Context, addr string) (PCIFunction, error) {
	if err := p.releases.settle(ctx, writeKey(addr)); err != nil {
		return PCIFunction{}, fmt.Errorf("vgpu: %s: an earlier write is still running: %w", addr, err)
	}
	return p.read(addr)
}

// write writes one attribute of addr's function. Any write to a function
// may wait: the kernel takes its device lock for driver_override, reset,
// unbind and drivers_probe, and a driver's remove holds it until the
// device's users are gone. ctx bounds the wait, not the write, which goes
// on and which the next call waits for (ErrReleaseInProgress, Busy).
func (p *Passthrough) write(ctx context.Context, addr, attr, val string) error {
	return p.writePath(ctx, addr, filepath.Join(p.DevicePath(addr), attr), val)
}

func (p *Passthrough) writePath(ctx context.Context, addr, path, val string) error {
	err := p.releases.do(ctx, writeKey(addr), func() error { return writeAttr(path, val) })
	if err == nil && p.cfg.AfterWrite != nil {
		p.cfg.AfterWrite(addr, filepath.Base(path))
	}
	return err
}

// unbind writes addr to drivers/<drv>/unbind; ENODEV with the function
// no longer on drv is success.
func (p *Passthrough) unbind(ctx context.Context, addr, drv string) error {
	err := p.writePath(ctx, addr, filepath.Join(p.cfg.SysfsRoot, "bus", "pci", "drivers", drv, "unbind"), addr)
	if err == nil {
		return nil
	}
	if !errors.Is(err, ErrReleaseInProgress) {
		if f, rerr := p.read(addr); rerr == nil && f.Driver != drv {
			return nil
		}
	}
	return failed(err, ErrUnbindFailed, "unbind "+addr+" from "+drv)
}

// probe writes addr to drivers_probe and checks that want has it.
func (p *Passthrough) probe(ctx context.Context, addr, want string) error {
	if err := p.writePath(ctx, addr, filepath.Join(p.cfg.SysfsRoot, "bus", "pci", "drivers_probe"), addr); err != nil {
		return failed(err, ErrProbeFailed, "drivers_probe "+addr)
	}
	f, err := p.read(addr)
	if err != nil {
		return err
	}
	if want == AnyDriver && f.Driver != DriverVFIO {
		return nil
	}
	if f.Driver != want {
		return fmt.Errorf("vgpu: %s is bound to %q after drivers_probe, not %s (is its module loaded?): %w", addr, f.Driver, want, ErrProbeFailed)
	}
	return nil
}

// failed wraps a write's error in its failure class as, except a write
// still waiting (ErrReleaseInProgress), which is only Busy: nothing failed.
func failed(err, as error, what string) error {
	if errors.Is(err, ErrReleaseInProgress) {
		return fmt.Errorf("vgpu: %s: %w", what, err)
	}
	return fmt.Errorf("vgpu: %s: %w: %w", what, as, err)
}
