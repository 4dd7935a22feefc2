package gpu_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
)

// TestIOMMUUnsafe: each way a host lets a passed-through GPU reach past
// its guest is named, and a host with an interrupt-remapping IOMMU and
// none of them is safe.
func TestIOMMUUnsafe(t *testing.T) {
	for _, c := range []struct {
		name, cmdline, ecap, unsafe string
		amd                         bool
		want                        string
	}{
		{name: "safe", cmdline: "quiet intel_iommu=on", ecap: "f0205e"},
		{name: "amd", cmdline: "quiet", amd: true},
		{name: "no iommu", cmdline: "quiet", want: "no IOMMU is enabled"},
		{name: "no ir", cmdline: "quiet", ecap: "f02056", want: "dmar0 cannot remap interrupts"},
		{name: "intremap=off", cmdline: "intel_iommu=on intremap=off", ecap: "f0205e", want: "sets intremap=off"},
		{name: "amd intremap off", cmdline: "nointremap", amd: true, want: "sets nointremap"},
		{name: "acs override", cmdline: "pcie_acs_override=downstream,multifunction", ecap: "f0205e", want: "sets pcie_acs_override=downstream,multifunction"},
		{name: "unsafe on cmdline", cmdline: "vfio_iommu_type1.allow_unsafe_interrupts=1", ecap: "f0205e", want: "VFIO accepts a host without interrupt remapping"},
		{name: "unsafe off on cmdline", cmdline: "vfio_iommu_type1.allow_unsafe_interrupts=0", ecap: "f0205e"},
		{name: "unsafe module", cmdline: "quiet", ecap: "f0205e", unsafe: "Y", want: "allow_unsafe_interrupts is Y"},
		{name: "safe module", cmdline: "quiet", ecap: "f0205e", unsafe: "N"},
		{name: "garbled ecap", cmdline: "quiet", ecap: "zz", want: `dmar0's capabilities "zz"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			cmdline := filepath.Join(root, "cmdline")
			require.NoError(t, os.WriteFile(cmdline, []byte(c.cmdline+"\n"), 0o644))
			if c.ecap != "" {
				dir := filepath.Join(root, "class", "iommu", "dmar0", "intel-iommu")
				require.NoError(t, os.MkdirAll(dir, 0o755))
				require.NoError(t, os.WriteFile(filepath.Join(dir, "ecap"), []byte(c.ecap+"\n"), 0o644))
			}
			if c.amd {
				require.NoError(t, os.MkdirAll(filepath.Join(root, "class", "iommu", "ivhd0", "amd-iommu"), 0o755))
			}
			if c.unsafe != "" {
				dir := filepath.Join(root, "module", "vfio_iommu_type1", "parameters")
				require.NoError(t, os.MkdirAll(dir, 0o755))
				require.NoError(t, os.WriteFile(filepath.Join(dir, "allow_unsafe_interrupts"), []byte(c.unsafe+"\n"), 0o644))
			}
			got := gpu.IOMMUUnsafe(root, cmdline)
			if c.want == "" {
				assert.Empty(t, got)
				return
			}
			assert.Contains(t, got, c.want)
		})
	}
	assert.Contains(t, gpu.IOMMUUnsafe(t.TempDir(), "/nonexistent/cmdline"), "cannot read the kernel command line")
}
