package build

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

// rootModules are the modules the init needs, by kernel module name: the
// ACPI power button and its event device, and the virtio network card on
// q35 (virtio_pci) and on microvm (virtio_mmio). What they depend on is read
// from the package, never listed here.
var rootModules = []string{"button", "evdev", "virtio_pci", "virtio_mmio", "virtio_net"}

// maxScans bounds the passes over the package's data: each pass after the
// first fetches dependencies that came earlier in the archive than the
// module naming them, so a dependency chain n deep costs at most n passes.
const maxScans = 8

// kmod is one kernel module taken from the package.
type kmod struct {
	name string // kernel module name: "-" in file names is "_"
	path string // path inside the package
	data []byte // uncompressed .ko
	deps []string
}

// pkgFiles is what a scan of the package's data keeps.
type pkgFiles struct {
	kernel  []byte
	builtin map[string]bool   // module names built into the kernel
	paths   map[string]string // module name → path in the package
	mods    map[string]*kmod  // the wanted modules found so far
}

// moduleName is the kernel's name of a module file (path .../virtio-rng.ko.xz
// is module virtio_rng), or "" for a path that is not a module.
func moduleName(p string) string {
	base := path.Base(p)
	for _, ext := range []string{".ko", ".ko.xz", ".ko.zst"} {
		if n, ok := strings.CutSuffix(base, ext); ok && n != "" {
			return strings.ReplaceAll(n, "-", "_")
		}
	}
	return ""
}

// modulesRel returns the path below lib/modules/<version>/ (also under a
// merged /usr), or false for a path outside the module tree.
func modulesRel(name string) (string, bool) {
	rel := strings.TrimPrefix(name, "usr/")
	rel, ok := strings.CutPrefix(rel, "lib/modules/")
	if !ok {
		return "", false
	}
	_, rel, ok = strings.Cut(rel, "/") // drop the kernel version
	return rel, ok && rel != ""
}

// modinfoDepends reads the depends= field of a module's .modinfo section:
// the modules it needs loaded first, written by modpost from the symbols it
// imports. Debian's package ships no modules.dep (depmod writes it when the
// package is installed), so this is the dependency data the package has.
func modinfoDepends(ko []byte) ([]string, error) {
	f, err := elf.NewFile(bytes.NewReader(ko))
	if err != nil {
		return nil, fmt.Errorf("not an ELF module: %w", err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, errors.New("no .modinfo section")
	}
	info, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("read .modinfo: %w", err)
	}
	var deps []string
	for _, field := range bytes.Split(info, []byte{0}) {
		v, ok := bytes.CutPrefix(field, []byte("depends="))
		if !ok {
			continue
		}
		for _, d := range strings.Split(string(v), ",") {
			if d = strings.TrimSpace(d); d != "" {
				deps = append(deps, strings.ReplaceAll(d, "-", "_"))
			}
		}
	}
	return deps, nil
}

// parseBuiltin reads modules.builtin (one path per line, e.g.
// kernel/net/unix/unix.ko) into module names.
func parseBuiltin(data []byte) map[string]bool {
	out := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		if n := moduleName(strings.TrimSpace(sc.Text())); n != "" {
			out[n] = true
		}
	}
	return out
}

// scanPackage reads one pass of a kernel package's data tar into files: the
// kernel, modules.builtin, the path of every module, and the data of every
// module in want, to which each kept module's dependencies are added as it
// is read (so a dependency later in the archive is kept in the same pass).
func scanPackage(ctx context.Context, r io.Reader, files *pkgFiles, want map[string]bool) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read package data: %w", err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		name := strings.TrimPrefix(path.Clean("/"+h.Name), "/")
		if strings.HasPrefix(name, "boot/vmlinuz-") {
			if files.kernel, err = io.ReadAll(tr); err != nil {
				return fmt.Errorf("read %s: %w", name, err)
			}
			continue
		}
		rel, ok := modulesRel(name)
		if !ok {
			continue
		}
		if rel == "modules.builtin" {
			data, err := io.ReadAll(tr)
			if err != nil {
				return fmt.Errorf("read %s: %w", name, err)
			}
			files.builtin = parseBuiltin(data)
			continue
		}
		mod := moduleName(rel)
		if mod == "" {
			continue
		}
		files.paths[mod] = name
		if !want[mod] || files.mods[mod] != nil {
			continue
		}
		raw, err := io.ReadAll(tr)
		if err != nil {
			return fmt.Errorf("read %s: %w", name, err)
		}
		data, err := decompressModule(ctx, name, raw)
		if err != nil {
			return err
		}
		deps, err := modinfoDepends(data)
		if err != nil {
			return fmt.Errorf("module %s: %w", name, err)
		}
		files.mods[mod] = &kmod{name: mod, path: name, data: data, deps: deps}
		for _, d := range deps {
			want[d] = true
		}
	}
}

// resolveModules scans the package (open gives a fresh reader of its data
// tar for each pass) until it holds every module of roots and their
// dependencies, and returns the kernel and the modules in load order:
// every module after the modules it depends on. A root built into the
// kernel is skipped; a module neither built in nor in the package is an
// error.
func resolveModules(ctx context.Context, roots []string, open func() (io.ReadCloser, error)) ([]byte, []*kmod, error) {
	files := &pkgFiles{paths: map[string]string{}, mods: map[string]*kmod{}}
	want := map[string]bool{}
	for _, r := range roots {
		want[r] = true
	}
	for pass := 0; ; pass++ {
		if pass == maxScans {
			return nil, nil, fmt.Errorf("module dependencies not resolved after %d passes over the package", maxScans)
		}
		rc, err := open()
		if err != nil {
			return nil, nil, err
		}
		err = scanPackage(ctx, rc, files, want)
		if cerr := rc.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return nil, nil, err
		}
		if pass == 0 && files.kernel == nil {
			return nil, nil, errors.New("no boot/vmlinuz-* in the package")
		}
		missing := false
		for m := range want {
			if files.mods[m] != nil || files.builtin[m] {
				continue
			}
			if _, ok := files.paths[m]; !ok {
				return nil, nil, fmt.Errorf("module %s is neither in the package nor in its modules.builtin", m)
			}
			missing = true // seen before it was wanted: the next pass keeps it
		}
		if !missing {
			break
		}
	}
	order, err := loadOrder(roots, files.mods)
	if err != nil {
		return nil, nil, err
	}
	return files.kernel, order, nil
}

// loadOrder lists the modules reachable from roots, each after its
// dependencies (depth first, in the order roots and depends= name them).
// A module missing from mods is built in. A dependency cycle is an error:
// the kernel could not load such modules either.
func loadOrder(roots []string, mods map[string]*kmod) ([]*kmod, error) {
	const (
		visiting = 1
		done     = 2
	)
	state := map[string]int{}
	var order []*kmod
	var visit func(name string) error
	visit = func(name string) error {
		m := mods[name]
		if m == nil {
			return nil
		}
		switch state[name] {
		case done:
			return nil
		case visiting:
			return fmt.Errorf("module dependency cycle through %s", name)
		}
		state[name] = visiting
		for _, d := range m.deps {
			if err := visit(d); err != nil {
				return err
			}
		}
		state[name] = done
		order = append(order, m)
		return nil
	}
	for _, r := range roots {
		if err := visit(r); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// moduleFile is the file name of the i-th module in load order inside the
// initramfs's /lib/modules: the init loads them in name order, so the
// number prefix makes that the dependency order.
func moduleFile(i int, name string) string {
	return fmt.Sprintf("%03d-%s.ko", i, name)
}

// moduleFiles lists the module files of a kernel folder in load order.
func moduleFiles(kdir string) ([]string, error) {
	files, err := filepath.Glob(filepath.Join(kdir, "*.ko"))
	if err != nil {
		return nil, fmt.Errorf("list modules: %w", err)
	}
	sort.Strings(files)
	return files, nil
}

// moduleNames lists the module names of a kernel folder in load order.
func moduleNames(kdir string) ([]string, error) {
	files, err := moduleFiles(kdir)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(files))
	for i, f := range files {
		_, n, _ := strings.Cut(strings.TrimSuffix(filepath.Base(f), ".ko"), "-")
		names[i] = n
	}
	return names, nil
}
