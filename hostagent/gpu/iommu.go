package gpu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"vmflow/internal/errdefs"
)

// ErrUnsafeIOMMU: the host's IOMMU does not keep a passed-through GPU to
// its guest (IOMMUUnsafe says why); no whole GPU is offered or bound.
var ErrUnsafeIOMMU = errdefs.Refused.New("gpu: the host's IOMMU does not isolate a passed-through GPU")

// intelECapIR is the Interrupt Remapping bit of an Intel IOMMU's extended
// capability register (VT-d specification, 11.4.3), which sysfs shows in
// hex in class/iommu/dmar*/intel-iommu/ecap.
const intelECapIR = 1 << 3

// IOMMUUnsafe says why this host's IOMMU would let a passed-through GPU
// reach beyond its guest, "" when nothing known does. It reads sysfs under
// sysfsRoot and the kernel command line at cmdline, and finds:
//   - no IOMMU at all (class/iommu empty): no group isolates anything;
//   - interrupts not remapped (intremap=off or nointremap on the command
//     line, or an Intel IOMMU without the capability): a guest's device can
//     write MSIs the host takes as its own;
//   - vfio_iommu_type1's allow_unsafe_interrupts set (the module's sysfs
//     parameter, or on the command line): VFIO then accepts such a host;
//   - pcie_acs_override on the command line: groups split where the
//     hardware does not isolate, so a GPU's DMA may reach the functions
//     beside it.
//
// AMD IOMMUs remap interrupts unless the command line turns it off, which
// the command line check covers. A file that cannot be read for a reason
// other than its absence is itself a reason: the host is not known safe.
func IOMMUUnsafe(sysfsRoot, cmdline string) string {
	args, err := os.ReadFile(cmdline)
	if err != nil {
		return fmt.Sprintf("cannot read the kernel command line: %v", err)
	}
	for _, a := range strings.Fields(string(args)) {
		key, val, _ := strings.Cut(a, "=")
		switch {
		case key == "pcie_acs_override":
			return "the kernel command line sets " + a + ": IOMMU groups are split where the hardware does not isolate its functions"
		case key == "vfio_iommu_type1.allow_unsafe_interrupts" && val != "0" && !strings.EqualFold(val, "n"):
			return "the kernel command line sets " + a + ": VFIO accepts a host without interrupt remapping"
		case key == "intremap" && (val == "off" || val == "nosid"), key == "nointremap":
			return "the kernel command line sets " + a + ": interrupts from a guest's device are not remapped"
		}
	}
	switch v, err := os.ReadFile(filepath.Join(sysfsRoot, "module", "vfio_iommu_type1", "parameters", "allow_unsafe_interrupts")); {
	case errors.Is(err, os.ErrNotExist): // not loaded: its default is N
	case err != nil:
		return fmt.Sprintf("cannot read vfio_iommu_type1's allow_unsafe_interrupts: %v", err)
	case strings.TrimSpace(string(v)) != "N":
		return "vfio_iommu_type1 allow_unsafe_interrupts is " + strings.TrimSpace(string(v)) + ": VFIO accepts a host without interrupt remapping"
	}
	units, err := os.ReadDir(filepath.Join(sysfsRoot, "class", "iommu"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Sprintf("cannot list the IOMMUs: %v", err)
	}
	if len(units) == 0 {
		return "no IOMMU is enabled (" + filepath.Join(sysfsRoot, "class", "iommu") + " is empty): enable VT-d or AMD-Vi and intel_iommu=on or amd_iommu=on"
	}
	for _, u := range units {
		raw, err := os.ReadFile(filepath.Join(sysfsRoot, "class", "iommu", u.Name(), "intel-iommu", "ecap"))
		if errors.Is(err, os.ErrNotExist) {
			continue // not an Intel unit
		}
		if err != nil {
			return fmt.Sprintf("cannot read %s's capabilities: %v", u.Name(), err)
		}
		ecap, err := strconv.ParseUint(strings.TrimSpace(string(raw)), 16, 64)
		if err != nil {
			return fmt.Sprintf("%s's capabilities %q: %v", u.Name(), strings.TrimSpace(string(raw)), err)
		}
		if ecap&intelECapIR == 0 {
			return u.Name() + " cannot remap interrupts (no IR in its ecap): a guest's device could write interrupts the host takes as its own"
		}
	}
	return ""
}
