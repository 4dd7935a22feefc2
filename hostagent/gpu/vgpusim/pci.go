package vgpusim

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"

	"vmflow/hostagent/proc"
)

// MaxPCIGPUs bounds Options.PCIGPUs (buses 0x81 onwards).
const MaxPCIGPUs = 32

// Driver names the simulated PCI functions bind to.
const (
	DrvNvidia   = "nvidia"
	DrvVFIO     = "vfio-pci"
	DrvHDA      = "snd_hda_intel"
	DrvPCIePort = "pcieport"
	DrvMLX5     = "mlx5_core"
)

// PCIGPU describes simulated PCI GPU i: its functions and IOMMU group.
// The shape repeats every four GPUs: i%4 == 0 a lone H200; 1 a GPU with a
// companion audio function; 2 an H200 sharing its group with a PCIe bridge
// bound to pcieport; 3 an H200 sharing its group with a NIC bound to
// mlx5_core (not viable: vmflow never unbinds the NIC).
type PCIGPU struct {
	GPU   string // the display function's address
	ID    string // its vendor:device
	Group string // IOMMU group number
	// Audio, Bridge and NIC are the other functions of the group, "" when
	// absent.
	Audio, Bridge, NIC string
	// Viable: the group can be handed out whole.
	Viable bool
	// Serial is the GPU's PCIe Device Serial Number (its config space
	// shows it; the other functions have none).
	Serial uint64
}

// PCIGPUAt returns the layout of simulated PCI GPU i (0 <= i < MaxPCIGPUs).
func PCIGPUAt(i int) PCIGPU {
	bus := 0x81 + i
	g := PCIGPU{GPU: fmt.Sprintf("0000:%02x:00.0", bus), ID: "10de:2335", Group: strconv.Itoa(pciGroupBase + i), Viable: true,
		Serial: 0x48_30_00_00_00_00_00_00 | uint64(bus)}
	switch i % 4 {
	case 1:
		g.ID = "10de:2684"
		g.Audio = fmt.Sprintf("0000:%02x:00.1", bus)
	case 2:
		g.Bridge = fmt.Sprintf("0000:80:%02x.0", i)
	case 3:
		g.NIC = fmt.Sprintf("0000:%02x:01.0", bus)
		g.Viable = false
	}
	return g
}

// pciGroupBase numbers the PCI GPUs' groups clear of the vendor VFs'
// (100 + i) and the mdevs' (1000 on).
const pciGroupBase = 400

// pciFn is one simulated PCI function.
type pciFn struct {
	addr           string
	vendor, device string
	class          uint32
	group          int
	minor          int // /dev/nvidia<minor> for a GPU; -1 otherwise
	driver         string
	override       string
	// serial is the PCIe Device Serial Number config space shows; 0:
	// none (the audio functions, bridges and NICs here).
	serial uint64
	dir    *fs.Inode
	// lock is the kernel's device_lock: unbind, bind, drivers_probe,
	// driver_override and reset take it, and a blocked unbind holds it.
	lock chan struct{}
}

// pciDriver is one bus/pci/drivers/<name>: which functions it matches
// without an override (vfio-pci matches none: no id table until new_id).
type pciDriver struct {
	name  string
	match func(f *pciFn) bool
	dir   *fs.Inode
}

var pciDriverSpecs = []pciDriver{
	{name: DrvNvidia, match: func(f *pciFn) bool { return f.vendor == "10de" && f.class>>16 == 0x03 }},
	{name: DrvVFIO, match: func(*pciFn) bool { return false }},
	{name: DrvHDA, match: func(f *pciFn) bool { return f.class>>8 == 0x0403 }},
	{name: DrvPCIePort, match: func(f *pciFn) bool { return f.class>>8 == 0x0604 }},
	{name: DrvMLX5, match: func(f *pciFn) bool { return f.vendor == "15b3" }},
}

// buildPCI creates the PCI GPUs, their groups and the drivers; called
// from build with s.mu held.
func (s *Server) buildPCI(ctx context.Context) {
	drvRoot := mkpath(ctx, s.root, "bus", "pci", "drivers")
	s.pciDrivers = map[string]*pciDriver{}
	for _, spec := range pciDriverSpecs {
		d := spec
		d.dir = mkdir(ctx, drvRoot, d.name)
		s.pciDrivers[d.name] = &d
		addFile(ctx, d.dir, "bind", woAttr(func(ctx context.Context, b []byte) syscall.Errno { return s.pciBind(d.name, b) }))
		addFile(ctx, d.dir, "unbind", woAttr(func(ctx context.Context, b []byte) syscall.Errno { return s.pciUnbind(d.name, b) }))
	}
	addFile(ctx, mkpath(ctx, s.root, "bus", "pci"), "drivers_probe", woAttr(func(ctx context.Context, b []byte) syscall.Errno {
		return s.pciProbe(b)
	}))
	s.buildIOMMU(ctx)
	s.pci = map[string]*pciFn{}
	// Each GPU under a root port of its own, but one in another's IOMMU
	// group under that GPU's: they sit behind one switch without ACS.
	ports := make([]*pciPort, s.opts.PCIGPUs)
	for i := range ports {
		if _, shared := s.opts.PCIGroupWith[i]; !shared {
			ports[i] = s.newPortLocked(ctx, s.opts.cardNode(PCIGPUAt(i).GPU, i))
		}
	}
	for i := range ports {
		if j, shared := s.opts.PCIGroupWith[i]; shared {
			if ports[i] = ports[j]; ports[i] == nil { // j went to a third GPU's group
				ports[i] = s.newPortLocked(ctx, s.opts.cardNode(PCIGPUAt(i).GPU, i))
			}
		}
	}
	for i := 0; i < s.opts.PCIGPUs; i++ {
		g := PCIGPUAt(i)
		pci := ports[i]
		group, _ := strconv.Atoi(g.Group)
		if j, ok := s.opts.PCIGroupWith[i]; ok {
			group, _ = strconv.Atoi(PCIGPUAt(j).Group)
		}
		vendor, device, _ := strings.Cut(g.ID, ":")
		cls := uint32(0x030200)
		if i%4 == 1 {
			cls = 0x030000 // a VGA controller, as cards with outputs are
		}
		s.addPCIFn(ctx, pci, &pciFn{addr: g.GPU, vendor: vendor, device: device, class: cls, group: group, minor: i, driver: DrvNvidia, serial: g.Serial},
			!slices.Contains(s.opts.PCINoReset, i))
		if g.Audio != "" {
			s.addPCIFn(ctx, pci, &pciFn{addr: g.Audio, vendor: "10de", device: "22ba", class: 0x040300, group: group, minor: -1, driver: DrvHDA}, false)
		}
		if g.Bridge != "" {
			s.addPCIFn(ctx, pci, &pciFn{addr: g.Bridge, vendor: "1000", device: "c010", class: 0x060400, group: group, minor: -1, driver: DrvPCIePort}, false)
		}
		if g.NIC != "" {
			s.addPCIFn(ctx, pci, &pciFn{addr: g.NIC, vendor: "15b3", device: "101d", class: 0x020000, group: group, minor: -1, driver: DrvMLX5}, true)
		}
	}
}

// addPCIFn adds f's directory, attributes, group and driver links.
// reset: the function offers the reset attribute (the kernel hides it
// when the function has no reset method; the audio functions here have
// none).
func (s *Server) addPCIFn(ctx context.Context, port *pciPort, f *pciFn, reset bool) {
	f.lock = make(chan struct{}, 1)
	s.pci[f.addr] = f
	f.dir = s.pciHomeLocked(ctx, port, f.addr)
	// Read under mu: Reboot may put another card at the address.
	addFile(ctx, f.dir, "vendor", roAttr(func() string { return "0x" + s.locked(func() string { return f.vendor }) + "\n" }))
	addFile(ctx, f.dir, "device", roAttr(func() string { return "0x" + s.locked(func() string { return f.device }) + "\n" }))
	addFile(ctx, f.dir, "class", roAttr(func() string { return fmt.Sprintf("0x%06x\n", f.class) }))
	addFile(ctx, f.dir, "config", roAttr(func() string { return s.config(f) }))
	addFile(ctx, f.dir, "driver_override", rwAttr(
		func() string {
			s.mu.Lock()
			defer s.mu.Unlock()
			if f.override == "" {
				return "(null)\n"
			}
			return f.override + "\n"
		},
		func(ctx context.Context, b []byte) syscall.Errno { return s.pciOverride(f, b) },
	))
	if reset {
		addFile(ctx, f.dir, "reset", woAttr(func(ctx context.Context, b []byte) syscall.Errno { return s.pciReset(f, b) }))
		addFile(ctx, f.dir, "reset_method", roAttr(func() string { return "flr bus\n" }))
	}
	s.addGroupLocked(ctx, f.dir, f.group, f.addr, "bus/pci/devices/"+f.addr)
	s.attachLocked(ctx, f, f.driver)
}

// attachLocked binds f to drv: the driver link, the driver's device link,
// and for vfio-pci the group's VFIO node.
func (s *Server) attachLocked(ctx context.Context, f *pciFn, drv string) {
	f.driver = drv
	addLink(ctx, f.dir, "driver", up(4)+"bus/pci/drivers/"+drv)
	addLink(ctx, s.pciDrivers[drv].dir, f.addr, up(4)+"bus/pci/devices/"+f.addr)
	s.syncVFIONodeLocked(f.group)
}

// vfioNode and nvidiaNode are the device nodes under Options.DevRoot; ""
// without one.
func (s *Server) vfioNode(group int) string {
	if s.opts.DevRoot == "" {
		return ""
	}
	return filepath.Join(s.opts.DevRoot, "vfio", strconv.Itoa(group))
}

func (s *Server) nvidiaNode(f *pciFn) string {
	if s.opts.DevRoot == "" || f.minor < 0 {
		return ""
	}
	return filepath.Join(s.opts.DevRoot, "nvidia"+strconv.Itoa(f.minor))
}

// syncVFIONodeLocked makes the group's VFIO node exist while any of its
// functions is bound to vfio-pci, as the kernel creates the VFIO group at
// the first vfio-pci probe and removes it after the last remove. The
// node is a plain file: a test holds it open to stand for QEMU.
func (s *Server) syncVFIONodeLocked(group int) {
	node := s.vfioNode(group)
	if node == "" {
		return
	}
	any := false
	for _, f := range s.pci {
		if f.group == group && f.driver == DrvVFIO {
			any = true
		}
	}
	if any {
		if fd, err := os.OpenFile(node, os.O_CREATE|os.O_RDWR, 0o600); err == nil {
			_ = fd.Close()
		}
		return
	}
	_ = os.Remove(node)
}

// lockFn takes f's device lock, or gives up at shutdown.
func (s *Server) lockFn(f *pciFn) bool {
	select {
	case f.lock <- struct{}{}:
		return true
	case <-s.closing:
		return false
	}
}

func (s *Server) unlockFn(f *pciFn) { <-f.lock }

// named runs op under the device lock of the function a bind, unbind or
// drivers_probe write names (like sysfs_streq, one trailing newline is
// ignored): ENODEV when there is none.
func (s *Server) named(b []byte, op func(f *pciFn) syscall.Errno) syscall.Errno {
	s.mu.Lock()
	f := s.pci[strings.TrimSuffix(string(b), "\n")]
	s.mu.Unlock()
	if f == nil {
		return syscall.ENODEV
	}
	return s.withLock(f, op)
}

// withLock runs op holding f's device lock (ENODEV at shutdown).
func (s *Server) withLock(f *pciFn, op func(f *pciFn) syscall.Errno) syscall.Errno {
	if !s.lockFn(f) {
		return syscall.ENODEV
	}
	defer s.unlockFn(f)
	return op(f)
}

// pciOverride is driver_override_store: a newline alone or nothing
// clears it; the kernel does not check that the driver exists.
func (s *Server) pciOverride(f *pciFn, b []byte) syscall.Errno {
	v := strings.TrimSuffix(string(b), "\n")
	if len(b) >= 4096 {
		return syscall.EINVAL
	}
	return s.withLock(f, func(f *pciFn) syscall.Errno {
		s.mu.Lock()
		f.override = v
		s.mu.Unlock()
		return 0
	})
}

// pciBind is bind_store: ENODEV for no such function or no match (an
// override naming another driver, vfio-pci without one), EBUSY when the
// function has a driver.
func (s *Server) pciBind(drv string, b []byte) syscall.Errno {
	return s.named(b, func(f *pciFn) syscall.Errno {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.matchLocked(f) != drv {
			return syscall.ENODEV
		}
		if f.driver != "" {
			return syscall.EBUSY
		}
		s.attachLocked(context.Background(), f, drv)
		return 0
	})
}

// matchLocked is the driver that would take f now (pci_match_device: an
// override matches only the driver it names).
func (s *Server) matchLocked(f *pciFn) string {
	if f.override != "" {
		if _, ok := s.pciDrivers[f.override]; ok {
			return f.override
		}
		return ""
	}
	names := make([]string, 0, len(s.pciDrivers))
	for n := range s.pciDrivers {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if s.pciDrivers[n].match(f) {
			return n
		}
	}
	return ""
}

// pciProbe is drivers_probe_store: ENODEV for no such function; a bound
// function is left as it is, and one no driver matches stays unbound,
// both successes, as the kernel's bus_rescan_devices_helper.
func (s *Server) pciProbe(b []byte) syscall.Errno {
	return s.named(b, func(f *pciFn) syscall.Errno {
		s.gate(func() bool { return s.ctl.existsAt(CtlBlockProbe, f.addr) && s.unbound(f) }, "", nil)
		s.mu.Lock()
		defer s.mu.Unlock()
		if f.driver != "" {
			return 0
		}
		if s.ctl.existsAt(CtlFailProbe, f.addr) {
			return 0 // the driver's probe failed: the write succeeds, unbound
		}
		if drv := s.matchLocked(f); drv != "" {
			s.attachLocked(context.Background(), f, drv)
		}
		return 0
	})
}

// pciUnbind is unbind_store: ENODEV unless the function is bound to drv.
// As the kernel's __device_release_driver, the driver link goes first and
// the driver's remove then waits, holding the device lock: NVIDIA's while
// a process holds the GPU's /dev/nvidia<N>, vfio-pci's while one holds the
// group's VFIO node (vfio_unregister_group_dev). fail-unbind fails the
// write before anything changes; block-unbind holds it after the link is
// gone.
func (s *Server) pciUnbind(drv string, b []byte) syscall.Errno {
	return s.named(b, func(f *pciFn) syscall.Errno { return s.unbindLocked(f, drv) })
}

// unbindLocked is pciUnbind under f's device lock.
func (s *Server) unbindLocked(f *pciFn, drv string) syscall.Errno {
	s.mu.Lock()
	bound := f.driver == drv
	s.mu.Unlock()
	if !bound {
		return syscall.ENODEV
	}
	if e := s.ctl.faultAt(CtlFailUnbind, f.addr); e != 0 {
		return e
	}
	s.mu.Lock()
	f.dir.RmChild("driver")
	s.pciDrivers[drv].dir.RmChild(f.addr)
	s.mu.Unlock()
	var node string
	switch drv {
	case DrvNvidia:
		node = s.nvidiaNode(f)
	case DrvVFIO:
		node = s.vfioNode(f.group)
	}
	s.gate(func() bool { return s.ctl.existsAt(CtlBlockUnbind, f.addr) }, "", func() bool { return held(node) })
	s.mu.Lock()
	f.driver = ""
	s.syncVFIONodeLocked(f.group)
	s.mu.Unlock()
	return 0
}

// held reports whether a process has node open. Processes whose
// descriptors cannot be read are not counted: the simulator models a
// driver's use count, not vmflow's guard.
func held(node string) bool {
	if node == "" {
		return false
	}
	if _, err := os.Stat(node); err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	hs, err := proc.Holders(ctx, node)
	if err != nil {
		return false
	}
	for _, h := range hs {
		if !h.Uncertain {
			return true
		}
	}
	return false
}

// pciReset is reset_store: "1" resets (fail-reset fails it), anything
// else is EINVAL.
func (s *Server) pciReset(f *pciFn, b []byte) syscall.Errno {
	v, err := strconv.ParseUint(strings.TrimSuffix(string(b), "\n"), 0, 64)
	if err != nil || v != 1 {
		return syscall.EINVAL
	}
	return s.withLock(f, func(*pciFn) syscall.Errno { return s.ctl.faultAt(CtlFailReset, f.addr) })
}

// PCIDriver is the driver simulated function addr is bound to ("" none),
// and whether the function exists; tests read the model, not sysfs.
func (s *Server) PCIDriver(addr string) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := s.pci[addr]
	if f == nil {
		return "", false
	}
	return f.driver, true
}

// errNoDevRoot: a node was asked of a simulator without Options.DevRoot.
var errNoDevRoot = errors.New("vgpusim: no DevRoot")

// NvidiaNode is /dev/nvidia<N> of PCI GPU i under Options.DevRoot: a test
// holds it open to stand for a host process using the GPU.
func (s *Server) NvidiaNode(i int) (string, error) {
	if s.opts.DevRoot == "" {
		return "", errNoDevRoot
	}
	return filepath.Join(s.opts.DevRoot, "nvidia"+strconv.Itoa(i)), nil
}

// unbound reports whether f has no driver.
func (s *Server) unbound(f *pciFn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return f.driver == ""
}

// locked runs get under mu.
func (s *Server) locked(get func() string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return get()
}

// config is f's config space: the ids and class in the header, and at
// 0x100 a Device Serial Number capability when f has a serial (the rest
// of the chain is empty), as root reads it.
func (s *Server) config(f *pciFn) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := make([]byte, 0x10c)
	v, _ := strconv.ParseUint(f.vendor, 16, 16)
	d, _ := strconv.ParseUint(f.device, 16, 16)
	binary.LittleEndian.PutUint16(b[0:], uint16(v))
	binary.LittleEndian.PutUint16(b[2:], uint16(d))
	b[9], b[10], b[11] = byte(f.class), byte(f.class>>8), byte(f.class>>16)
	if f.serial != 0 {
		binary.LittleEndian.PutUint32(b[0x100:], 0x0003|1<<16) // DSN, version 1, last
		binary.LittleEndian.PutUint32(b[0x104:], uint32(f.serial))
		binary.LittleEndian.PutUint32(b[0x108:], uint32(f.serial>>32))
	}
	return string(b)
}

// Reboot describes a host reboot of the PCI GPUs: every function comes
// back on the driver that matches it, with no driver_override and no VFIO
// node, and the kernel may number the IOMMU groups anew or find other
// cards.
type Reboot struct {
	// GroupOffset is added to every PCI function's IOMMU group number: the
	// kernel numbers groups in discovery order, so a card added or removed
	// renumbers the rest.
	GroupOffset int
	// Remove lists the PCI functions gone after the reboot (a card taken
	// out).
	Remove []string
	// Replace maps an address to the vendor:device of the card now there
	// (another card in the slot, or a re-enumeration that moved cards); it
	// has another serial number, even of the same model.
	Replace map[string]string
}

// Reboot reboots the simulated host's PCI GPUs as r says. Functions that
// remain keep their address; a write blocked on a function finishes first
// (the reboot takes every device lock).
func (s *Server) Reboot(r Reboot) error {
	for id := range r.Replace {
		if v, d, ok := strings.Cut(r.Replace[id], ":"); !ok || len(v) != 4 || len(d) != 4 {
			return fmt.Errorf("vgpusim: reboot: %s: %q is not vendor:device", id, r.Replace[id])
		}
	}
	s.mu.Lock()
	fns := make([]*pciFn, 0, len(s.pci))
	for _, f := range s.pci {
		fns = append(fns, f)
	}
	s.mu.Unlock()
	for _, f := range fns {
		if !s.lockFn(f) {
			return fmt.Errorf("vgpusim: reboot: %w", syscall.ENODEV)
		}
		defer s.unlockFn(f)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	ctx := context.Background()
	groups := mkpath(ctx, s.root, "kernel", "iommu_groups")
	old := map[int]bool{}
	for _, f := range fns {
		if f.driver != "" {
			f.dir.RmChild("driver")
			s.pciDrivers[f.driver].dir.RmChild(f.addr)
		}
		f.driver, f.override = "", ""
		f.dir.RmChild("iommu_group")
		old[f.group] = true
	}
	for g := range old {
		groups.RmChild(strconv.Itoa(g))
		s.syncVFIONodeLocked(g)
	}
	for _, a := range r.Remove {
		if f := s.pci[a]; f != nil {
			s.removeHomeLocked(a)
			delete(s.pci, a)
		}
	}
	for _, f := range s.pci {
		if id, ok := r.Replace[f.addr]; ok {
			f.vendor, f.device, _ = strings.Cut(id, ":")
			if f.serial != 0 {
				f.serial += 1 << 32
			}
		}
		f.group += r.GroupOffset
		s.addGroupLocked(ctx, f.dir, f.group, f.addr, "bus/pci/devices/"+f.addr)
		if drv := s.matchLocked(f); drv != "" {
			s.attachLocked(ctx, f, drv)
		}
	}
	return nil
}

// PCIGroup is the IOMMU group of simulated function addr now ("" when it
// does not exist).
func (s *Server) PCIGroup(addr string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.pci[addr]; f != nil {
		return strconv.Itoa(f.group)
	}
	return ""
}

// buildIOMMU gives the host an Intel IOMMU with interrupt remapping
// (class/iommu/dmar0/intel-iommu/ecap, bit 3) and vfio_iommu_type1's
// allow_unsafe_interrupts parameter, which the passthrough driver checks
// before it offers a GPU. CtlNoIntRemap and CtlUnsafeInterrupts flip them
// while they exist, as a host booted with intremap=off or with the module
// option set would show them.
func (s *Server) buildIOMMU(ctx context.Context) {
	addFile(ctx, mkpath(ctx, s.root, "class", "iommu", "dmar0", "intel-iommu"), "ecap", roAttr(func() string {
		ecap := uint64(0xf0205e)
		if s.ctl.exists(CtlNoIntRemap) {
			ecap &^= 1 << 3
		}
		return fmt.Sprintf("%x\n", ecap)
	}))
	addFile(ctx, mkpath(ctx, s.root, "module", "vfio_iommu_type1", "parameters"), "allow_unsafe_interrupts", roAttr(func() string {
		if s.ctl.exists(CtlUnsafeInterrupts) {
			return "Y\n"
		}
		return "N\n"
	}))
}
