package vmm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
)

// firstInheritedFD is QEMU's number for exec.Cmd.ExtraFiles[0]: fds 0-2 are
// its stdin, stdout and stderr.
const firstInheritedFD = 3

// FDTable hands out the file descriptor numbers QEMU inherits. The n-th file
// added becomes exec.Cmd.ExtraFiles[n], which QEMU sees as fd 3+n: numbering
// in the order of Add is the one rule both the argv (which names the
// numbers) and ExtraFiles (which makes them real) follow, so they cannot
// disagree. Everything QEMU gets by number goes through one table: the
// images (BuildArgv) and any socket the agent binds for it.
//
// The table holds the agent's copies; Close them once QEMU is forked (it
// has its own from then on), so the agent does not hold every VM's images
// open for its whole life.
type FDTable struct {
	files []*os.File
}

// Add appends f and returns the fd number QEMU will know it by.
func (t *FDTable) Add(f *os.File) int {
	t.files = append(t.files, f)
	return firstInheritedFD + len(t.files) - 1
}

// Reserve hands out the next number for a file given later with Fill (the QMP
// listener, bound only once the argv is known valid).
func (t *FDTable) Reserve() int { return t.Add(nil) }

// Fill gives the file for a reserved number; any other number, or a second
// fill, is an error, so argv and fd table never disagree.
func (t *FDTable) Fill(fd int, f *os.File) error {
	i := fd - firstInheritedFD
	if i < 0 || i >= len(t.files) || t.files[i] != nil {
		return fmt.Errorf("fd %d was not reserved: %w", fd, ErrInvalidSpec)
	}
	t.files[i] = f
	return nil
}

// Files is the table in order: exec.Cmd.ExtraFiles.
func (t *FDTable) Files() []*os.File { return slices.Clone(t.files) }

// Close closes the agent's copy of every file in the table. A file closed
// already (its owner closed it too) is not an error.
func (t *FDTable) Close() error {
	var errs []error
	for _, f := range t.files {
		if err := closeFile(f); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// closeFile closes f; nil and already-closed files are fine.
func closeFile(f *os.File) error {
	if f == nil {
		return nil
	}
	if err := f.Close(); err != nil && !errors.Is(err, fs.ErrClosed) {
		return fmt.Errorf("close %s: %w", f.Name(), err)
	}
	return nil
}
