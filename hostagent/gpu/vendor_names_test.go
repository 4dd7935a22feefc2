package gpu

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An agent restarted while every VF is busy (killed mid-claim, say) still
// names the types in use: the names it saw free are kept in the state dir.
// Without them a busy VF lists nothing, its type has no name, and admission
// refused the host's own profile as "not offered" (InvalidInput) where the
// crash matrix wanted a retried claim, or NoVGPUCapacity.
func TestVendorTypeNamesOutliveTheAgent(t *testing.T) {
	root := t.TempDir()
	sys := filepath.Join(root, "sys")
	vf := filepath.Join(sys, "bus", "pci", "devices", "0000:41:00.4", "nvidia")
	require.NoError(t, os.MkdirAll(vf, 0o755))
	set := func(creatable, current string) {
		require.NoError(t, os.WriteFile(filepath.Join(vf, "creatable_vgpu_types"), []byte(creatable), 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(vf, "current_vgpu_type"), []byte(current), 0o644))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	names := func(d *VendorDriver) []string {
		profs, err := d.Profiles(ctx)
		require.NoError(t, err)
		var out []string
		for _, p := range profs {
			out = append(out, p.Name)
		}
		return out
	}

	state := filepath.Join(root, "state")
	require.NoError(t, os.MkdirAll(state, 0o700))
	set("ID    : vGPU Name\n557 : NVIDIA L40-1Q\n558 : NVIDIA L40-2Q\n", "0")
	assert.Contains(t, names(NewVendor(Config{SysfsRoot: sys, StateDir: state})), "NVIDIA L40-1Q", "a free VF names its types")

	set("", "557") // busy: the VF lists nothing
	assert.Equal(t, []string{"NVIDIA L40-1Q"}, names(NewVendor(Config{SysfsRoot: sys, StateDir: state})), "a restarted agent names the busy VF's type")
	assert.Equal(t, []string{""}, names(NewVendor(Config{SysfsRoot: sys, StateDir: t.TempDir()})), "without the kept names the type has none")

	// A name is one line: one with a line break cannot forge an entry.
	set("559 : evil\n", "0")
	d := NewVendor(Config{SysfsRoot: sys, StateDir: state})
	d.mu.Lock()
	d.names[560] = "two\n561 : forged"
	d.saveNames()
	d.mu.Unlock()
	b, err := os.ReadFile(filepath.Join(state, vendorNamesFile))
	require.NoError(t, err)
	assert.NotContains(t, string(b), "\n561 :")
}
