package build

import (
	"archive/tar"
	"bytes"
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

func TestMatchModule(t *testing.T) {
	for _, tc := range []struct {
		path string
		want string // module name, "" for no match
	}{
		{"lib/modules/6.1.0-57-cloud-amd64/kernel/drivers/acpi/button.ko", "button.ko"},
		{"lib/modules/6.1.0-57-cloud-amd64/kernel/drivers/input/evdev.ko", "evdev.ko"},
		{"usr/lib/modules/6.12.9-cloud-amd64/kernel/drivers/input/evdev.ko.xz", "evdev.ko"},
		{"lib/modules/6.12/kernel/drivers/acpi/button.ko.zst", "button.ko"},
		{"lib/modules/6.1/kernel/drivers/acpi/button.ko.gz", ""},
		{"lib/modules/6.1/kernel/drivers/platform/x86/button.ko", ""},
		{"lib/modules/kernel/drivers/acpi/button.ko", ""},
		{"boot/vmlinuz-6.1", ""},
		{"", ""},
	} {
		t.Run(tc.path, func(t *testing.T) {
			m, ok := matchModule(tc.path)
			assert.Equal(t, tc.want != "", ok)
			assert.Equal(t, tc.want, m.name)
		})
	}
}

func TestParseBuiltins(t *testing.T) {
	got := parseBuiltins([]byte("CONFIG_ACPI_BUTTON=m\nCONFIG_INPUT_EVDEV=y\n# CONFIG_FOO is not set\nCONFIG_BAR=\"y\"\n"))
	assert.Equal(t, map[string]bool{"CONFIG_INPUT_EVDEV": true}, got)
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

// debData builds a kernel package's data tar with the given files.
func debData(t *testing.T, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "./boot/", Typeflag: tar.TypeDir, Mode: 0o755}))
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "./lib/modules/6.1/kernel/drivers/acpi/link.ko",
		Typeflag: tar.TypeSymlink, Linkname: "button.ko"}))
	for name, data := range files {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(data))}))
		_, err := tw.Write([]byte(data))
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}

func TestPickKernelFiles(t *testing.T) {
	files, err := pickKernelFiles(bytes.NewReader(debData(t, map[string]string{
		"./boot/vmlinuz-6.1.0-57-cloud-amd64":                               "KERNEL",
		"./boot/config-6.1.0-57-cloud-amd64":                                "CONFIG_INPUT_EVDEV=m\n",
		"./boot/System.map-6.1.0-57-cloud-amd64":                            "map",
		"./lib/modules/6.1.0-57-cloud-amd64/kernel/drivers/acpi/button.ko":  "BUTTON",
		"./lib/modules/6.1.0-57-cloud-amd64/kernel/drivers/input/evdev.ko":  "EVDEV",
		"./lib/modules/6.1.0-57-cloud-amd64/kernel/drivers/input/joydev.ko": "JOY",
	})))
	require.NoError(t, err)
	assert.Equal(t, "KERNEL", string(files.kernel))
	assert.Equal(t, "CONFIG_INPUT_EVDEV=m\n", string(files.config))
	require.Len(t, files.modules, 2)
	assert.Equal(t, "BUTTON", string(files.modules["button.ko"].data))
	assert.Equal(t, "EVDEV", string(files.modules["evdev.ko"].data))

	_, err = pickKernelFiles(bytes.NewReader([]byte("not a tar archive, but long enough to need a header block............")))
	assert.Error(t, err)
}

func TestMakeInitrd(t *testing.T) {
	kdir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(kdir, "button.ko"), []byte("BUTTON"), 0o644))
	// evdev.ko absent: a kernel with evdev built in.

	img, err := makeInitrd([]byte("INIT"), kdir)
	require.NoError(t, err)
	got := map[string]entry{}
	var order []string
	for _, e := range readNewc(t, img) {
		got[e.name] = e
		order = append(order, e.name)
	}
	assert.Equal(t, []string{"dev", "proc", "sys", "lib", "lib/modules", "dev/console", "init", "lib/modules/button.ko"}, order)
	assert.Equal(t, uint32(0o100755), got["init"].mode)
	assert.Equal(t, "INIT", string(got["init"].data))
	assert.Equal(t, "BUTTON", string(got["lib/modules/button.ko"].data))
	assert.Equal(t, [2]uint32{5, 1}, [2]uint32{got["dev/console"].rmajor, got["dev/console"].rminor})

	again, err := makeInitrd([]byte("INIT"), kdir)
	require.NoError(t, err)
	assert.Equal(t, img, again, "same inputs, same bytes")
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
