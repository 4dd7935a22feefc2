package fsx

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// ErrLockHeld is wrapped (with the context's error) when LockFile gives up
// because another holder kept the lock until the context ended.
var ErrLockHeld = errors.New("lock held by another")

// Lock polling bounds. flock has no timeout and a blocked flock(2) cannot be
// interrupted by a context, so LockFile polls LOCK_NB with a capped backoff
// and gives up when the context ends.
const (
	lockPollMin = time.Millisecond
	lockPollMax = 20 * time.Millisecond
)

// Lock is an exclusive flock(2) on a lock file. flock locks belong to the
// open file description, so two goroutines of one process (each opening the
// file) exclude each other just as two processes do. Go opens files
// close-on-exec, so a QEMU started under the lock does not inherit it; the
// kernel drops it when its holder dies.
type Lock struct {
	f *os.File
}

// LockFile takes an exclusive lock on path (created 0600), polling until ctx
// ends (ErrLockHeld). A holder may unlink the file, so it re-checks the inode
// and starts over on a new file: a lock on an unlinked one excludes nobody.
func LockFile(ctx context.Context, path string) (*Lock, error) {
	wait := lockPollMin
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("lock %s: %w: %w", path, ErrLockHeld, err)
		}
		l, err := tryLock(path)
		if err != nil {
			return nil, err
		}
		if l != nil {
			return l, nil
		}
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("lock %s: %w: %w", path, ErrLockHeld, ctx.Err())
		case <-timer.C:
		}
		wait = min(wait*2, lockPollMax)
	}
}

// tryLock makes one attempt: a held lock, nil without error when another
// holder has it (or it was unlinked under us), or an error.
func tryLock(path string) (*Lock, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock file: %w", err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if errors.Is(err, unix.EWOULDBLOCK) {
		return nil, closeWith(f, nil)
	}
	if err != nil {
		return nil, closeWith(f, fmt.Errorf("flock %s: %w", path, err))
	}
	same, err := sameFile(f, path)
	if err != nil {
		return nil, closeWith(f, err)
	}
	if !same {
		return nil, closeWith(f, nil)
	}
	return &Lock{f: f}, nil
}

// sameFile reports whether path still names the file f has open.
func sameFile(f *os.File, path string) (bool, error) {
	fi, err := f.Stat()
	if err != nil {
		return false, fmt.Errorf("stat lock file: %w", err)
	}
	pi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat lock file: %w", err)
	}
	return os.SameFile(fi, pi), nil
}

func closeWith(f *os.File, err error) error {
	if cerr := f.Close(); cerr != nil && err == nil {
		return fmt.Errorf("close lock file: %w", cerr)
	}
	return err
}

// Release unlinks the lock file first when remove is set (safe only while held:
// waiters re-check the inode), then unlocks by closing it.
func (l *Lock) Release(remove bool) error {
	var errs []error
	if remove {
		if err := os.Remove(l.f.Name()); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove lock file: %w", err))
		}
	}
	if err := l.f.Close(); err != nil {
		errs = append(errs, fmt.Errorf("unlock %s: %w", l.f.Name(), err))
	}
	return errors.Join(errs...)
}

// Names reports whether path names the file l locks now.
func (l *Lock) Names(path string) (bool, error) { return sameFile(l.f, path) }
