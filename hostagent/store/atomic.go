package store

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"vmflow/internal/crashpoint"
)

// tmpPrefix starts the name of every temp file the store writes. It begins
// with a dot, which no instance id can, so a temp file never looks like an
// instance, and removeStaleTemps can find the leftovers of a crashed writer.
const tmpPrefix = ".tmp-"

// writeFileAtomic replaces dir/name with data so that a crash at any instant
// leaves either the old file or the new one, never a torn mix or nothing
// (ARCHITECTURE invariant 7): write a temp file in the same directory, fsync
// it, rename it over the target, fsync the directory so the rename itself is
// durable. afterTemp, when set, runs between the temp file's fsync and the
// rename; tests use it to kill a writer at exactly that point.
func writeFileAtomic(dir, name string, data []byte, afterTemp func(tmp string)) (err error) {
	// CreateTemp opens with O_EXCL and mode 0600: no other reader can see the
	// content under a different mode, and no symlink is followed.
	f, err := os.CreateTemp(dir, tmpPrefix+name+"-*")
	if err != nil {
		return fmt.Errorf("create temp file for %s: %w", filepath.Join(dir, name), err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			// Best effort: the error that matters is the one already set; a
			// leftover temp file is removed by the next write under the lock.
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	if _, err = f.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err = f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", tmp, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	if afterTemp != nil {
		afterTemp(tmp)
	}
	crashpoint.Hit(crashpoint.StoreWriteTemp)
	target := filepath.Join(dir, name)
	if err = os.Rename(tmp, target); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmp, target, err)
	}
	crashpoint.Hit(crashpoint.StoreWriteRenamed)
	if err = syncDir(dir); err != nil {
		// The new content is in place but maybe not durable yet; say so
		// rather than pretend, so the caller retries the (idempotent) write.
		return err
	}
	return nil
}

// syncDir fsyncs a directory so entries created, renamed or removed in it
// survive a power loss.
func syncDir(dir string) error {
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

// removeStaleTemps removes temp files a crashed writer left in dir. Only call
// it under the instance lock: then no live writer has a temp file in flight.
func removeStaleTemps(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("list %s: %w", dir, err)
	}
	var errs []error
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), tmpPrefix) && e.Type().IsRegular() {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, fmt.Errorf("remove stale temp file: %w", err))
			}
		}
	}
	return errors.Join(errs...)
}
