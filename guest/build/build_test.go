package build

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseKernelDepends(t *testing.T) {
	for _, tc := range []struct {
		name, out, pkg, version string
		wantErr                 bool
	}{
		{
			name: "bookworm",
			out: "Package: linux-image-cloud-amd64\nSource: linux-signed-amd64 (6.1.192+3)\nVersion: 6.1.192-3\n" +
				"Depends: linux-image-6.1.0-57-cloud-amd64 (= 6.1.192-3)\nDescription-en: Linux for x86-64 cloud (meta-package)\n",
			pkg: "linux-image-6.1.0-57-cloud-amd64", version: "6.1.192-3",
		},
		{
			name: "unpinned, among others, alternatives",
			out:  "Package: m\nDepends: kmod, linux-base (>= 4.3~), linux-image-cloud-amd64 | linux-image-6.12.9-cloud-amd64:amd64 (>= 6.12)\n",
			pkg:  "linux-image-6.12.9-cloud-amd64",
		},
		{
			name: "epoch in the pin",
			out:  "Depends: linux-image-6.1.0-1-cloud-amd64 (= 1:6.1.1-1)\n",
			pkg:  "linux-image-6.1.0-1-cloud-amd64", version: "1:6.1.1-1",
		},
		{name: "self dependency only", out: "Depends: linux-image-cloud-amd64\n", wantErr: true},
		{name: "no Depends", out: "Package: linux-image-cloud-amd64\nDescription: x\n", wantErr: true},
		{name: "empty", out: "", wantErr: true},
		{name: "no kernel", out: "Depends: kmod\nRecommends: linux-image-1\n", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pkg, version, err := parseKernelDepends([]byte(tc.out), DefaultMetaPackage)
			if tc.wantErr {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.pkg, pkg)
			assert.Equal(t, tc.version, version)
		})
	}
}

func TestParseField(t *testing.T) {
	v, err := parseField([]byte("Package: linux-image-6.1.0-57-cloud-amd64\nVersion: 6.1.192-3\nInstalled-Size: 1\n"), "Version")
	require.NoError(t, err)
	assert.Equal(t, "6.1.192-3", v)

	_, err = parseField([]byte("Package: x\nVersion: \n"), "Version")
	assert.Error(t, err)
	_, err = parseField(nil, "Version")
	assert.Error(t, err)
}

func TestModulePath(t *testing.T) {
	assert.Equal(t, "vmflow", modulePath([]byte("// c\nmodule vmflow\n\ngo 1.26.0\n")))
	assert.Equal(t, "x/y", modulePath([]byte("module \"x/y\"\n")))
	assert.Empty(t, modulePath(nil))
}

func TestSafeName(t *testing.T) {
	assert.Equal(t, "linux-image-6.1.0-57-cloud-amd64_1_6.1.192-3", safeName("linux-image-6.1.0-57-cloud-amd64_1:6.1.192-3"))
	assert.Equal(t, "_.._x", safeName("/../x"))
}

func TestMakeInitrd(t *testing.T) {
	kdir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(kdir, moduleFile(1, "virtio_net")), []byte("NET"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(kdir, moduleFile(0, "failover")), []byte("FAILOVER"), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(kdir, KernelFile), []byte("KERNEL"), 0o644))

	img, err := makeInitrd([]byte("INIT"), kdir)
	require.NoError(t, err)
	got := map[string]entry{}
	var order []string
	for _, e := range readNewc(t, img) {
		got[e.name] = e
		order = append(order, e.name)
	}
	assert.Equal(t, []string{"dev", "proc", "sys", "lib", "lib/modules", "dev/console", "init",
		"lib/modules/000-failover.ko", "lib/modules/001-virtio_net.ko"}, order, "modules in load order, no kernel")
	assert.Equal(t, uint32(0o100755), got["init"].mode)
	assert.Equal(t, "INIT", string(got["init"].data))
	assert.Equal(t, "FAILOVER", string(got["lib/modules/000-failover.ko"].data))
	assert.Equal(t, [2]uint32{5, 1}, [2]uint32{got["dev/console"].rmajor, got["dev/console"].rminor})

	again, err := makeInitrd([]byte("INIT"), kdir)
	require.NoError(t, err)
	assert.Equal(t, img, again, "same inputs, same bytes")

	names, err := moduleNames(kdir)
	require.NoError(t, err)
	assert.Equal(t, []string{"failover", "virtio_net"}, names)
}

func TestWriteIfChangedKeepsUnchangedFile(t *testing.T) {
	b, err := newBuilder(Options{Dir: t.TempDir(), ModuleDir: "."})
	require.NoError(t, err)
	p := filepath.Join(b.dir, "f")
	require.NoError(t, b.writeIfChanged(p, []byte("one"), 0o644))
	st1, err := os.Stat(p)
	require.NoError(t, err)

	require.NoError(t, b.writeIfChanged(p, []byte("one"), 0o644))
	st2, err := os.Stat(p)
	require.NoError(t, err)
	assert.Equal(t, st1.ModTime(), st2.ModTime())
	assert.True(t, os.SameFile(st1, st2), "unchanged content is not rewritten")

	require.NoError(t, b.writeIfChanged(p, []byte("two"), 0o755))
	data, err := os.ReadFile(p)
	require.NoError(t, err)
	assert.Equal(t, "two", string(data))
	st3, err := os.Stat(p)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o755), st3.Mode().Perm())
	entries, err := os.ReadDir(b.dir)
	require.NoError(t, err)
	assert.Len(t, entries, 1, "no temp files left")
}

func TestPruneKernelsKeepsThisVersion(t *testing.T) {
	b, err := newBuilder(Options{Dir: t.TempDir(), ModuleDir: "."})
	require.NoError(t, err)
	kernels := filepath.Join(b.dir, "kernel")
	for _, d := range []string{"linux-image-6.1.0-57-cloud-amd64_6.1.192-3", "linux-image-6.1.0-57-cloud-amd64_6.1.192-3+aaaaaaaaaaaa",
		"linux-image-6.1.0-57-cloud-amd64_6.1.192-3+bbbbbbbbbbbb", ".fetch-123"} {
		require.NoError(t, os.MkdirAll(filepath.Join(kernels, d), 0o755))
	}
	for _, f := range []string{"linux-image-6.1.0-57-cloud-amd64_6.1.192-3.deb", "linux-image-6.1.0-56-cloud-amd64_6.1.190-1.deb"} {
		require.NoError(t, os.WriteFile(filepath.Join(kernels, f), nil, 0o644))
	}
	b.pruneKernels(kernels, "linux-image-6.1.0-57-cloud-amd64_6.1.192-3.deb", "linux-image-6.1.0-57-cloud-amd64_6.1.192-3+bbbbbbbbbbbb")
	entries, err := os.ReadDir(kernels)
	require.NoError(t, err)
	var left []string
	for _, e := range entries {
		left = append(left, e.Name())
	}
	assert.Equal(t, []string{".fetch-123", "linux-image-6.1.0-57-cloud-amd64_6.1.192-3+bbbbbbbbbbbb",
		"linux-image-6.1.0-57-cloud-amd64_6.1.192-3.deb"}, left,
		"the package and the folder in use stay; older versions, layouts and module sets go; a build in progress is left alone")
}
