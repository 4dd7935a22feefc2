package gpu

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"vmflow/hostagent/topology"
)

// MdevDriver drives mediated devices:
// class/mdev_bus/<parent>/mdev_supported_types/<type>/{name,available_instances,create}
// and bus/mdev/devices/<uuid>/remove.
type MdevDriver struct {
	root     string
	lock     *hostLock
	releases *releases

	// names (a type's name, by its folder) and locs (a parent GPU's
	// locality) are what sysfs says that does not change while a device
	// is there, kept under mu.
	// Read every time, a spawn paid two scans of every type (on the FUSE
	// simulator about 500 requests, 12-19 ms each; on kernel sysfs under
	// a millisecond). A device replaced at the same address without a
	// restart of the agent (a driver reload) keeps what was read first.
	mu    sync.Mutex
	names map[string]string
	locs  map[string]topology.PCILocality
}

var _ Driver = (*MdevDriver)(nil)

// NewMdev returns an mdev driver; cfg.Kind is ignored.
func NewMdev(cfg Config) *MdevDriver {
	cfg = cfg.WithDefaults()
	return &MdevDriver{root: cfg.SysfsRoot, lock: newHostLock(cfg.StateDir), releases: newReleases(cfg.OnReleaseDone)}
}

// Kind implements Driver.
func (d *MdevDriver) Kind() Kind { return KindMdev }

func (d *MdevDriver) typesDir(parent string) string {
	return filepath.Join(d.root, "class", "mdev_bus", parent, "mdev_supported_types")
}

func (d *MdevDriver) devDir(id string) string { return mdevPath(d.root, id) }

// DevicePath implements Driver.
func (d *MdevDriver) DevicePath(dev Device) string { return d.devDir(dev.ID) }

// Profiles implements Driver.
func (d *MdevDriver) Profiles(ctx context.Context) ([]Profile, error) {
	devs, err := d.Devices(ctx)
	if err != nil {
		return nil, err
	}
	return d.profiles(ctx, devs, "")
}

// ProfileNames lists the names of the types the host offers, each once,
// free or not (lease.Claims.Profiles, for admission): no availability
// and no device is read.
func (d *MdevDriver) ProfileNames(ctx context.Context) ([]string, error) {
	var names []string
	err := d.eachType(ctx, func(_, _, name string) error {
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
		return nil
	})
	return names, err
}

// eachType calls fn with each type of each parent GPU and its name.
func (d *MdevDriver) eachType(ctx context.Context, fn func(parent, typeID, name string) error) error {
	parents, err := os.ReadDir(filepath.Join(d.root, "class", "mdev_bus"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("vgpu: list mdev parents: %w", err)
	}
	for _, p := range parents {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("vgpu: list mdev profiles: %w", err)
		}
		types, err := os.ReadDir(d.typesDir(p.Name()))
		if err != nil {
			return fmt.Errorf("vgpu: list mdev types of %s: %w", p.Name(), err)
		}
		for _, t := range types {
			name, err := d.typeName(filepath.Join(d.typesDir(p.Name()), t.Name()))
			if err != nil {
				return fmt.Errorf("vgpu: mdev type %s/%s: %w", p.Name(), t.Name(), err)
			}
			if err := fn(p.Name(), t.Name(), name); err != nil {
				return err
			}
		}
	}
	return nil
}

// typeName is the name file of the type at dir, read once.
func (d *MdevDriver) typeName(dir string) (string, error) {
	d.mu.Lock()
	name, ok := d.names[dir]
	d.mu.Unlock()
	if ok {
		return name, nil
	}
	name, err := readAttr(filepath.Join(dir, "name"))
	if err != nil {
		return "", err
	}
	d.mu.Lock()
	if d.names == nil {
		d.names = map[string]string{}
	}
	d.names[dir] = name
	d.mu.Unlock()
	return name, nil
}

// locality is parent's, read once it could be read.
func (d *MdevDriver) locality(parent string) topology.PCILocality {
	d.mu.Lock()
	l, ok := d.locs[parent]
	d.mu.Unlock()
	if ok {
		return l
	}
	l, read := readLocality(d.root, parent)
	if !read {
		return l
	}
	d.mu.Lock()
	if d.locs == nil {
		d.locs = map[string]topology.PCILocality{}
	}
	d.locs[parent] = l
	d.mu.Unlock()
	return l
}

// profiles is Profiles over devs (the mdevs that exist), of the types
// named only ("" every type): a create reads the availability of the
// profile it asks for, not of every type.
func (d *MdevDriver) profiles(ctx context.Context, devs []Device, only string) ([]Profile, error) {
	used := map[string]int{}
	for _, dev := range devs {
		used[dev.Parent]++
	}
	var out []Profile
	err := d.eachType(ctx, func(parent, typeID, name string) error {
		if only != "" && name != only {
			return nil
		}
		avs, err := readAttr(filepath.Join(d.typesDir(parent), typeID, "available_instances"))
		if err != nil {
			return fmt.Errorf("vgpu: mdev type %s/%s: %w", parent, typeID, err)
		}
		av, err := strconv.Atoi(avs)
		if err != nil {
			return fmt.Errorf("vgpu: mdev type %s/%s: available_instances %q: %w", parent, typeID, avs, err)
		}
		out = append(out, Profile{Name: name, TypeID: typeID, Parent: parent, Available: av, Used: used[parent], PCILocality: d.locality(parent)})
		return nil
	})
	if err != nil {
		return nil, err
	}
	sortProfiles(out)
	return out, nil
}

// Devices implements Driver.
func (d *MdevDriver) Devices(ctx context.Context) ([]Device, error) {
	// A device that vanishes while listed was removed meanwhile.
	return readEntries(ctx, filepath.Join(d.root, "bus", "mdev", "devices"), "mdev devices", d.device)
}

// device describes an existing mdev from its mdev_type link.
func (d *MdevDriver) device(id string) (Device, error) {
	link := filepath.Join(d.devDir(id), "mdev_type")
	typeID, parent, err := mdevType(link)
	if err != nil {
		return Device{}, fmt.Errorf("vgpu: mdev %s: %w", id, err)
	}
	name, err := readAttr(filepath.Join(link, "name"))
	if err != nil {
		return Device{}, fmt.Errorf("vgpu: mdev %s: %w", id, err)
	}
	return Device{Kind: KindMdev, ID: id, UUID: id, Profile: name, TypeID: typeID, Parent: parent}, nil
}

// mdevType reads an mdev's type and parent GPU from its mdev_type link,
// which leads to <parent>/mdev_supported_types/<type>. The kernel writes
// the link relative to the mdev's own folder, which lives under its
// parent (kernfs climbs only to the common ancestor):
// "../mdev_supported_types/nvidia-471", whose text names no parent, so
// the link is then resolved. (The simulator's mdevs live in
// bus/mdev/devices and link through bus/pci/devices/<parent>.)
func mdevType(link string) (typeID, parent string, err error) {
	target, err := os.Readlink(link)
	if err != nil {
		return "", "", err
	}
	if p := filepath.Base(filepath.Dir(filepath.Dir(target))); pciAddr.MatchString(p) {
		return filepath.Base(target), p, nil
	}
	if target, err = filepath.EvalSymlinks(link); err != nil {
		return "", "", err
	}
	if p := filepath.Base(filepath.Dir(filepath.Dir(target))); pciAddr.MatchString(p) {
		return filepath.Base(target), p, nil
	}
	return "", "", fmt.Errorf("mdev_type leads to %s, not <parent>/mdev_supported_types/<type>: %w", target, ErrInvalid)
}

// Create implements Driver.
func (d *MdevDriver) Create(ctx context.Context, req CreateRequest) (Device, error) {
	id, err := canonicalUUID(req.UUID)
	if err != nil {
		return Device{}, fmt.Errorf("vgpu: create mdev: %w", err)
	}
	unlock, err := d.lock.lock(ctx)
	if err != nil {
		return Device{}, err
	}
	defer unlock()

	// The UUID is the device: fresh (random) or the caller's own claim's,
	// so the records that can be read decide (see CreateRequest.Taken).
	taken, err := req.taken(ctx, false)
	if err != nil {
		return Device{}, fmt.Errorf("vgpu: create mdev %s: taken UUIDs: %w", id, err)
	}
	if err := claimedBy(taken, id); err != nil {
		return Device{}, fmt.Errorf("vgpu: create mdev: %w", err)
	}
	var pl Placement
	if req.At != nil {
		pl = *req.At
		if !safeName(pl.Parent) || !safeName(pl.TypeID) {
			return Device{}, fmt.Errorf("vgpu: create mdev %s at %+v: %w", id, pl, ErrInvalid)
		}
	} else {
		devs, err := d.Devices(ctx)
		if err != nil {
			return Device{}, err
		}
		profs, err := d.profiles(ctx, devs, req.Profile)
		if err != nil {
			return Device{}, err
		}
		held, err := req.held(ctx)
		if err != nil {
			return Device{}, fmt.Errorf("vgpu: create mdev %s: held claims: %w", id, err)
		}
		pl, err = place(reserveHeld(profs, held, deviceIDs(devs), true), req)
		if err != nil {
			return Device{}, fmt.Errorf("vgpu: create mdev %s: %w", id, err)
		}
	}
	if req.Intent != nil {
		if err := req.Intent(pl); err != nil {
			return Device{}, fmt.Errorf("vgpu: create mdev %s: intent: %w", id, err)
		}
	}
	dev := Device{Kind: KindMdev, ID: id, UUID: id, Profile: pl.Profile, TypeID: pl.TypeID, Parent: pl.Parent}
	err = writeAttr(filepath.Join(d.typesDir(pl.Parent), pl.TypeID, "create"), id+"\n")
	if errors.Is(err, syscall.EEXIST) {
		// Idempotent create: a retry after a crash finds its own device.
		if got, gerr := d.device(id); gerr == nil && got.Parent == pl.Parent && got.TypeID == pl.TypeID {
			d.releases.forget(got)
			return got, nil
		}
	}
	if errors.Is(err, syscall.EUSERS) || errors.Is(err, syscall.ENOSPC) {
		// The mdev core answers EUSERS when available_instances is 0;
		// some vendor drivers ENOSPC. Both mean "full".
		return Device{}, fmt.Errorf("vgpu: create mdev %s on %s/%s: %w: %w", id, pl.Parent, pl.TypeID, ErrNoCapacity, err)
	}
	if err != nil {
		return Device{}, fmt.Errorf("vgpu: create mdev %s on %s/%s: %w", id, pl.Parent, pl.TypeID, err)
	}
	if _, err := os.Stat(d.devDir(id)); err != nil {
		return Device{}, fmt.Errorf("vgpu: create mdev %s: device missing after create: %w", id, err)
	}
	d.releases.forget(dev)
	return dev, nil
}

// Release implements Driver. "1" to remove; ENOENT (already gone) is
// success. ctx bounds the wait only.
func (d *MdevDriver) Release(ctx context.Context, dev Device) error {
	id, err := canonicalUUID(dev.ID)
	if err != nil {
		return fmt.Errorf("vgpu: release mdev: %w", err)
	}
	dev.Kind, dev.ID = KindMdev, id
	if dev.UUID == "" {
		dev.UUID = id
	}
	path := filepath.Join(d.devDir(id), "remove")
	err = d.releases.do(ctx, dev, func() error {
		err := writeAttr(path, "1\n")
		if errors.Is(err, os.ErrNotExist) {
			return nil // already gone
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("vgpu: release mdev %s: %w", id, err)
	}
	return nil
}

// deviceIDs is the set of devs' ids.
func deviceIDs(devs []Device) map[string]bool {
	m := make(map[string]bool, len(devs))
	for _, d := range devs {
		m[d.ID] = true
	}
	return m
}

// place picks, for req's profile, the least used parent with capacity,
// on one of req.Near's NUMA nodes first (only there with OnlyNear).
func place(profs []Profile, req CreateRequest) (Placement, error) {
	profile := req.Profile
	known := false
	var best *Profile
	near := func(p *Profile) bool { return slices.Contains(req.Near, p.NUMANode) }
	for i := range profs {
		p := &profs[i]
		if p.Name != profile {
			continue
		}
		known = true
		if p.Available <= 0 || (req.OnlyNear && len(req.Near) > 0 && !near(p)) {
			continue
		}
		if best == nil || cmp.Or(-cmp.Compare(b2i(near(p)), b2i(near(best))), cmp.Compare(p.Used, best.Used), strings.Compare(p.Parent, best.Parent)) < 0 {
			best = p
		}
	}
	switch {
	case best != nil:
		return Placement{Profile: best.Name, TypeID: best.TypeID, Parent: best.Parent}, nil
	case known:
		return Placement{}, fmt.Errorf("profile %q: %w", profile, ErrNoCapacity)
	default:
		return Placement{}, fmt.Errorf("profile %q: %w", profile, ErrUnknownProfile)
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func sortProfiles(ps []Profile) {
	sort.Slice(ps, func(i, j int) bool {
		if ps[i].Parent != ps[j].Parent {
			return ps[i].Parent < ps[j].Parent
		}
		return ps[i].TypeID < ps[j].TypeID
	})
}

// safeName is a single path element: sysfs names come back from records,
// and must not walk out of the sysfs root.
func safeName(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsRune(s, '/') && !strings.ContainsRune(s, 0)
}
