package topology

import (
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
)

// PCILocality is where a PCI device sits.
type PCILocality struct {
	// NUMANode is the device's numa_node: a node number, or NoNode when
	// the platform did not say (see Topology.DeviceNode).
	NUMANode int `json:"numa_node"`
	// PCIeRoot is the PCI root complex ("pci0000:80") the device hangs
	// under, as Kubernetes DRA's resource.kubernetes.io/pcieRoot names
	// it: devices under one root share its host bridge; "" when sysfs
	// does not show the path (bus/pci/devices/<addr> not a link).
	PCIeRoot string `json:"pcie_root,omitempty"`
	// RootPort is the root port ("0000:80:01.0") the device hangs under,
	// through any switches; "" when it sits on the root bus itself (an
	// integrated device) or PCIeRoot is not known.
	RootPort string `json:"root_port,omitempty"`
}

// pciAddr is a PCI function's address as sysfs names it; checked before
// it becomes part of a path.
var pciAddr = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

// rootComplex is a root complex's folder under devices/ ("pci0000:80":
// domain and root bus; Intel VMD's domains have five digits and more).
var rootComplex = regexp.MustCompile(`^pci[0-9a-f]{4,8}:[0-9a-f]{2}$`)

// ReadPCILocality reads where PCI function addr ("0000:81:00.0") sits:
// its numa_node, and its root complex and root port from the target of
// bus/pci/devices/<addr> (a link into devices/, read, not followed:
// "../../../devices/pci0000:80/0000:80:01.0/0000:81:00.0"). A device
// without numa_node (a kernel that does not show it) is on NoNode. An
// error wraps ErrMalformed for a bad address or a tree the kernel would
// not make, or the read's own error (os.ErrNotExist: no such device).
func ReadPCILocality(sysRoot, addr string) (PCILocality, error) {
	if !pciAddr.MatchString(addr) {
		return PCILocality{}, fmt.Errorf("topology: PCI address %q: %w", addr, ErrMalformed)
	}
	link := filepath.Join(sysRoot, "bus", "pci", "devices", addr)
	l := PCILocality{NUMANode: NoNode}
	target, err := os.Readlink(link)
	switch {
	case errors.Is(err, syscall.EINVAL): // a folder, not a link: no path to read
		if _, err := os.Stat(link); err != nil {
			return PCILocality{}, fmt.Errorf("topology: PCI device %s: %w", addr, err)
		}
	case err != nil:
		return PCILocality{}, fmt.Errorf("topology: PCI device %s: %w", addr, err)
	default:
		if l.PCIeRoot, l.RootPort, err = pcieRoot(target, addr); err != nil {
			return PCILocality{}, err
		}
	}
	s, err := readAttr(filepath.Join(link, "numa_node"))
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return PCILocality{}, fmt.Errorf("topology: PCI device %s numa_node: %w", addr, err)
	default:
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < NoNode || n > maxNodeID {
			return PCILocality{}, fmt.Errorf("topology: PCI device %s numa_node %q: %w", addr, strings.TrimSpace(s), ErrMalformed)
		}
		l.NUMANode = n
	}
	return l, nil
}

// pcieRoot finds the root complex and root port in a device link's
// target: the first pciDDDD:BB element below devices/, then the PCI
// function after it unless that is the device itself. The target must
// end in the device's own address. (A link's target is at most PATH_MAX
// bytes: the kernel refuses a longer one, FUSE's included.)
func pcieRoot(target, addr string) (root, port string, err error) {
	elems := strings.Split(path.Clean(target), "/")
	if elems[len(elems)-1] != addr {
		return "", "", fmt.Errorf("topology: PCI device %s links to %q, not a folder of its own: %w", addr, target, ErrMalformed)
	}
	underDevices := false
	for i, e := range elems {
		if e == "devices" {
			underDevices = true
		}
		// x86 roots are devices/pci0000:00; an ARM host's hang under
		// their platform device (devices/platform/<soc>/<pcie>/pci0000:00).
		if !underDevices || !rootComplex.MatchString(e) {
			continue
		}
		if next := elems[i+1]; next != addr && pciAddr.MatchString(next) {
			port = next
		}
		return e, port, nil
	}
	return "", "", fmt.Errorf("topology: PCI device %s links to %q, under no devices/pciDDDD:BB: %w", addr, target, ErrMalformed)
}
