package gpu

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// PCI class codes (the class attribute, 0xCCSSPP) the passthrough driver
// tells apart.
const (
	// classDisplay is the base class of every GPU: VGA (0x0300xx), XGA,
	// 3D controller (0x0302xx, most data-centre GPUs).
	classDisplay = 0x03
	// classBridge is a PCI bridge (0x0604xx): a root or switch port, bound
	// to pcieport. It may share an IOMMU group and is never unbound.
	classBridge = 0x0604
)

// Driver names under bus/pci/drivers/.
const (
	// DriverVFIO is vfio-pci, the driver a passthrough device is bound to.
	DriverVFIO = "vfio-pci"
	// DriverPCIePort is the port-service driver of PCIe bridges; a group
	// holding one stays viable (the kernel's driver_managed_dma).
	DriverPCIePort = "pcieport"
)

// PCIFunction is one PCI function as sysfs shows it now.
type PCIFunction struct {
	// Addr is the function's address ("0000:81:00.0"), its name in
	// bus/pci/devices.
	Addr string `json:"addr"`
	// Vendor and Device are the ids in hex without 0x ("10de", "2335").
	Vendor string `json:"vendor"`
	Device string `json:"device"`
	// Class is the class attribute (0x030200 for a 3D controller).
	Class uint32 `json:"class"`
	// Driver is the bound driver's name; empty when none is.
	Driver string `json:"driver,omitempty"`
	// Override is driver_override; empty when unset ("(null)").
	Override string `json:"driver_override,omitempty"`
	// Group is the IOMMU group's number; empty when the function has none
	// (no IOMMU: it cannot be passed through).
	Group string `json:"iommu_group,omitempty"`
	// HasReset: the function offers the reset attribute (a function-level
	// or other reset the kernel can do to this function alone).
	HasReset bool `json:"has_reset,omitempty"`
	// Serial is the PCIe Device Serial Number ("00-11-22-33-44-55-66-77",
	// as lspci prints it), "" when the function has none or its extended
	// config space cannot be read (only root reads past 64 bytes).
	Serial string `json:"serial,omitempty"`
}

// ID is vendor:device, as lspci -n and --gpu-passthrough write it.
func (f PCIFunction) ID() string { return f.Vendor + ":" + f.Device }

// IsDisplay reports a display-class function (a GPU).
func (f PCIFunction) IsDisplay() bool { return f.Class>>16 == classDisplay }

// IsBridge reports a PCI bridge, which a passthrough never takes.
func (f PCIFunction) IsBridge() bool { return f.Class>>8 == classBridge }

// slot is domain:bus:device, shared by the functions of one card (a GPU's
// audio function is .1 of the GPU's slot).
func (f PCIFunction) slot() string {
	if i := strings.LastIndexByte(f.Addr, '.'); i > 0 {
		return f.Addr[:i]
	}
	return f.Addr
}

// pciClasses are the PCI base classes by name, as lspci prints them
// (pci.ids), for an operator reading why a group is not offered.
var pciClasses = map[uint32]string{
	0x00: "unclassified device", 0x01: "mass storage controller", 0x02: "network controller",
	0x03: "display controller", 0x04: "multimedia controller", 0x05: "memory controller",
	0x06: "bridge", 0x07: "communication controller", 0x08: "generic system peripheral",
	0x09: "input device controller", 0x0a: "docking station", 0x0b: "processor",
	0x0c: "serial bus controller", 0x0d: "wireless controller", 0x0e: "intelligent controller",
	0x0f: "satellite communications controller", 0x10: "encryption controller",
	0x11: "signal processing controller", 0x12: "processing accelerators", 0x13: "non-essential instrumentation",
}

// ClassName names class's base class ("network controller"), or gives
// it in hex.
func ClassName(class uint32) string {
	if n, ok := pciClasses[class>>16]; ok {
		return n
	}
	return fmt.Sprintf("class %#06x", class)
}

// readPCIFunction reads bus/pci/devices/<addr>. A directory without a
// class attribute (not a PCI function) is os.ErrNotExist, so listings skip
// it.
func readPCIFunction(root, addr string) (PCIFunction, error) {
	if !pciAddr.MatchString(addr) {
		return PCIFunction{}, fmt.Errorf("vgpu: PCI address %q: %w", addr, ErrInvalid)
	}
	dir := vfPath(root, addr)
	f := PCIFunction{Addr: addr}
	cls, err := readAttr(filepath.Join(dir, "class"))
	if err != nil {
		return PCIFunction{}, fmt.Errorf("vgpu: read %s class: %w", addr, err)
	}
	c, err := strconv.ParseUint(cls, 0, 32)
	if err != nil {
		return PCIFunction{}, fmt.Errorf("vgpu: %s class %q: %w: %w", addr, cls, ErrInvalid, err)
	}
	f.Class = uint32(c)
	for _, a := range []struct {
		name string
		to   *string
	}{{"vendor", &f.Vendor}, {"device", &f.Device}} {
		v, err := readAttr(filepath.Join(dir, a.name))
		if err != nil {
			return PCIFunction{}, fmt.Errorf("vgpu: read %s %s: %w", addr, a.name, err)
		}
		*a.to = strings.TrimPrefix(strings.ToLower(v), "0x")
	}
	if f.Driver, err = linkBase(filepath.Join(dir, "driver")); err != nil {
		return PCIFunction{}, fmt.Errorf("vgpu: read %s driver: %w", addr, err)
	}
	if f.Group, err = linkBase(filepath.Join(dir, "iommu_group")); err != nil {
		return PCIFunction{}, fmt.Errorf("vgpu: read %s iommu_group: %w", addr, err)
	}
	ov, err := readAttr(filepath.Join(dir, "driver_override"))
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return PCIFunction{}, fmt.Errorf("vgpu: read %s driver_override: %w", addr, err)
	case ov != "(null)":
		f.Override = ov
	}
	if _, err := os.Lstat(filepath.Join(dir, "reset")); err == nil {
		f.HasReset = true
	}
	if cfg, err := os.ReadFile(filepath.Join(dir, "config")); err == nil {
		f.Serial = deviceSerial(cfg)
	}
	return f, nil
}

// PCI Express extended capabilities (PCIe base spec 7.6): a chain of
// 32-bit headers from offset 0x100 of config space, each [15:0] the
// capability id, [31:20] the next one's offset (0 ends it).
const (
	extCapStart = 0x100
	extCapDSN   = 0x0003 // Device Serial Number: two dwords after the header
)

// deviceSerial is the Device Serial Number in config space cfg, "" when
// there is none. The chain is walked at most 1024 steps, so a looped one
// in a bad card ends.
func deviceSerial(cfg []byte) string {
	off := extCapStart
	for range 1024 {
		if off < extCapStart || off+12 > len(cfg) {
			return ""
		}
		hdr := binary.LittleEndian.Uint32(cfg[off:])
		if hdr == 0 || hdr == 0xffffffff {
			return ""
		}
		if hdr&0xffff == extCapDSN {
			var b [8]byte
			binary.BigEndian.PutUint64(b[:], uint64(binary.LittleEndian.Uint32(cfg[off+8:]))<<32|uint64(binary.LittleEndian.Uint32(cfg[off+4:])))
			parts := make([]string, len(b))
			for i, v := range b {
				parts[i] = fmt.Sprintf("%02x", v)
			}
			return strings.Join(parts, "-")
		}
		off = int(hdr>>20) &^ 3
	}
	return ""
}

// linkBase is the last element of a symlink's target, "" when the link is
// absent (a driver link of an unbound function).
func linkBase(link string) (string, error) {
	t, err := os.Readlink(link)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return filepath.Base(t), nil
}

// pciFunctions lists every PCI function under bus/pci/devices.
func pciFunctions(ctx context.Context, root string) ([]PCIFunction, error) {
	fns, err := readEntries(ctx, filepath.Join(root, "bus", "pci", "devices"), "PCI functions", func(name string) (PCIFunction, error) {
		if !pciAddr.MatchString(name) {
			return PCIFunction{}, os.ErrNotExist
		}
		return readPCIFunction(root, name)
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(fns, func(i, j int) bool { return fns[i].Addr < fns[j].Addr })
	return fns, nil
}

// groupFunctions reads every function of IOMMU group g, in address order.
func groupFunctions(ctx context.Context, root, g string) ([]PCIFunction, error) {
	if _, err := strconv.ParseUint(g, 10, 32); err != nil {
		return nil, fmt.Errorf("vgpu: IOMMU group %q: %w", g, ErrInvalid)
	}
	dir := filepath.Join(root, "kernel", "iommu_groups", g, "devices")
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("vgpu: IOMMU group %s: %w", g, ErrNoGroup)
	}
	fns, err := readEntries(ctx, dir, "IOMMU group "+g, func(name string) (PCIFunction, error) {
		return readPCIFunction(root, name)
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(fns, func(i, j int) bool { return fns[i].Addr < fns[j].Addr })
	return fns, nil
}

// isVGPUParent reports a GPU that serves vGPUs, which is never handed out
// whole: an mdev parent (mdev_supported_types), a VF (physfn) or one with
// NVIDIA's vendor-VFIO files, or an SR-IOV PF with VFs enabled.
func isVGPUParent(root, addr string) bool {
	dir := vfPath(root, addr)
	for _, p := range []string{"mdev_supported_types", "physfn", "nvidia/creatable_vgpu_types"} {
		if _, err := os.Lstat(filepath.Join(dir, p)); err == nil {
			return true
		}
	}
	n, err := readAttr(filepath.Join(dir, "sriov_numvfs"))
	return err == nil && n != "" && n != "0"
}
