package fsx

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// TempPrefix starts the name of every temp file WriteFile makes. It begins
// with a dot, which no instance id can, so a temp file never looks like an
// instance, and RemoveStaleTemps can find the leftovers of a crashed writer.
const TempPrefix = ".tmp-"

// Hooks run at the two instants between the steps of an atomic replace, so
// crash tests and crash points can stop a writer exactly there. Nil fields
// are skipped.
type Hooks struct {
	// Synced runs once the temp file is written, fsynced and closed, before
	// the rename.
	Synced func(tmp string)
	// Renamed runs after the rename, before the directory's fsync.
	Renamed func()
}

// WriteFile replaces path with data so a crash leaves the old file or the new,
// durable on return: an O_EXCL 0600 temp file beside it, then Install. A
// crash's temp file is RemoveStaleTemps's.
func WriteFile(path string, data []byte, h *Hooks) (err error) {
	dir, name := filepath.Split(path)
	f, err := os.CreateTemp(dir, TempPrefix+name+"-*")
	if err != nil {
		return fmt.Errorf("create temp file for %s: %w", path, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			// Best effort: the error that matters is already set.
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	if _, err = f.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	return install(f, path, h)
}

// Install makes a file another program wrote at tmp durable under path (fsync,
// rename, fsync dir); on error the caller removes tmp.
func Install(tmp, path string, h *Hooks) error {
	if filepath.Dir(tmp) != filepath.Dir(path) {
		return fmt.Errorf("install %s as %s: not in the same directory", tmp, path)
	}
	f, err := os.Open(tmp)
	if err != nil {
		return fmt.Errorf("open %s for fsync: %w", tmp, err)
	}
	if err := install(f, path, h); err != nil {
		_ = f.Close() // best effort: install closes it on success
		return err
	}
	return nil
}

// install is the one place a file is made durable and renamed into place: the
// file's fsync before the rename (else a power cut leaves it empty), the
// directory's after (else it brings back the old file, or none).
func install(f *os.File, path string, h *Hooks) error {
	tmp := f.Name()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	if h != nil && h.Synced != nil {
		h.Synced(tmp)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmp, path, err)
	}
	if h != nil && h.Renamed != nil {
		h.Renamed()
	}
	// The new content is in place but maybe not durable yet on an error:
	// say so rather than pretend, so the caller retries the write.
	return SyncDir(filepath.Dir(path))
}

// SyncDir fsyncs a directory so entries created, renamed or removed in it
// survive a power loss.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s for fsync: %w", dir, err)
	}
	serr := d.Sync()
	cerr := d.Close()
	if serr != nil {
		return fmt.Errorf("fsync directory %s: %w", dir, serr)
	}
	if cerr != nil {
		return fmt.Errorf("close directory %s: %w", dir, cerr)
	}
	return nil
}

// RemoveStaleTemps removes a crashed WriteFile's temp files in dir; call it
// only under the writers' lock, or it removes a live writer's.
func RemoveStaleTemps(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("list %s: %w", dir, err)
	}
	var errs []error
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), TempPrefix) && e.Type().IsRegular() {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, fmt.Errorf("remove stale temp file: %w", err))
			}
		}
	}
	return errors.Join(errs...)
}

// MkdirAll is os.MkdirAll that fsyncs each new directory's parent, so the tree
// survives a power cut along with the files later written into it.
func MkdirAll(path string, perm os.FileMode) error {
	path = filepath.Clean(path)
	fi, err := os.Stat(path)
	if err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("mkdir %s: %w", path, syscall.ENOTDIR)
		}
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("mkdir %s: %w", path, err)
	}
	parent := filepath.Dir(path)
	if parent != path {
		if err := MkdirAll(parent, perm); err != nil {
			return err
		}
	}
	if err := os.Mkdir(path, perm); err != nil {
		if fi, serr := os.Stat(path); serr == nil && fi.IsDir() {
			return nil // made by someone else meanwhile: theirs to sync
		}
		return fmt.Errorf("mkdir %s: %w", path, err)
	}
	return SyncDir(parent)
}
