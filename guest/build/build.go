// Package build makes vmflow's small real guest (see package vmflow/guest):
// a kernel taken from Debian's linux-image-cloud-amd64 and an initramfs
// written from Go holding the static init of vmflow/guest/init and the
// kernel modules it loads.
//
// Only Debian's own tools fetch anything: apt-cache resolves the versioned
// kernel package, apt-get download fetches it and dpkg-deb unpacks the few
// files needed. Outputs go into a cache folder and are rewritten only when
// their content changes; the download happens once per kernel version.
package build

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"vmflow/internal/fsx"
)

// DefaultMetaPackage is Debian's meta package that depends on the current
// cloud kernel; its versioned dependency changes with Debian updates.
const DefaultMetaPackage = "linux-image-cloud-amd64"

// DirEnv overrides the default cache folder (see DefaultDir).
const DirEnv = "VMFLOW_GUEST_DIR"

// InitPackage is the Go package built as the initramfs's /init.
const InitPackage = "vmflow/guest/init"

// Output file names inside the cache folder.
const (
	KernelFile = "vmlinuz"
	InitrdFile = "initrd.img"
	InitFile   = "init"
)

// Options configure Build. The zero value builds into DefaultDir.
type Options struct {
	// Dir is the cache folder; "" means DefaultDir().
	Dir string
	// MetaPackage is resolved to a versioned kernel package with
	// its Depends field (apt-cache); "" means DefaultMetaPackage.
	MetaPackage string
	// ModuleDir is a folder inside the vmflow module, where `go build` of
	// the init runs; "" means the module root found from the working
	// directory.
	ModuleDir string
	// GoCmd is the go tool; "" means "go" from PATH.
	GoCmd string
	// Log receives progress; nil discards it.
	Log *slog.Logger
}

// Artifacts are the absolute paths of a built guest and what it came from.
type Artifacts struct {
	Dir    string // the cache folder
	Kernel string // Dir/vmlinuz: pass to QEMU's -kernel
	Initrd string // Dir/initrd.img: pass to QEMU's -initrd (uncompressed newc cpio)
	Init   string // Dir/init: the static init binary inside the initrd

	KernelPackage string // e.g. linux-image-6.1.0-57-cloud-amd64
	KernelVersion string // the Debian package version, e.g. 6.1.192-3
	// Modules are the kernel modules in the initrd, in the order the init
	// loads them (every module after those it depends on).
	Modules []string
}

// DefaultDir is $VMFLOW_GUEST_DIR if set, else .cache/guest at the root of
// the vmflow module containing the working directory (what `make guest`
// uses), so tests in any package share one download.
func DefaultDir() (string, error) {
	if d := os.Getenv(DirEnv); d != "" {
		return filepath.Abs(d)
	}
	root, err := moduleRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, ".cache", "guest"), nil
}

// moduleRoot walks up from the working directory to the go.mod of module vmflow.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("find module root: %w", err)
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && modulePath(data) == "vmflow" {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("find module root: no go.mod of module vmflow above the working directory")
		}
		dir = parent
	}
}

func modulePath(gomod []byte) string {
	for _, line := range strings.Split(string(gomod), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`)
		}
	}
	return ""
}

// Build makes (or reuses) the guest in opts.Dir and returns its paths. It
// holds a lock on the folder, so concurrent builds (parallel test packages)
// wait for each other instead of racing.
func Build(ctx context.Context, opts Options) (Artifacts, error) {
	b, err := newBuilder(opts)
	if err != nil {
		return Artifacts{}, err
	}
	if err := os.MkdirAll(b.dir, 0o755); err != nil {
		return Artifacts{}, fmt.Errorf("guest build: %w", err)
	}
	// Two builds of one cache (make guest beside a test) take turns.
	lock, err := fsx.LockFile(ctx, filepath.Join(b.dir, ".lock"))
	if err != nil {
		return Artifacts{}, fmt.Errorf("guest build: %w", err)
	}
	defer lock.Release(false)
	return b.build(ctx)
}

type builder struct {
	dir, meta, moduleDir, goCmd string
	roots                       []string // the modules the init needs: rootModules
	log                         *slog.Logger
}

func newBuilder(opts Options) (*builder, error) {
	b := &builder{dir: opts.Dir, meta: opts.MetaPackage, moduleDir: opts.ModuleDir, goCmd: opts.GoCmd,
		roots: rootModules, log: opts.Log}
	var err error
	if b.dir == "" {
		if b.dir, err = DefaultDir(); err != nil {
			return nil, fmt.Errorf("guest build: %w", err)
		}
	}
	if b.dir, err = filepath.Abs(b.dir); err != nil {
		return nil, fmt.Errorf("guest build: %w", err)
	}
	if b.meta == "" {
		b.meta = DefaultMetaPackage
	}
	if b.moduleDir == "" {
		if b.moduleDir, err = moduleRoot(); err != nil {
			return nil, fmt.Errorf("guest build: %w", err)
		}
	}
	if b.goCmd == "" {
		b.goCmd = "go"
	}
	if b.log == nil {
		b.log = slog.New(slog.DiscardHandler)
	}
	return b, nil
}

func (b *builder) build(ctx context.Context) (Artifacts, error) {
	pkg, version, err := b.resolveKernel(ctx)
	if err != nil {
		return Artifacts{}, err
	}
	kdir, err := b.fetchKernel(ctx, pkg, version)
	if err != nil {
		return Artifacts{}, err
	}
	a := Artifacts{
		Dir:           b.dir,
		Kernel:        filepath.Join(b.dir, KernelFile),
		Initrd:        filepath.Join(b.dir, InitrdFile),
		Init:          filepath.Join(b.dir, InitFile),
		KernelPackage: pkg,
		KernelVersion: version,
	}
	if a.Modules, err = moduleNames(kdir); err != nil {
		return Artifacts{}, fmt.Errorf("guest build: %w", err)
	}
	kernel, err := os.ReadFile(filepath.Join(kdir, KernelFile))
	if err != nil {
		return Artifacts{}, fmt.Errorf("guest build: %w", err)
	}
	if err := b.writeIfChanged(a.Kernel, kernel, 0o644); err != nil {
		return Artifacts{}, err
	}
	initBin, err := b.buildInit(ctx)
	if err != nil {
		return Artifacts{}, err
	}
	if err := b.writeIfChanged(a.Init, initBin, 0o755); err != nil {
		return Artifacts{}, err
	}
	initrd, err := makeInitrd(initBin, kdir)
	if err != nil {
		return Artifacts{}, fmt.Errorf("guest build: %w", err)
	}
	if err := b.writeIfChanged(a.Initrd, initrd, 0o644); err != nil {
		return Artifacts{}, err
	}
	return a, nil
}

// resolveKernel finds the versioned kernel package behind the meta package
// and its version. apt-cache reads the local package lists; when they know
// nothing (a fresh machine), one `apt-get update` fills them.
func (b *builder) resolveKernel(ctx context.Context) (pkg, version string, err error) {
	pkg, version, err = b.lookupKernel(ctx)
	if err == nil {
		return pkg, version, nil
	}
	b.log.Info("kernel package not resolved, running apt-get update", "error", err)
	if _, uerr := run(ctx, "", nil, "apt-get", "update", "-qq"); uerr != nil {
		return "", "", fmt.Errorf("guest build: resolve %s: %w (apt-get update: %w)", b.meta, err, uerr)
	}
	pkg, version, err = b.lookupKernel(ctx)
	if err != nil {
		return "", "", fmt.Errorf("guest build: resolve %s: %w", b.meta, err)
	}
	return pkg, version, nil
}

// lookupKernel reads the meta package's candidate record (the same
// dependency `apt-cache depends` lists, plus its version pin): each
// apt-cache run costs ~0.7 s here, so one run is the common case, and a
// second asks for the version only when the dependency has no "(= V)".
func (b *builder) lookupKernel(ctx context.Context) (pkg, version string, err error) {
	out, err := run(ctx, "", nil, "apt-cache", "show", "--no-all-versions", b.meta)
	if err != nil {
		return "", "", err
	}
	if pkg, version, err = parseKernelDepends(out, b.meta); err != nil {
		return "", "", err
	}
	if version == "" {
		out, err = run(ctx, "", nil, "apt-cache", "show", "--no-all-versions", pkg)
		if err != nil {
			return "", "", err
		}
		if version, err = parseField(out, "Version"); err != nil {
			return "", "", fmt.Errorf("%s: %w", pkg, err)
		}
	}
	b.log.Info("kernel package resolved", "meta", b.meta, "package", pkg, "version", version)
	return pkg, version, nil
}

// parseKernelDepends picks the versioned kernel image out of the Depends
// field of `apt-cache show META` ("linux-image-6.1.0-57-cloud-amd64 (=
// 6.1.192-3)"): the first linux-image-* alternative that is not META. The
// version is "" when the dependency does not pin one.
func parseKernelDepends(out []byte, meta string) (pkg, version string, err error) {
	deps, err := parseField(out, "Depends")
	if err != nil {
		return "", "", fmt.Errorf("%s: %w", meta, err)
	}
	for _, dep := range strings.Split(deps, ",") {
		for _, alt := range strings.Split(dep, "|") {
			name, constraint, _ := strings.Cut(strings.TrimSpace(alt), " ")
			name, _, _ = strings.Cut(name, ":") // an architecture qualifier
			if !strings.HasPrefix(name, "linux-image-") || name == meta {
				continue
			}
			constraint = strings.TrimSpace(constraint)
			if v, ok := strings.CutPrefix(constraint, "(="); ok && strings.HasSuffix(v, ")") {
				version = strings.TrimSpace(strings.TrimSuffix(v, ")"))
			}
			return name, version, nil
		}
	}
	return "", "", fmt.Errorf("no linux-image-* dependency of %s in %q", meta, deps)
}

// parseField reads the first non-empty field of an apt-cache show record.
func parseField(out []byte, field string) (string, error) {
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(nil, 1<<20) // Description lines can be long
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok && strings.TrimSpace(v) != "" {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("no %s in apt-cache show output", field)
}

// fetchKernel returns a folder holding vmlinuz and the modules the init
// needs (b.roots and what they depend on, named by moduleFile) of pkg at
// version. The package is downloaded once per version and kept, so a change
// of the module set only unpacks it again. The folder is filled under a
// temporary name and renamed, so a folder that exists is complete. Files of
// other kernel versions and module sets are removed.
func (b *builder) fetchKernel(ctx context.Context, pkg, version string) (string, error) {
	kernels := filepath.Join(b.dir, "kernel")
	base := safeName(pkg + "_" + version)
	kdir := filepath.Join(kernels, base+"+"+moduleSetID(b.roots))
	if _, err := os.Stat(kdir); err == nil {
		b.log.Info("kernel cached", "dir", kdir)
		return kdir, nil
	}
	if err := os.MkdirAll(kernels, 0o755); err != nil {
		return "", fmt.Errorf("guest build: %w", err)
	}
	deb, err := b.download(ctx, kernels, base, pkg, version)
	if err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(kernels, ".fetch-")
	if err != nil {
		return "", fmt.Errorf("guest build: %w", err)
	}
	defer os.RemoveAll(tmp) // gone already after the rename
	if err := os.Chmod(tmp, 0o755); err != nil {
		return "", fmt.Errorf("guest build: %w", err)
	}
	start := time.Now()
	mods, err := extractKernel(ctx, deb, b.roots, tmp)
	if err != nil {
		return "", fmt.Errorf("guest build: %s: %w", pkg, err)
	}
	if err := os.Rename(tmp, kdir); err != nil {
		return "", fmt.Errorf("guest build: %w", err)
	}
	b.log.Info("kernel extracted", "dir", kdir, "modules", strings.Join(mods, " "),
		"took", time.Since(start).Round(time.Millisecond))
	b.pruneKernels(kernels, filepath.Base(deb), filepath.Base(kdir))
	return kdir, nil
}

// moduleSetID names a module set and the layout of its folder, so a folder
// made for other modules, or by an older builder, is never taken for this one.
func moduleSetID(roots []string) string {
	const layout = "numbered-ko-1"
	sum := sha256.Sum256([]byte(layout + "\n" + strings.Join(roots, "\n")))
	return hex.EncodeToString(sum[:6])
}

// download returns the path of the kept package file of pkg at version,
// fetching it with apt-get download only if it is not there yet.
func (b *builder) download(ctx context.Context, kernels, base, pkg, version string) (string, error) {
	deb := filepath.Join(kernels, base+".deb")
	if _, err := os.Stat(deb); err == nil {
		return deb, nil
	}
	tmp, err := os.MkdirTemp(kernels, ".fetch-")
	if err != nil {
		return "", fmt.Errorf("guest build: %w", err)
	}
	defer os.RemoveAll(tmp)
	start := time.Now()
	b.log.Info("downloading kernel package", "package", pkg, "version", version)
	if _, err := run(ctx, tmp, nil, "apt-get", "download", "-qq", pkg+"="+version); err != nil {
		return "", fmt.Errorf("guest build: download %s: %w", pkg, err)
	}
	debs, err := filepath.Glob(filepath.Join(tmp, "*.deb"))
	if err != nil || len(debs) != 1 {
		return "", fmt.Errorf("guest build: download %s: want one .deb in %s, found %d", pkg, tmp, len(debs))
	}
	if err := os.Rename(debs[0], deb); err != nil {
		return "", fmt.Errorf("guest build: %w", err)
	}
	b.log.Info("kernel package downloaded", "file", deb, "took", time.Since(start).Round(time.Millisecond))
	return deb, nil
}

// pruneKernels removes what the kernel folder holds besides keep (and
// builds in progress); failing to is only wasted disk, so it is logged,
// not returned.
func (b *builder) pruneKernels(kernels string, keep ...string) {
	entries, err := os.ReadDir(kernels)
	if err != nil {
		return
	}
	for _, e := range entries {
		if slices.Contains(keep, e.Name()) || strings.HasPrefix(e.Name(), ".fetch-") {
			continue
		}
		p := filepath.Join(kernels, e.Name())
		if err := os.RemoveAll(p); err != nil {
			b.log.Warn("remove old kernel", "dir", p, "error", err)
		}
	}
}

func safeName(s string) string {
	return strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune(".-_+", r) {
			return r
		}
		return '_'
	}, s)
}

// extractKernel writes vmlinuz and the modules of roots with their
// dependencies, numbered in load order, from the package deb into out, and
// returns the modules' names in that order. It streams the package's data archive (dpkg-deb
// --fsys-tarfile, the unpacking dpkg -x does) once per pass: a full dpkg -x
// would write the whole module tree to pick a dozen files.
func extractKernel(ctx context.Context, deb string, roots []string, out string) ([]string, error) {
	kernel, mods, err := resolveModules(ctx, roots, func() (io.ReadCloser, error) {
		return packageData(ctx, deb)
	})
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(out, KernelFile), kernel, 0o644); err != nil {
		return nil, fmt.Errorf("write kernel: %w", err)
	}
	names := make([]string, len(mods))
	for i, m := range mods {
		if err := os.WriteFile(filepath.Join(out, moduleFile(i, m.name)), m.data, 0o644); err != nil {
			return nil, fmt.Errorf("write module: %w", err)
		}
		names[i] = m.name
	}
	return names, nil
}

// packageData is the data tar of a .deb, read from dpkg-deb; Close drains
// and reaps it (so it never dies of a broken pipe) and reports its failure.
func packageData(ctx context.Context, deb string) (io.ReadCloser, error) {
	cmd := exec.CommandContext(ctx, "dpkg-deb", "--fsys-tarfile", deb)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("dpkg-deb: %w", err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("dpkg-deb: %w", err)
	}
	return &cmdReader{r: stdout, close: func() error {
		_, _ = io.Copy(io.Discard, stdout)
		if err := cmd.Wait(); err != nil {
			return fmt.Errorf("dpkg-deb --fsys-tarfile %s: %w: %s", deb, err, strings.TrimSpace(stderr.String()))
		}
		return nil
	}}, nil
}

type cmdReader struct {
	r     io.Reader
	close func() error
}

func (c *cmdReader) Read(p []byte) (int, error) { return c.r.Read(p) }
func (c *cmdReader) Close() error               { return c.close() }

// decompressModule returns a plain .ko: finit_module can take compressed
// modules only on kernels built with in-kernel decompression, so do it here.
func decompressModule(ctx context.Context, name string, data []byte) ([]byte, error) {
	var tool string
	switch {
	case strings.HasSuffix(name, ".xz"):
		tool = "xz"
	case strings.HasSuffix(name, ".zst"):
		tool = "zstd"
	default:
		return data, nil
	}
	out, err := run(ctx, "", data, tool, "-dc")
	if err != nil {
		return nil, fmt.Errorf("decompress %s (needs %s installed): %w", name, tool, err)
	}
	return out, nil
}

// buildInit compiles the init static for the guest (amd64, no cgo) with
// reproducible flags, so unchanged sources give identical bytes and the
// initrd is not rewritten.
func (b *builder) buildInit(ctx context.Context) ([]byte, error) {
	tmp, err := os.CreateTemp(b.dir, ".init-")
	if err != nil {
		return nil, fmt.Errorf("guest build: %w", err)
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	cmd := exec.CommandContext(ctx, b.goCmd, "build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w -buildid=",
		"-o", tmp.Name(), InitPackage)
	cmd.Dir = b.moduleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("guest build: go build %s: %w: %s", InitPackage, err, strings.TrimSpace(string(out)))
	}
	data, err := os.ReadFile(tmp.Name())
	if err != nil {
		return nil, fmt.Errorf("guest build: %w", err)
	}
	return data, nil
}

// makeInitrd writes the initramfs: /init, the modules of kdir (already
// named in load order) in /lib/modules, mount points, and /dev/console,
// which the kernel opens as the init's stdin/stdout/stderr before starting
// it.
func makeInitrd(initBin []byte, kdir string) ([]byte, error) {
	mods, err := moduleFiles(kdir)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	w := newCPIOWriter(&buf)
	for _, d := range []string{"dev", "proc", "sys", "lib", "lib/modules"} {
		if err := w.Dir(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := w.CharDev("dev/console", 0o600, 5, 1); err != nil {
		return nil, err
	}
	if err := w.File("init", 0o755, initBin); err != nil {
		return nil, err
	}
	for _, m := range mods {
		data, err := os.ReadFile(m)
		if err != nil {
			return nil, fmt.Errorf("read module: %w", err)
		}
		if err := w.File("lib/modules/"+filepath.Base(m), 0o644, data); err != nil {
			return nil, err
		}
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// writeIfChanged replaces path with data (temp file + rename) unless it
// already holds exactly data, so an unchanged output keeps its mtime.
func (b *builder) writeIfChanged(p string, data []byte, perm os.FileMode) error {
	if old, err := os.ReadFile(p); err == nil && bytes.Equal(old, data) {
		b.log.Info("unchanged", "file", p)
		return nil
	}
	tmp, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+"-")
	if err != nil {
		return fmt.Errorf("guest build: %w", err)
	}
	defer os.Remove(tmp.Name()) // fails harmlessly after the rename
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("guest build: write %s: %w", p, err)
	}
	if err := tmp.Chmod(perm); err != nil {
		tmp.Close()
		return fmt.Errorf("guest build: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("guest build: write %s: %w", p, err)
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		return fmt.Errorf("guest build: %w", err)
	}
	b.log.Info("written", "file", p, "bytes", len(data))
	return nil
}

// run runs a command and returns its stdout; the error carries stderr.
func run(ctx context.Context, dir string, stdin []byte, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}
