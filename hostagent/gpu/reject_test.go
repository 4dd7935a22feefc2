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

// Names that reach a sysfs path come from records on disk (a claim being
// finished or released after a crash). Each driver refuses a name that
// could leave the sysfs root or name another file, before any write, so a
// corrupted or forged record cannot make the agent write "1" or "0" to an
// arbitrary file.
func TestSysfsNamesFromRecordsAreChecked(t *testing.T) {
	root := t.TempDir()
	// A file a traversal would reach: it must stay untouched.
	victim := filepath.Join(root, "victim")
	require.NoError(t, os.WriteFile(victim, []byte("keep"), 0o600))
	cfg := Config{SysfsRoot: filepath.Join(root, "sys"), StateDir: root}
	md, vd := NewMdev(cfg), NewVendor(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const u = "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab"

	for _, id := range []string{"../../victim", "", "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab/../../..", "{" + u + "}", "urn:uuid:" + u} {
		assert.Error(t, md.Release(ctx, Device{ID: id}), "mdev release %q", id)
	}
	for _, id := range []string{"../../victim", "", "0000:00:01.0/../..", "0000:00:01.0\x00", "00:01.0"} {
		assert.ErrorIs(t, vd.Release(ctx, Device{ID: id}), ErrInvalid, "vendor release %q", id)
	}
	for _, at := range []Placement{{Parent: "..", TypeID: "nvidia-1"}, {Parent: "0000:00:01.0", TypeID: "../../victim"},
		{Parent: "", TypeID: "t"}, {Parent: "p/q", TypeID: "t"}} {
		_, err := md.Create(ctx, CreateRequest{UUID: u, At: &at})
		assert.ErrorIs(t, err, ErrInvalid, "mdev create at %+v", at)
	}
	for _, at := range []Placement{{VF: "../../victim", TypeID: "557"}, {VF: "", TypeID: "557"}} {
		_, err := vd.Create(ctx, CreateRequest{UUID: u, At: &at})
		assert.ErrorIs(t, err, ErrInvalid, "vendor create at %+v", at)
	}
	for _, id := range []string{"../x", "not-a-uuid", ""} {
		_, err := md.Create(ctx, CreateRequest{UUID: id})
		assert.Error(t, err, "mdev create with uuid %q", id)
	}
	b, err := os.ReadFile(victim)
	require.NoError(t, err)
	assert.Equal(t, "keep", string(b))
}
