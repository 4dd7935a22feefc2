package build

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeModule is a minimal relocatable ELF holding only a .modinfo section,
// which is all modinfoDepends reads of a real .ko.
func fakeModule(t *testing.T, modinfo ...string) []byte {
	t.Helper()
	info := []byte(strings.Join(modinfo, "\x00") + "\x00")
	shstr := []byte("\x00.modinfo\x00.shstrtab\x00")
	const ehsize, shentsize = 64, 64
	infoOff := uint64(ehsize)
	strOff := infoOff + uint64(len(info))
	shOff := (strOff + uint64(len(shstr)) + 7) &^ 7
	var buf bytes.Buffer
	hdr := elf.Header64{
		Type: uint16(elf.ET_REL), Machine: uint16(elf.EM_X86_64), Version: uint32(elf.EV_CURRENT),
		Shoff: shOff, Ehsize: ehsize, Shentsize: shentsize, Shnum: 3, Shstrndx: 2,
	}
	copy(hdr.Ident[:], elf.ELFMAG)
	hdr.Ident[elf.EI_CLASS] = byte(elf.ELFCLASS64)
	hdr.Ident[elf.EI_DATA] = byte(elf.ELFDATA2LSB)
	hdr.Ident[elf.EI_VERSION] = byte(elf.EV_CURRENT)
	require.NoError(t, binary.Write(&buf, binary.LittleEndian, hdr))
	buf.Write(info)
	buf.Write(shstr)
	buf.Write(make([]byte, int(shOff)-buf.Len()))
	for _, sh := range []elf.Section64{
		{},
		{Name: 1, Type: uint32(elf.SHT_PROGBITS), Flags: uint64(elf.SHF_ALLOC), Off: infoOff, Size: uint64(len(info)), Addralign: 1},
		{Name: 10, Type: uint32(elf.SHT_STRTAB), Off: strOff, Size: uint64(len(shstr)), Addralign: 1},
	} {
		require.NoError(t, binary.Write(&buf, binary.LittleEndian, sh))
	}
	return buf.Bytes()
}

func TestModinfoDepends(t *testing.T) {
	deps, err := modinfoDepends(fakeModule(t, "license=GPL", "depends=virtio_ring,virtio,net-failover", "name=virtio_net"))
	require.NoError(t, err)
	assert.Equal(t, []string{"virtio_ring", "virtio", "net_failover"}, deps)

	deps, err = modinfoDepends(fakeModule(t, "depends=", "name=failover"))
	require.NoError(t, err)
	assert.Empty(t, deps)

	_, err = modinfoDepends([]byte("not an ELF file at all"))
	assert.Error(t, err)
	_, err = modinfoDepends(nil)
	assert.Error(t, err)
}

func TestModuleName(t *testing.T) {
	for path, want := range map[string]string{
		"lib/modules/6.1/kernel/drivers/net/virtio_net.ko":          "virtio_net",
		"usr/lib/modules/6.12/kernel/drivers/char/virtio-rng.ko.xz": "virtio_rng",
		"kernel/net/core/failover.ko.zst":                           "failover",
		"kernel/drivers/acpi/button.ko.gz":                          "",
		"modules.builtin":                                           "",
		".ko":                                                       "",
	} {
		assert.Equal(t, want, moduleName(path), path)
	}
}

func TestModulesRel(t *testing.T) {
	for _, tc := range []struct{ path, rel string }{
		{"lib/modules/6.1.0-57-cloud-amd64/kernel/drivers/acpi/button.ko", "kernel/drivers/acpi/button.ko"},
		{"usr/lib/modules/6.12.9-cloud-amd64/modules.builtin", "modules.builtin"},
		{"lib/modules/6.1/", ""},
		{"lib/modules/kernel", ""},
		{"boot/vmlinuz-6.1", ""},
	} {
		rel, ok := modulesRel(tc.path)
		assert.Equal(t, tc.rel != "", ok, tc.path)
		assert.Equal(t, tc.rel, rel, tc.path)
	}
}

func TestParseBuiltin(t *testing.T) {
	got := parseBuiltin([]byte("kernel/net/unix/unix.ko\nkernel/drivers/char/hw_random/virtio-rng.ko\n\nnot-a-module\n"))
	assert.Equal(t, map[string]bool{"unix": true, "virtio_rng": true}, got)
}

type tarEntry struct {
	name string
	data []byte
}

// packageTar is a kernel package's data tar holding entries in this order.
func packageTar(t *testing.T, entries ...tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "./boot/", Typeflag: tar.TypeDir, Mode: 0o755}))
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "./lib/modules/6.1/kernel/link.ko",
		Typeflag: tar.TypeSymlink, Linkname: "virtio.ko"}))
	for _, e := range entries {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: e.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(e.data))}))
		_, err := tw.Write(e.data)
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}

// opener serves data afresh for each pass and counts the passes.
func opener(data []byte, passes *int) func() (io.ReadCloser, error) {
	return func() (io.ReadCloser, error) {
		*passes++
		return io.NopCloser(bytes.NewReader(data)), nil
	}
}

func names(mods []*kmod) []string {
	out := make([]string, len(mods))
	for i, m := range mods {
		out[i] = m.name
	}
	return out
}

func TestResolveModules(t *testing.T) {
	const mods = "./lib/modules/6.1.0-57-cloud-amd64/"
	mod := func(name string, modinfo ...string) tarEntry {
		return tarEntry{mods + name, fakeModule(t, modinfo...)}
	}
	// The layout of the Debian 6.1 cloud package: failover comes before
	// net_failover in the archive, which names it, so it takes a second pass.
	pkg := packageTar(t,
		tarEntry{"./boot/vmlinuz-6.1.0-57-cloud-amd64", []byte("KERNEL")},
		tarEntry{"./boot/config-6.1.0-57-cloud-amd64", []byte("CONFIG_VIRTIO=m\n")},
		mod("kernel/net/core/failover.ko", "depends=", "name=failover"),
		mod("kernel/drivers/virtio/virtio_ring.ko", "depends=", "name=virtio_ring"),
		mod("kernel/drivers/virtio/virtio.ko", "depends=virtio_ring", "name=virtio"),
		mod("kernel/drivers/virtio/virtio_pci_modern_dev.ko", "depends=", "name=virtio_pci_modern_dev"),
		mod("kernel/drivers/virtio/virtio_pci.ko", "depends=virtio_ring,virtio_pci_modern_dev,virtio", "name=virtio_pci"),
		mod("kernel/drivers/net/virtio_net.ko", "depends=virtio_ring,virtio,net_failover", "name=virtio_net"),
		mod("kernel/drivers/net/net_failover.ko", "depends=failover", "name=net_failover"),
		mod("kernel/drivers/block/virtio_blk.ko", "depends=virtio,virtio_ring", "name=virtio_blk"),
		tarEntry{mods + "modules.builtin", []byte("kernel/drivers/input/evdev.ko\n")},
	)
	var passes int
	kernel, got, err := resolveModules(context.Background(), []string{"evdev", "virtio_pci", "virtio_net"}, opener(pkg, &passes))
	require.NoError(t, err)
	assert.Equal(t, "KERNEL", string(kernel))
	assert.Equal(t, []string{"virtio_ring", "virtio_pci_modern_dev", "virtio", "virtio_pci", "failover", "net_failover", "virtio_net"},
		names(got), "each module after its dependencies; evdev built in; virtio_blk not needed")
	assert.Equal(t, 2, passes)
	assert.Equal(t, mods[2:]+"kernel/net/core/failover.ko", got[4].path)

	t.Run("one pass when dependencies come later", func(t *testing.T) {
		passes = 0
		later := packageTar(t,
			tarEntry{"./boot/vmlinuz-6.1", []byte("K")},
			mod("kernel/drivers/net/net_failover.ko", "depends=failover", "name=net_failover"),
			mod("kernel/net/core/failover.ko", "depends=", "name=failover"))
		_, got, err := resolveModules(context.Background(), []string{"net_failover"}, opener(later, &passes))
		require.NoError(t, err)
		assert.Equal(t, []string{"failover", "net_failover"}, names(got))
		assert.Equal(t, 1, passes)
	})
	for _, tc := range []struct {
		name  string
		roots []string
		pkg   []byte
		want  string
	}{
		{"a root nowhere", []string{"virtio_mmio"}, pkg, "virtio_mmio is neither in the package nor"},
		{"a dependency nowhere", []string{"virtio_net"}, packageTar(t,
			tarEntry{"./boot/vmlinuz-6.1", []byte("K")},
			mod("kernel/drivers/net/virtio_net.ko", "depends=net_failover", "name=virtio_net")),
			"net_failover is neither in the package nor"},
		{"no kernel", []string{"failover"}, packageTar(t, mod("kernel/net/core/failover.ko", "depends=")), "no boot/vmlinuz"},
		{"not a module", []string{"failover"}, packageTar(t,
			tarEntry{"./boot/vmlinuz-6.1", []byte("K")},
			tarEntry{mods + "kernel/net/core/failover.ko", []byte("garbage")}), "not an ELF module"},
		{"a cycle", []string{"a"}, packageTar(t,
			tarEntry{"./boot/vmlinuz-6.1", []byte("K")},
			mod("kernel/a.ko", "depends=b"), mod("kernel/b.ko", "depends=a")), "cycle"},
		{"not a tar", []string{"a"}, []byte(strings.Repeat("x", 1024)), "read package data"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var n int
			_, _, err := resolveModules(context.Background(), tc.roots, opener(tc.pkg, &n))
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
	t.Run("open fails", func(t *testing.T) {
		boom := errors.New("boom")
		_, _, err := resolveModules(context.Background(), []string{"a"}, func() (io.ReadCloser, error) { return nil, boom })
		assert.ErrorIs(t, err, boom)
	})
}

func TestModuleSetID(t *testing.T) {
	a := moduleSetID([]string{"button", "evdev"})
	assert.Equal(t, a, moduleSetID([]string{"button", "evdev"}))
	assert.NotEqual(t, a, moduleSetID([]string{"button", "evdev", "virtio_net"}))
	assert.NotEqual(t, a, moduleSetID([]string{"buttonevdev"}))
	assert.Len(t, a, 12)
}

func TestModuleFileSortsInLoadOrder(t *testing.T) {
	assert.Less(t, moduleFile(99, "zz"), moduleFile(100, "aa"))
	assert.Equal(t, "003-virtio_net.ko", moduleFile(3, "virtio_net"))
}

// fakeArchive puts an apt-get on PATH that "downloads" a kernel package
// built here with dpkg-deb (version version, the modules given) and counts
// its downloads in the returned file.
func fakeArchive(t *testing.T, version string, modules map[string][]byte) (count string) {
	t.Helper()
	if _, err := exec.LookPath("dpkg-deb"); err != nil {
		t.Skipf("needs dpkg-deb: %v", err)
	}
	root := t.TempDir()
	pkg := filepath.Join(root, "pkg")
	files := map[string][]byte{
		"DEBIAN/control": []byte("Package: linux-image-test\nVersion: " + version +
			"\nArchitecture: amd64\nMaintainer: t <t@example.org>\nDescription: test kernel\n"),
		"boot/vmlinuz-6.1.0-test":                   []byte("KERNEL " + version),
		"lib/modules/6.1.0-test/modules.builtin":    []byte("kernel/drivers/input/evdev.ko\n"),
		"lib/modules/6.1.0-test/kernel/other/x.txt": []byte("not a module"),
	}
	for rel, data := range modules {
		files["lib/modules/6.1.0-test/"+rel] = data
	}
	for rel, data := range files {
		p := filepath.Join(pkg, rel)
		require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
		require.NoError(t, os.WriteFile(p, data, 0o644))
	}
	deb := filepath.Join(root, "linux-image-test_"+version+"_amd64.deb")
	out, err := exec.Command("dpkg-deb", "--root-owner-group", "--build", pkg, deb).CombinedOutput()
	require.NoError(t, err, "%s", out)

	bin := filepath.Join(root, "bin")
	require.NoError(t, os.Mkdir(bin, 0o755))
	count = filepath.Join(root, "downloads")
	script := "#!/bin/sh\necho \"$*\" >> '" + count + "'\ncp '" + deb + "' .\n"
	require.NoError(t, os.WriteFile(filepath.Join(bin, "apt-get"), []byte(script), 0o755))
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	return count
}

func downloads(t *testing.T, count string) int {
	t.Helper()
	data, err := os.ReadFile(count)
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	require.NoError(t, err)
	return strings.Count(string(data), "\n")
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

// TestFetchKernelDownloadsOncePerVersion: the package is fetched once per
// kernel version; the same version with another module set is unpacked
// again from the kept package, not downloaded again; a new version is.
func TestFetchKernelDownloadsOncePerVersion(t *testing.T) {
	mods := map[string][]byte{
		"kernel/net/core/failover.ko":        fakeModule(t, "depends=", "name=failover"),
		"kernel/drivers/net/net_failover.ko": fakeModule(t, "depends=failover", "name=net_failover"),
		"kernel/drivers/net/virtio_net.ko":   fakeModule(t, "depends=net_failover", "name=virtio_net"),
		"kernel/drivers/acpi/button.ko":      fakeModule(t, "depends=", "name=button"),
	}
	count := fakeArchive(t, "1.0", mods)
	b, err := newBuilder(Options{Dir: t.TempDir(), ModuleDir: "."})
	require.NoError(t, err)
	ctx := context.Background()
	kernels := filepath.Join(b.dir, "kernel")

	b.roots = []string{"evdev", "virtio_net"}
	kdir, err := b.fetchKernel(ctx, "linux-image-test", "1.0")
	require.NoError(t, err)
	assert.Equal(t, 1, downloads(t, count))
	assert.Equal(t, []string{"000-failover.ko", "001-net_failover.ko", "002-virtio_net.ko", KernelFile}, dirNames(t, kdir),
		"evdev is built in; the rest in load order")
	kernel, err := os.ReadFile(filepath.Join(kdir, KernelFile))
	require.NoError(t, err)
	assert.Equal(t, "KERNEL 1.0", string(kernel))

	again, err := b.fetchKernel(ctx, "linux-image-test", "1.0")
	require.NoError(t, err)
	assert.Equal(t, kdir, again)
	assert.Equal(t, 1, downloads(t, count), "cached: no second download")

	b.roots = []string{"button", "virtio_net"}
	other, err := b.fetchKernel(ctx, "linux-image-test", "1.0")
	require.NoError(t, err)
	assert.NotEqual(t, kdir, other, "another module set has a folder of its own")
	assert.Equal(t, 1, downloads(t, count), "another module set unpacks the kept package")
	assert.Equal(t, []string{"000-button.ko", "001-failover.ko", "002-net_failover.ko", "003-virtio_net.ko", KernelFile}, dirNames(t, other))
	assert.Equal(t, []string{filepath.Base(other), "linux-image-test_1.0.deb"}, dirNames(t, kernels), "the old set's folder is gone")

	count = fakeArchive(t, "1.1", mods)
	newer, err := b.fetchKernel(ctx, "linux-image-test", "1.1")
	require.NoError(t, err)
	assert.Equal(t, 1, downloads(t, count), "a new version is downloaded")
	assert.Equal(t, []string{filepath.Base(newer), "linux-image-test_1.1.deb"}, dirNames(t, kernels), "the old version is gone")

	b.roots = []string{"virtio_mmio"}
	_, err = b.fetchKernel(ctx, "linux-image-test", "1.1")
	assert.ErrorContains(t, err, "virtio_mmio is neither in the package nor")
	assert.Equal(t, []string{filepath.Base(newer), "linux-image-test_1.1.deb"}, dirNames(t, kernels), "a failed unpack leaves nothing behind")
}
