// Package vgpusim is a FUSE file system that answers like the kernel's
// vGPU sysfs files, so that the vGPU drivers in hostagent/gpu run unchanged
// on machines without vGPU hardware.
//
// Layout under the mount point (a subset of /sys):
//
//	bus/pci/devices/<parent>/mdev_supported_types/<type>/{name,description,available_instances,device_api,create,devices/}
//	class/mdev_bus/<parent> -> ../../bus/pci/devices/<parent>
//	bus/mdev/devices/<uuid>/{remove,mdev_type->...,iommu_group->...}
//	bus/pci/devices/<pf>/{sriov_numvfs,sriov_totalvfs,virtfnN->../<vf>}
//	bus/pci/devices/<vf>/{physfn->../<pf>,iommu_group->...,nvidia/{creatable_vgpu_types,current_vgpu_type}}
//	kernel/iommu_groups/<n>/devices/<dev> -> the device
//	bus/pci/devices/<addr> -> ../../../devices/pci0000:<bus>/<root port>/<addr> (every PCI function; numa.go)
//	devices/system/node/node<k>/{cpulist,meminfo,hugepages/}, devices/system/cpu/online (with Options.NUMANodes)
//
// Behaviour, as the kernel's (drivers/vfio/mdev/mdev_sysfs.c and
// mdev_core.c for mdev; NVIDIA's vGPU documentation for vendor VFIO):
//
//   - mdev create: the write must be 36 or 37 bytes holding a UUID, else
//     EINVAL; a UUID already in use anywhere gives EEXIST; no capacity left
//     gives EUSERS (the mdev core's code for available_instances == 0 since
//     Linux 6.1; it is not ENOSPC). Like NVIDIA's driver, a GPU runs one
//     vGPU type at a time: once a type has a device, the other types on that
//     parent show available_instances 0.
//   - mdev remove: "0" is a no-op, a non-number EINVAL, anything else
//     removes the device; its directory disappears (ENOENT afterwards) and
//     available_instances counts back up. A write through a file opened
//     before the device went away gives ENODEV.
//   - vendor current_vgpu_type: reads the active type id or 0. Writing an id
//     listed in creatable_vgpu_types creates the vGPU; an unlisted id gives
//     EINVAL; a VF that already has a type gives EBUSY (NVIDIA's code is not
//     public: EBUSY is this simulator's choice). Writing 0 destroys; on a
//     free VF it is a successful no-op. creatable_vgpu_types prints a header
//     line and "%6d : <name>" lines, and only the header while the VF is
//     in use; types are homogeneous per physical GPU and bounded by the
//     type's max instances.
//   - unknown paths give ENOENT; errors reach the writer as write(2) errnos.
//
// With Options.PCIGPUs, whole GPUs for passthrough (pci.go; their layout is
// PCIGPUAt): bus/pci/devices/<addr>/{vendor,device,class,driver_override,
// reset,driver->,iommu_group->}, bus/pci/drivers/<drv>/{bind,unbind},
// bus/pci/drivers_probe, with the kernel's matching and errnos, an unbind
// that waits while the driver's device node is held open, and the faults
// fail-unbind, block-unbind and fail-reset. README.md lists what the PCI
// model leaves out.
//
// Fault injection through the control directory (see Options.Control),
// checked at each write, each effective while its file exists:
// fail-release (an errno name: every release write fails with it),
// block-release (release writes block until the file is removed) and
// fail-create (an errno name: every create fails with it). Release writes
// are mdev remove and vendor current_vgpu_type <- 0; a blocked release that
// is lifted then honours fail-release. Unmount lifts every block first, so
// no writer hangs on shutdown.
package vgpusim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// Limits on the generated topology; PCI functions run out beyond them.
const (
	MaxMdevParents = 64
	MaxVendorVFs   = 252
)

// VendorPF is the PCI address of the simulated SR-IOV physical function.
const VendorPF = "0000:c1:00.0"

// Options sizes the simulated host.
type Options struct {
	// MdevParents is the number of mdev-capable GPUs (0000:3b:00.0,
	// 0000:3c:00.0, ...).
	MdevParents int
	// VendorVFs is the number of NVIDIA vendor-VFIO virtual functions on
	// one physical GPU (VendorPF).
	VendorVFs int
	// PCIGPUs is the number of whole GPUs for passthrough (see PCIGPUAt
	// for their functions and IOMMU groups), each bound to nvidia at start.
	PCIGPUs int
	// DevRoot, if set, is where the simulator keeps device nodes as plain
	// files: nvidia<N> per PCI GPU, and vfio/<group> while a function of
	// the group is bound to vfio-pci. A process holding one open makes
	// the driver's unbind wait, as on a real host.
	DevRoot string
	// Control is the fault-injection directory; empty disables injection.
	Control string
	// PCIGroupWith puts PCI GPU i (every function of its group) in PCI GPU
	// j's IOMMU group, for each i: j: GPUs behind one switch without ACS,
	// which only travel together.
	PCIGroupWith map[int]int
	// PCINoReset lists PCI GPUs (by index) whose display function has no
	// reset method: the kernel shows neither reset nor reset_method for
	// it, and vmflow must not offer it (a tenant's state would reach the
	// next).
	PCINoReset []int

	// NUMA (numa.go). NUMANodes is the number of NUMA nodes (at most
	// MaxNUMANodes); 0 is a kernel without NUMA: no devices/system at all
	// and every PCI function's numa_node -1, as before NUMA was simulated.
	// The other fields need NUMANodes; zero takes their default.
	NUMANodes int
	// NodeCPUs is each node's number of CPUs (default 2): node k holds
	// CPUs k*NodeCPUs to (k+1)*NodeCPUs-1.
	NodeCPUs int
	// NodeMemoryMiB is each node's MemTotal (default 4096); its MemFree is
	// that less its hugepage pools.
	NodeMemoryMiB int
	// NodeHugepages2M and NodeHugepages1G are each node's pools.
	NodeHugepages2M, NodeHugepages1G Hugepages
	// GPUNodes puts GPUs on nodes by PCI address: a PCI GPU's display
	// function, an mdev parent, VendorPF. A GPU not named goes round
	// robin: PCI GPU i and mdev parent i on node i % NUMANodes, the PF on
	// node 0. Every function of a card (audio, bridge, NIC; the PF's VFs)
	// is on its card's node, under its root port.
	GPUNodes map[string]int
}

// Server is a mounted simulator.
type Server struct {
	dir     string
	fuse    *fuse.Server
	ctl     control
	opts    Options
	closing chan struct{}
	once    sync.Once

	// wmu guards closed; writers counts release writes in progress so
	// Unmount can let them finish before unmounting.
	wmu     sync.Mutex
	closed  bool
	writers sync.WaitGroup
	blocked atomic.Int32 // release writes waiting on block-release

	mu        sync.Mutex // guards everything below and tree changes
	root      *fs.Inode
	parents   []*mdevParent
	devices   map[string]*mdevDevice
	vfs       []*vendorVF
	nextGroup int

	pci        map[string]*pciFn
	pciDrivers map[string]*pciDriver

	// homes is every PCI function's root port; portsOn counts the ports
	// made on each node's root complex (numa.go).
	homes   map[string]*pciPort
	portsOn map[int]int
}

// Mount mounts a simulator at dir (which must exist) and serves it until
// Unmount.
func Mount(dir string, opts Options) (*Server, error) {
	if opts.MdevParents < 0 || opts.MdevParents > MaxMdevParents {
		return nil, fmt.Errorf("vgpusim: mdev parents %d out of range 0..%d", opts.MdevParents, MaxMdevParents)
	}
	if opts.VendorVFs < 0 || opts.VendorVFs > MaxVendorVFs {
		return nil, fmt.Errorf("vgpusim: vendor VFs %d out of range 0..%d", opts.VendorVFs, MaxVendorVFs)
	}
	if opts.PCIGPUs < 0 || opts.PCIGPUs > MaxPCIGPUs {
		return nil, fmt.Errorf("vgpusim: PCI GPUs %d out of range 0..%d", opts.PCIGPUs, MaxPCIGPUs)
	}
	for _, i := range opts.PCINoReset {
		if i < 0 || i >= opts.PCIGPUs {
			return nil, fmt.Errorf("vgpusim: PCI GPU %d without reset: no such GPU of %d", i, opts.PCIGPUs)
		}
	}
	for i, j := range opts.PCIGroupWith {
		if i == j || i < 0 || j < 0 || i >= opts.PCIGPUs || j >= opts.PCIGPUs {
			return nil, fmt.Errorf("vgpusim: PCI GPU %d in the group of %d: no such pair of %d GPUs", i, j, opts.PCIGPUs)
		}
	}
	if err := opts.checkNUMA(); err != nil {
		return nil, err
	}
	if opts.DevRoot != "" {
		if err := makeDevNodes(opts.DevRoot, opts.PCIGPUs); err != nil {
			return nil, err
		}
	}
	if opts.Control != "" {
		st, err := os.Stat(opts.Control)
		if err != nil {
			return nil, fmt.Errorf("vgpusim: control dir: %w", err)
		}
		if !st.IsDir() {
			return nil, fmt.Errorf("vgpusim: control %s is not a directory", opts.Control)
		}
	}
	s := &Server{
		dir:       dir,
		ctl:       control{dir: opts.Control},
		opts:      opts,
		closing:   make(chan struct{}),
		devices:   map[string]*mdevDevice{},
		nextGroup: 1000,
		homes:     map[string]*pciPort{},
		portsOn:   map[int]int{},
	}
	// Zero timeouts: devices come and go and available_instances changes,
	// so the kernel must ask us every time instead of caching entries,
	// attributes or negative lookups.
	zero := time.Duration(0)
	fopts := &fs.Options{
		EntryTimeout:    &zero,
		AttrTimeout:     &zero,
		NegativeTimeout: &zero,
		MountOptions: fuse.MountOptions{
			DirectMount: true,
			FsName:      "vgpusim",
			Name:        "vgpusim",
			// Root may let QEMU or an unprivileged test user look.
			AllowOther: os.Geteuid() == 0,
		},
	}
	srv, err := fs.Mount(dir, &rootNode{srv: s}, fopts)
	if err != nil {
		return nil, fmt.Errorf("vgpusim: mount %s: %w", dir, err)
	}
	s.fuse = srv
	return s, nil
}

// Blocked is the number of writes waiting now: releases on
// block-release, PCI unbinds on block-unbind or on a device node's users;
// tests wait on it instead of sleeping.
func (s *Server) Blocked() int { return int(s.blocked.Load()) }

// Dir is the mount point.
func (s *Server) Dir() string { return s.dir }

// Unmount lifts every block-release, lets held writers finish and unmounts,
// lazily if a file is still open, rather than fail or hang. Idempotent.
func (s *Server) Unmount() error {
	var err error
	s.once.Do(func() {
		s.wmu.Lock()
		s.closed = true
		close(s.closing)
		s.wmu.Unlock()
		s.writers.Wait()
		if uerr := s.fuse.Unmount(); uerr != nil {
			if derr := syscall.Unmount(s.dir, syscall.MNT_DETACH); derr != nil {
				err = fmt.Errorf("vgpusim: unmount %s: %w", s.dir, errors.Join(uerr, derr))
			}
		}
	})
	return err
}

// releaseGate applies block-release then fail-release to one release write.
func (s *Server) releaseGate() syscall.Errno {
	return s.gate(func() bool { return s.ctl.exists(CtlBlockRelease) }, CtlFailRelease, nil)
}

// gate holds a write while blocked reports true, then fails it with
// the errno in control file fail (if any), then holds it while busy
// reports true. Waits count in Blocked and end at Unmount, so no writer
// hangs on shutdown.
func (s *Server) gate(blocked func() bool, fail string, busy func() bool) syscall.Errno {
	s.wmu.Lock()
	if s.closed {
		s.wmu.Unlock()
		return s.ctl.fault(fail)
	}
	s.writers.Add(1)
	s.wmu.Unlock()
	defer s.writers.Done()
	s.waitWhile(blocked, blockPoll)
	if e := s.ctl.fault(fail); e != 0 {
		return e
	}
	if busy != nil {
		s.waitWhile(busy, holderPoll)
	}
	return 0
}

// waitWhile polls cond every poll until it is false or the simulator
// closes. It deliberately ignores the FUSE request's interrupt:
// a real blocked remove waits in the kernel and ignores signals too.
func (s *Server) waitWhile(cond func() bool, poll time.Duration) {
	if !cond() {
		return
	}
	s.blocked.Add(1)
	defer s.blocked.Add(-1)
	t := time.NewTicker(poll)
	defer t.Stop()
	for cond() {
		select {
		case <-s.closing:
			return
		case <-t.C:
		}
	}
}

// makeDevNodes creates <dev>/vfio and a plain file nvidia<N> per PCI GPU.
func makeDevNodes(dev string, gpus int) error {
	if err := os.MkdirAll(filepath.Join(dev, "vfio"), 0o755); err != nil {
		return fmt.Errorf("vgpusim: dev root: %w", err)
	}
	for i := 0; i < gpus; i++ {
		fd, err := os.OpenFile(filepath.Join(dev, "nvidia"+strconv.Itoa(i)), os.O_CREATE|os.O_RDWR, 0o666)
		if err != nil {
			return fmt.Errorf("vgpusim: dev root: %w", err)
		}
		_ = fd.Close()
	}
	return nil
}

// ---- topology ----

type mdevTypeSpec struct {
	id, name string
	fbMiB    int
	max      int
}

// mdevCatalog is an A100-40GB's compute profiles, named as the NVIDIA
// driver names them in mdev_supported_types/<type>/name.
var mdevCatalog = []mdevTypeSpec{
	{"nvidia-471", "GRID A100-4C", 4096, 10},
	{"nvidia-472", "GRID A100-5C", 5120, 8},
	{"nvidia-474", "GRID A100-10C", 10240, 4},
	{"nvidia-476", "GRID A100-20C", 20480, 2},
	{"nvidia-477", "GRID A100-40C", 40960, 1},
}

type vendorTypeSpec struct {
	id   int
	name string
	max  int
}

// vendorCatalog is an L40-48GB's Q profiles as creatable_vgpu_types lists them.
var vendorCatalog = []vendorTypeSpec{
	{588, "NVIDIA L40-1Q", 32},
	{590, "NVIDIA L40-2Q", 24},
	{592, "NVIDIA L40-4Q", 12},
	{594, "NVIDIA L40-8Q", 6},
	{597, "NVIDIA L40-24Q", 2},
	{598, "NVIDIA L40-48Q", 1},
}

type mdevParent struct {
	addr  string
	types map[string]*mdevType
}

type mdevType struct {
	spec    mdevTypeSpec
	parent  *mdevParent
	devsDir *fs.Inode // <type>/devices
}

type mdevDevice struct {
	uuid  string
	typ   *mdevType
	group int
}

type vendorVF struct {
	addr  string
	group int
	typ   *vendorTypeSpec // nil while free
}

// up returns "../" n times: relative symlink targets, as sysfs uses.
func up(n int) string { return strings.Repeat("../", n) }

func mdevParentAddr(i int) string { return fmt.Sprintf("0000:%02x:00.0", 0x3b+i) }

func vendorVFAddr(i int) string {
	devfn := 4 + i // functions 0-3 belong to the PF, as on an L40
	return fmt.Sprintf("0000:c1:%02x.%d", devfn/8, devfn%8)
}

// build creates the static tree; called once from the root's OnAdd.
func (s *Server) build(ctx context.Context, root *fs.Inode) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.root = root
	mkpath(ctx, root, "bus", "pci", "devices")
	mkpath(ctx, root, "bus", "mdev", "devices")
	mdevBus := mkpath(ctx, root, "class", "mdev_bus")
	mkpath(ctx, root, "kernel", "iommu_groups")

	for i := 0; i < s.opts.MdevParents; i++ {
		p := &mdevParent{addr: mdevParentAddr(i), types: map[string]*mdevType{}}
		s.parents = append(s.parents, p)
		addLink(ctx, mdevBus, p.addr, up(2)+"bus/pci/devices/"+p.addr)
		pd := s.pciHomeLocked(ctx, s.newPortLocked(ctx, s.opts.cardNode(p.addr, i)), p.addr)
		addIDs(ctx, pd, "10de", "20b0") // A100-40GB
		types := mkdir(ctx, pd, "mdev_supported_types")
		for _, spec := range mdevCatalog {
			t := &mdevType{spec: spec, parent: p}
			p.types[spec.id] = t
			td := mkdir(ctx, types, spec.id)
			addFile(ctx, td, "name", roAttr(func() string { return t.spec.name + "\n" }))
			addFile(ctx, td, "description", roAttr(func() string {
				return fmt.Sprintf("num_heads=1, frl_config=60, framebuffer=%dM, max_resolution=4096x2160, max_instance=%d\n", t.spec.fbMiB, t.spec.max)
			}))
			addFile(ctx, td, "device_api", roAttr(func() string { return "vfio-pci\n" }))
			addFile(ctx, td, "available_instances", roAttr(func() string {
				s.mu.Lock()
				defer s.mu.Unlock()
				return strconv.Itoa(s.availableLocked(t)) + "\n"
			}))
			addFile(ctx, td, "create", woAttr(func(ctx context.Context, b []byte) syscall.Errno {
				return s.mdevCreate(ctx, t, b)
			}))
			t.devsDir = mkdir(ctx, td, "devices")
		}
	}

	if s.opts.VendorVFs > 0 {
		port := s.newPortLocked(ctx, s.opts.cardNode(VendorPF, 0))
		pf := s.pciHomeLocked(ctx, port, VendorPF)
		addIDs(ctx, pf, "10de", "26b5") // L40
		n := strconv.Itoa(s.opts.VendorVFs) + "\n"
		addFile(ctx, pf, "sriov_totalvfs", roAttr(func() string { return n }))
		addFile(ctx, pf, "sriov_numvfs", roAttr(func() string { return n }))
		for i := 0; i < s.opts.VendorVFs; i++ {
			vf := &vendorVF{addr: vendorVFAddr(i), group: 100 + i}
			s.vfs = append(s.vfs, vf)
			addLink(ctx, pf, "virtfn"+strconv.Itoa(i), "../"+vf.addr)
			vd := s.pciHomeLocked(ctx, port, vf.addr) // VFs sit on their PF's bus
			addLink(ctx, vd, "physfn", "../"+VendorPF)
			addIDs(ctx, vd, "10de", "26b5")
			s.addGroupLocked(ctx, vd, vf.group, vf.addr, "bus/pci/devices/"+vf.addr)
			nv := mkdir(ctx, vd, "nvidia")
			addFile(ctx, nv, "creatable_vgpu_types", roAttr(func() string { return s.creatable(vf) }))
			addFile(ctx, nv, "current_vgpu_type", rwAttr(
				func() string {
					s.mu.Lock()
					defer s.mu.Unlock()
					if vf.typ == nil {
						return "0\n"
					}
					return strconv.Itoa(vf.typ.id) + "\n"
				},
				func(ctx context.Context, b []byte) syscall.Errno { return s.vendorWrite(ctx, vf, b) },
			))
		}
	}
	s.buildPCI(ctx)
	s.buildNUMA(ctx)
}

// addIDs gives a vGPU parent or VF the vendor, device and class (3D
// controller) a GPU has, so that the passthrough driver sees it and leaves
// it to the vGPU drivers.
func addIDs(ctx context.Context, dir *fs.Inode, vendor, device string) {
	addFile(ctx, dir, "vendor", roAttr(func() string { return "0x" + vendor + "\n" }))
	addFile(ctx, dir, "device", roAttr(func() string { return "0x" + device + "\n" }))
	addFile(ctx, dir, "class", roAttr(func() string { return "0x030200\n" }))
}

// addGroupLocked creates kernel/iommu_groups/<group>/devices/<name> and the
// device's iommu_group link (devDir is at depth 4 below the root).
func (s *Server) addGroupLocked(ctx context.Context, devDir *fs.Inode, group int, name, devPath string) {
	g := strconv.Itoa(group)
	devs := mkpath(ctx, s.root, "kernel", "iommu_groups", g, "devices")
	addLink(ctx, devs, name, up(4)+devPath)
	addLink(ctx, devDir, "iommu_group", up(4)+"kernel/iommu_groups/"+g)
}

// ---- mdev ----

// availableLocked is available_instances of t: one type per GPU at a time.
func (s *Server) availableLocked(t *mdevType) int {
	used := 0
	for _, d := range s.devices {
		if d.typ.parent != t.parent {
			continue
		}
		if d.typ != t {
			return 0
		}
		used++
	}
	if used >= t.spec.max {
		return 0
	}
	return t.spec.max - used
}

// parseUUID mirrors create_store: 36 or 37 bytes (a trailing newline or any
// one byte is ignored by guid_parse), the first 36 a canonical UUID.
func parseUUID(b []byte) (string, bool) {
	if len(b) < 36 || len(b) > 37 {
		return "", false
	}
	s := string(b[:36])
	for _, i := range []int{8, 13, 18, 23} {
		if s[i] != '-' {
			return "", false
		}
	}
	u, err := uuid.Parse(s)
	if err != nil {
		return "", false
	}
	return u.String(), true // lower case, as the kernel prints %pUl
}

func (s *Server) mdevCreate(ctx context.Context, t *mdevType, b []byte) syscall.Errno {
	id, ok := parseUUID(b)
	if !ok {
		return syscall.EINVAL
	}
	if e := s.ctl.fault(CtlFailCreate); e != 0 {
		return e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.devices[id]; dup {
		return syscall.EEXIST
	}
	if s.availableLocked(t) == 0 {
		return syscall.EUSERS
	}
	d := &mdevDevice{uuid: id, typ: t, group: s.nextGroup}
	s.nextGroup++
	s.devices[id] = d

	devDir := mkpath(ctx, s.root, "bus", "mdev", "devices", id)
	addFile(ctx, devDir, "remove", woAttr(func(ctx context.Context, b []byte) syscall.Errno {
		return s.mdevRemove(d, b)
	}))
	addLink(ctx, devDir, "mdev_type", up(4)+"bus/pci/devices/"+t.parent.addr+"/mdev_supported_types/"+t.spec.id)
	s.addGroupLocked(ctx, devDir, d.group, id, "bus/mdev/devices/"+id)
	addLink(ctx, t.devsDir, id, up(7)+"bus/mdev/devices/"+id)
	return 0
}

func (s *Server) mdevRemove(d *mdevDevice, b []byte) syscall.Errno {
	// remove_store: kstrtoul(buf, 0), which accepts one trailing newline.
	v, err := strconv.ParseUint(strings.TrimSuffix(string(b), "\n"), 0, 64)
	if err != nil {
		return syscall.EINVAL
	}
	if v == 0 {
		return 0
	}
	if e := s.releaseGate(); e != 0 {
		return e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.devices[d.uuid] != d {
		return syscall.ENODEV // written through a file opened before removal
	}
	delete(s.devices, d.uuid)
	if devs := s.root.GetChild("bus").GetChild("mdev").GetChild("devices"); devs != nil {
		devs.RmChild(d.uuid)
	}
	if groups := s.root.GetChild("kernel").GetChild("iommu_groups"); groups != nil {
		groups.RmChild(strconv.Itoa(d.group))
	}
	d.typ.devsDir.RmChild(d.uuid)
	return 0
}

// ---- NVIDIA vendor VFIO ----

// creatableLocked lists the types vf could take now: none while it has one,
// else those compatible with the GPU's active type with an instance left.
func (s *Server) creatableLocked(vf *vendorVF) []vendorTypeSpec {
	if vf.typ != nil {
		return nil
	}
	var active *vendorTypeSpec
	used := 0
	for _, o := range s.vfs {
		if o.typ != nil {
			active = o.typ
			used++
		}
	}
	var out []vendorTypeSpec
	for _, t := range vendorCatalog {
		if active != nil && active.id != t.id {
			continue
		}
		if used >= t.max {
			continue
		}
		out = append(out, t)
	}
	return out
}

func (s *Server) creatable(vf *vendorVF) string {
	s.mu.Lock()
	ts := s.creatableLocked(vf)
	s.mu.Unlock()
	sort.Slice(ts, func(i, j int) bool { return ts[i].id < ts[j].id })
	var b strings.Builder
	b.WriteString("ID    : vGPU Name\n")
	for _, t := range ts {
		fmt.Fprintf(&b, "%6d : %s\n", t.id, t.name)
	}
	return b.String()
}

func (s *Server) vendorWrite(ctx context.Context, vf *vendorVF, b []byte) syscall.Errno {
	id, err := strconv.ParseUint(strings.TrimSpace(string(b)), 0, 32)
	if err != nil {
		return syscall.EINVAL
	}
	if id == 0 {
		if e := s.releaseGate(); e != 0 {
			return e
		}
		s.mu.Lock()
		vf.typ = nil
		s.mu.Unlock()
		return 0
	}
	if e := s.ctl.fault(CtlFailCreate); e != 0 {
		return e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if vf.typ != nil {
		return syscall.EBUSY
	}
	for _, t := range s.creatableLocked(vf) {
		if uint64(t.id) == id {
			vf.typ = &t
			return 0
		}
	}
	return syscall.EINVAL
}

// Paths relative to the mount point, for tests and tools.

// MdevParent returns the PCI address of mdev parent i.
func MdevParent(i int) string { return mdevParentAddr(i) }

// VendorVF returns the PCI address of vendor VF i.
func VendorVF(i int) string { return vendorVFAddr(i) }

// MdevCreatePath is the create file of type typeID on parent, relative to the root.
func MdevCreatePath(parent, typeID string) string {
	return path.Join("class/mdev_bus", parent, "mdev_supported_types", typeID, "create")
}
