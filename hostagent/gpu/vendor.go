package gpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"

	"vmflow/hostagent/topology"
	"vmflow/internal/fsx"
)

// VendorDriver drives NVIDIA's SR-IOV "vendor VFIO" vGPUs (vGPU 17+):
// bus/pci/devices/<vf>/nvidia/{creatable_vgpu_types,current_vgpu_type}.
// A vGPU is a VF with a non-zero current_vgpu_type; sysfs keeps no UUID for
// it, so Device.ID is the VF's address.
type VendorDriver struct {
	root     string
	lock     *hostLock
	releases *releases

	// names remembers type names seen in creatable_vgpu_types: a type
	// drops out of every list once the GPU is full of it, and a busy VF
	// lists nothing, yet its devices still need their profile name. Kept
	// in namesFile too: an agent restarted while every VF is busy (a crash
	// mid-claim) would otherwise know no name, and admission would refuse
	// the host's own profile as "not offered" (InvalidInput) instead of
	// waiting for room.
	mu        sync.Mutex
	names     map[int]string
	namesFile string // "" keeps them in memory only
}

// vendorNamesFile, in the state dir, holds the type names the driver has
// seen, one "ID name" line each.
const vendorNamesFile = "vgpu-vendor-type-names"

var _ Driver = (*VendorDriver)(nil)

// NewVendor returns a vendor-VFIO driver; cfg.Kind is ignored.
func NewVendor(cfg Config) *VendorDriver {
	cfg = cfg.WithDefaults()
	d := &VendorDriver{root: cfg.SysfsRoot, lock: newHostLock(cfg.StateDir), releases: newReleases(cfg.OnReleaseDone), names: map[int]string{}}
	if cfg.StateDir != "" {
		d.namesFile = filepath.Join(cfg.StateDir, vendorNamesFile)
		// A missing or unreadable file only means names learned again
		// from the next free VF.
		if b, err := os.ReadFile(d.namesFile); err == nil {
			for _, t := range parseCreatable(string(b)) {
				d.names[t.id] = t.name
			}
		}
	}
	return d
}

// Kind implements Driver.
func (d *VendorDriver) Kind() Kind { return KindVendor }

func (d *VendorDriver) vfDir(vf string) string { return vfPath(d.root, vf) }

// DevicePath implements Driver. The guest also needs -uuid dev.UUID.
func (d *VendorDriver) DevicePath(dev Device) string { return d.vfDir(dev.ID) }

type vendorType struct {
	id   int
	name string
}

// vfState is one VF as sysfs shows it now.
type vfState struct {
	addr, parent string
	current      int          // 0 when free
	creatable    []vendorType // empty while in use
	// taken: free in sysfs, but another instance's held claim names it.
	taken bool
}

// parseCreatable reads "ID : name" lines; the header and anything else
// without a numeric id is skipped.
func parseCreatable(s string) []vendorType {
	var out []vendorType
	for _, line := range strings.Split(s, "\n") {
		left, right, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		id, err := strconv.Atoi(strings.TrimSpace(left))
		if err != nil || id <= 0 {
			continue
		}
		out = append(out, vendorType{id: id, name: strings.TrimSpace(right)})
	}
	return out
}

// scan reads every VF that has NVIDIA's vendor files.
func (d *VendorDriver) scan(ctx context.Context) ([]vfState, error) {
	// A PCI device without NVIDIA's files is not a vGPU-capable VF (or it
	// went away): readVF reports ErrNotExist and it is skipped.
	out, err := readEntries(ctx, filepath.Join(d.root, "bus", "pci", "devices"), "PCI devices", d.readVF)
	if err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return out[i].addr < out[j].addr })
	return out, nil
}

func (d *VendorDriver) readVF(addr string) (vfState, error) {
	dir := d.vfDir(addr)
	cr, err := os.ReadFile(filepath.Join(dir, "nvidia", "creatable_vgpu_types"))
	if err != nil {
		return vfState{}, err
	}
	cur, err := d.current(addr)
	if err != nil {
		return vfState{}, err
	}
	parent := addr
	if pf, err := os.Readlink(filepath.Join(dir, "physfn")); err == nil {
		parent = filepath.Base(pf)
	}
	return vfState{addr: addr, parent: parent, current: cur, creatable: parseCreatable(string(cr))}, nil
}

func (d *VendorDriver) current(vf string) (int, error) {
	s, err := readAttr(filepath.Join(d.vfDir(vf), "nvidia", "current_vgpu_type"))
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0, fmt.Errorf("vgpu: VF %s: current_vgpu_type %q: %w", vf, s, err)
	}
	return n, nil
}

// typeNames maps type ids to names from every VF's creatable list and the
// names seen before.
func (d *VendorDriver) typeNames(vfs []vfState) map[int]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	learned := false
	for _, vf := range vfs {
		for _, t := range vf.creatable {
			if d.names[t.id] != t.name {
				d.names[t.id], learned = t.name, true
			}
		}
	}
	if learned {
		d.saveNames()
	}
	names := make(map[int]string, len(d.names))
	for id, n := range d.names {
		names[id] = n
	}
	return names
}

// saveNames writes d.names to namesFile (under d.mu), best effort: on a
// failure (a full disk) they stay in memory, and the next new name tries
// again.
func (d *VendorDriver) saveNames() {
	if d.namesFile == "" {
		return
	}
	ids := make([]int, 0, len(d.names))
	for id := range d.names {
		ids = append(ids, id)
	}
	sort.Ints(ids)
	var b strings.Builder
	for _, id := range ids {
		// A name is one line of sysfs text: a line break in it would
		// forge another entry.
		fmt.Fprintf(&b, "%d : %s\n", id, strings.Map(func(r rune) rune {
			if r == '\n' || r == '\r' {
				return ' '
			}
			return r
		}, d.names[id]))
	}
	_ = fsx.WriteFile(d.namesFile, []byte(b.String()), nil)
}

func vendorProfiles(vfs []vfState, names map[int]string) []Profile {
	type key struct {
		parent string
		id     int
	}
	used := map[string]int{}
	avail := map[key]int{}
	for _, vf := range vfs {
		if vf.current != 0 {
			used[vf.parent]++
			if _, ok := avail[key{vf.parent, vf.current}]; !ok {
				avail[key{vf.parent, vf.current}] = 0 // listed, even when full
			}
			continue
		}
		for _, t := range vf.creatable {
			avail[key{vf.parent, t.id}]++
		}
	}
	var out []Profile
	for k, n := range avail {
		out = append(out, Profile{Name: names[k.id], TypeID: strconv.Itoa(k.id), Parent: k.parent, Available: n, Used: used[k.parent]})
	}
	sortProfiles(out)
	return out
}

// Profiles implements Driver.
func (d *VendorDriver) Profiles(ctx context.Context) ([]Profile, error) {
	vfs, err := d.scan(ctx)
	if err != nil {
		return nil, err
	}
	return d.located(vendorProfiles(vfs, d.typeNames(vfs))), nil
}

// located is profs with each parent's locality (a placement near a node
// reads it too).
func (d *VendorDriver) located(profs []Profile) []Profile {
	locs := map[string]topology.PCILocality{}
	for i, p := range profs {
		if _, ok := locs[p.Parent]; !ok {
			locs[p.Parent] = locality(d.root, p.Parent)
		}
		profs[i].PCILocality = locs[p.Parent]
	}
	return profs
}

// Devices implements Driver.
func (d *VendorDriver) Devices(ctx context.Context) ([]Device, error) {
	vfs, err := d.scan(ctx)
	if err != nil {
		return nil, err
	}
	names := d.typeNames(vfs)
	var out []Device
	for _, vf := range vfs {
		if vf.current == 0 {
			continue
		}
		out = append(out, Device{Kind: KindVendor, ID: vf.addr, Profile: names[vf.current], TypeID: strconv.Itoa(vf.current), Parent: vf.parent})
	}
	return out, nil
}

// Create implements Driver: writes the type id to a free VF's
// current_vgpu_type and reads it back.
func (d *VendorDriver) Create(ctx context.Context, req CreateRequest) (Device, error) {
	id, err := canonicalUUID(req.UUID)
	if err != nil {
		return Device{}, fmt.Errorf("vgpu: create vendor vGPU: %w", err)
	}
	unlock, err := d.lock.lock(ctx)
	if err != nil {
		return Device{}, err
	}
	defer unlock()

	// Sysfs shows a VF free the moment its release write returns, but the
	// claim naming it is held until its release is recorded: the records,
	// not sysfs, say which VFs are taken (invariant 10).
	taken, err := req.taken(ctx, req.At == nil)
	if err != nil {
		return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s: taken VFs: %w", id, err)
	}
	var pl Placement
	if req.At != nil {
		pl = *req.At
		if !pciAddr.MatchString(pl.VF) {
			return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s at %+v: %w", id, pl, ErrInvalid)
		}
		if err := claimedBy(taken, pl.VF); err != nil {
			return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s: %w", id, err)
		}
	} else {
		vfs, err := d.scan(ctx)
		if err != nil {
			return Device{}, err
		}
		held, err := req.held(ctx)
		if err != nil {
			return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s: held claims: %w", id, err)
		}
		running := map[string]bool{}
		for _, vf := range vfs {
			if vf.current != 0 {
				running[vf.addr] = true
			}
		}
		names := d.typeNames(vfs)
		vfs = withoutTaken(vfs, taken) // a held claim's VF is left out: no slot to count
		pl, err = place(reserveHeld(d.located(vendorProfiles(vfs, names)), held, running, false), req)
		if errors.Is(err, ErrUnknownProfile) && anyBusy(vfs) {
			// Busy and taken VFs list nothing and full types drop out
			// of the lists: the name may be real but not creatable now.
			err = fmt.Errorf("profile %q not creatable now: %w", req.Profile, ErrNoCapacity)
		}
		if err != nil {
			return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s: %w", id, err)
		}
		pl.VF = freeVF(vfs, pl)
		if pl.VF == "" { // cannot happen: Available counted such a VF
			return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s: profile %q: %w", id, req.Profile, ErrNoCapacity)
		}
	}
	typeID, err := strconv.Atoi(pl.TypeID)
	if err != nil || typeID <= 0 {
		return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s: type %q: %w", id, pl.TypeID, ErrInvalid)
	}
	dev := Device{Kind: KindVendor, ID: pl.VF, UUID: id, Profile: pl.Profile, TypeID: pl.TypeID, Parent: pl.Parent}

	if req.At != nil {
		// Finishing a recorded intent or re-creating an active claim's
		// device: no other claim names the VF (checked above), so a VF
		// running the type is ours; one running another type is not.
		cur, err := d.current(pl.VF)
		if err != nil {
			return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s on %s: %w", id, pl.VF, err)
		}
		switch cur {
		case typeID:
			d.releases.forget(dev)
			return dev, nil
		case 0:
		default:
			return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s on %s: VF runs type %d, not %d: %w", id, pl.VF, cur, typeID, ErrDeviceMismatch)
		}
	}
	if req.Intent != nil {
		if err := req.Intent(pl); err != nil {
			return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s: intent: %w", id, err)
		}
	}
	path := filepath.Join(d.vfDir(pl.VF), "nvidia", "current_vgpu_type")
	if err := writeAttr(path, pl.TypeID+"\n"); err != nil {
		return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s on %s type %s: %w", id, pl.VF, pl.TypeID, err)
	}
	cur, err := d.current(pl.VF)
	if err != nil {
		return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s on %s: read back: %w", id, pl.VF, err)
	}
	if cur != typeID {
		return Device{}, fmt.Errorf("vgpu: create vendor vGPU %s on %s: current_vgpu_type is %d after writing %d: %w", id, pl.VF, cur, typeID, ErrDeviceMismatch)
	}
	d.releases.forget(dev)
	return dev, nil
}

func anyBusy(vfs []vfState) bool {
	for _, vf := range vfs {
		if vf.current != 0 || vf.taken {
			return true
		}
	}
	return false
}

// withoutTaken is vfs with every free VF that taken names made unavailable
// (it offers no type), so that placement neither counts nor chooses it.
func withoutTaken(vfs []vfState, taken map[string]string) []vfState {
	if len(taken) == 0 {
		return vfs
	}
	out := make([]vfState, 0, len(vfs))
	for _, vf := range vfs {
		if _, ok := taken[vf.addr]; ok && vf.current == 0 {
			vf.creatable, vf.taken = nil, true
		}
		out = append(out, vf)
	}
	return out
}

// freeVF is the first free VF on pl.Parent that offers pl.TypeID.
func freeVF(vfs []vfState, pl Placement) string {
	for _, vf := range vfs {
		if vf.parent != pl.Parent || vf.current != 0 {
			continue
		}
		for _, t := range vf.creatable {
			if strconv.Itoa(t.id) == pl.TypeID {
				return vf.addr
			}
		}
	}
	return ""
}

// Release writes 0 to current_vgpu_type; a VF at 0 or gone is success, one of
// another type is left alone (ErrDeviceMismatch). ctx bounds the wait only.
func (d *VendorDriver) Release(ctx context.Context, dev Device) error {
	if !pciAddr.MatchString(dev.ID) {
		return fmt.Errorf("vgpu: release vendor vGPU %q: %w", dev.ID, ErrInvalid)
	}
	dev.Kind = KindVendor
	vf := dev.ID
	err := d.releases.do(ctx, dev, func() error {
		cur, err := d.current(vf)
		if errors.Is(err, os.ErrNotExist) {
			return nil // VF gone
		}
		if err != nil {
			return err
		}
		if cur == 0 {
			return nil // already released
		}
		if dev.TypeID != "" && strconv.Itoa(cur) != dev.TypeID {
			return fmt.Errorf("VF runs type %d, not %s: %w", cur, dev.TypeID, ErrDeviceMismatch)
		}
		return writeAttr(filepath.Join(d.vfDir(vf), "nvidia", "current_vgpu_type"), "0\n")
	})
	if err != nil {
		return fmt.Errorf("vgpu: release vendor vGPU on %s: %w", vf, err)
	}
	return nil
}
