package vmm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"vmflow/internal/errdefs"
	"vmflow/internal/fsx"
)

// DefaultQEMUImg is the qemu-img binary (Debian's qemu-utils) looked up in
// PATH when OverlayConfig.QEMUImg is empty.
const DefaultQEMUImg = "qemu-img"

// overlayCreateTimeout bounds one qemu-img create when the caller's context
// has no earlier deadline: it writes a few hundred KiB of metadata.
const overlayCreateTimeout = 30 * time.Second

// ErrOverlay: the instance's overlay could not be opened or created. A
// Context: what failed under it (the file system, qemu-img) gives the class.
var ErrOverlay = errdefs.Context("disk overlay")

// OverlayConfig says where an instance's overlay lives and what it lies over.
type OverlayConfig struct {
	// Path is the overlay (store.Paths.Overlay); Temp is where it is
	// written before the rename (store.Paths.OverlayTemp). Same directory.
	Path, Temp string
	// Base is the base image, opened by the agent: its size (fstat) is the
	// overlay's size.
	Base *os.File
	// BackingName is written into the overlay's header for people who run
	// qemu-img info on it; QEMU never opens it, since its backing is always
	// given as the base node (Disk). Absolute.
	BackingName string
	// QEMUImg is the qemu-img binary; DefaultQEMUImg in PATH when empty.
	QEMUImg string
}

// OpenOverlay opens the instance's qcow2 overlay read-write, creating it when
// missing (created); an existing one is kept, so the guest's writes survive
// restarts until the instance is removed.
func OpenOverlay(ctx context.Context, cfg OverlayConfig) (f *os.File, created bool, err error) {
	f, err = openOverlay(cfg.Path)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return f, false, err
	}
	if err := createOverlay(ctx, cfg); err != nil {
		return nil, false, err
	}
	f, err = openOverlay(cfg.Path)
	return f, err == nil, err
}

// openOverlay opens path read-write without following a symlink and checks
// it is a regular file.
func openOverlay(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: open %s: %w", ErrOverlay, path, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%w: stat %s: %w", ErrOverlay, path, err)
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, errdefs.Internal.Errorf("%w: %s is not a regular file (%s)", ErrOverlay, path, fi.Mode().Type())
	}
	return f, nil
}

// createOverlay runs qemu-img create into Temp, fsyncs, renames to Path and
// fsyncs the dir, so no half-written overlay is ever at Path. -u: qemu-img
// leaves the backing unopened (the size comes from the base fd).
func createOverlay(ctx context.Context, cfg OverlayConfig) error {
	if cfg.Base == nil {
		return errdefs.Internal.Errorf("%w: no base image", ErrOverlay)
	}
	if filepath.Dir(cfg.Path) != filepath.Dir(cfg.Temp) || cfg.Path == cfg.Temp {
		return errdefs.Internal.Errorf("%w: temp %s must be another name in %s's directory", ErrOverlay, cfg.Temp, cfg.Path)
	}
	if !filepath.IsAbs(cfg.BackingName) || strings.ContainsAny(cfg.BackingName, "\x00\n\r") {
		return errdefs.Internal.Errorf("%w: backing name %q is not an absolute path", ErrOverlay, cfg.BackingName)
	}
	fi, err := cfg.Base.Stat()
	if err != nil {
		return fmt.Errorf("%w: stat base %s: %w", ErrOverlay, cfg.BackingName, err)
	}
	if fi.Size() <= 0 {
		return fmt.Errorf("%w: base %s is empty", ErrOverlay, cfg.BackingName)
	}
	bin := cfg.QEMUImg
	if bin == "" {
		bin = DefaultQEMUImg
	}
	if bin, err = exec.LookPath(bin); err != nil {
		return errdefs.Misconfigured.Errorf("%w: %w (Debian's qemu-utils has qemu-img)", ErrOverlay, err)
	}
	// A leftover of a crashed create: never reused, it may be torn.
	if err := os.Remove(cfg.Temp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: remove stale %s: %w", ErrOverlay, cfg.Temp, err)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, overlayCreateTimeout)
		defer cancel()
	}
	cmd := exec.CommandContext(ctx, bin, "create", "-q", "-f", "qcow2", "-u", "-F", "raw",
		"-b", cfg.BackingName, cfg.Temp, strconv.FormatInt(fi.Size(), 10))
	cmd.Env = qemuEnv() // PATH and LC_ALL=C, as QEMU gets: nothing of the agent's
	out, err := cmd.CombinedOutput()
	if err != nil {
		_ = os.Remove(cfg.Temp)
		return fmt.Errorf("%w: qemu-img create %s: %w: %s", ErrOverlay, cfg.Temp, err, strings.TrimSpace(string(out)))
	}
	if err := fsx.Install(cfg.Temp, cfg.Path, nil); err != nil {
		_ = os.Remove(cfg.Temp)
		return fmt.Errorf("%w: %w", ErrOverlay, err)
	}
	return nil
}
