package gpu_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
)

// plainMdevTree lays out class/mdev_bus/<parent>/mdev_supported_types in
// a plain folder (not sysfs, not the simulator): types of one parent GPU,
// name → available_instances text.
func plainMdevTree(t *testing.T, parent string, types map[string][2]string) string {
	t.Helper()
	root := t.TempDir()
	for typeID, f := range types {
		dir := filepath.Join(root, "class", "mdev_bus", parent, "mdev_supported_types", typeID)
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "name"), []byte(f[0]+"\n"), 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "available_instances"), []byte(f[1]+"\n"), 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "create"), nil, 0o644))
	}
	require.NoError(t, os.MkdirAll(filepath.Join(root, "bus", "mdev", "devices"), 0o755))
	return root
}

// A create reads the availability of the profile it asks for only, and
// admission's names read none: a count another type cannot give (here
// not a number) stops neither. Profiles, which lists every type's count,
// says what is wrong.
func TestMdevCreateReadsOnlyTheAskedProfile(t *testing.T) {
	const parent = "0000:41:00.0"
	root := plainMdevTree(t, parent, map[string][2]string{
		"nvidia-471": {"GRID A100-4C", "3"},
		"nvidia-477": {"GRID A100-40C", "not a number"},
	})
	drv, err := gpu.New(gpu.Config{SysfsRoot: root, StateDir: t.TempDir(), Kind: gpu.KindMdev})
	require.NoError(t, err)
	ctx := context.Background()

	_, err = drv.Profiles(ctx)
	assert.ErrorContains(t, err, `available_instances "not a number"`)

	names, err := drv.(interface {
		ProfileNames(context.Context) ([]string, error)
	}).ProfileNames(ctx)
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"GRID A100-4C", "GRID A100-40C"}, names)

	id := uuid.NewString()
	_, err = drv.Create(ctx, gpu.CreateRequest{Profile: "GRID A100-4C", UUID: id})
	// A plain folder makes no device of a write to create: the create got
	// that far, past the other type's count.
	assert.ErrorContains(t, err, "device missing after create")
	got, rerr := os.ReadFile(filepath.Join(root, "class", "mdev_bus", parent, "mdev_supported_types", "nvidia-471", "create"))
	require.NoError(t, rerr)
	assert.Equal(t, id+"\n", string(got), "the asked type's create was written")
}
