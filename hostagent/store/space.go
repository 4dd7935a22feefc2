package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// DefaultReserve is the reserve's size: what a delete's writes need on a
// full state file system (the manual-stop marker, a few record writes of a
// few KiB each, the trash directory), many times over.
const DefaultReserve = 4 << 20

// createHeadroom is what a spawn must find free besides the reserve and the
// overlays' growth: its record, its first log lines.
const createHeadroom = 1 << 20

// reserveFile is the reserve in the state dir: a file of Reserve bytes
// allocated up front (CockroachDB's ballast), given up only to let a
// delete's writes through on a full file system (invariant 14), and laid
// down again once there is room.
const reserveFile = "reserve"

// ErrDiskFull: the state file system has no room for a spawn (its free
// bytes, less what running overlays may still grow to and the reserve,
// are below what one needs). Nothing was created.
var ErrDiskFull = errdefs.Refused.New("state file system full")

// WithReserve sets the reserve's size in bytes (DefaultReserve when not
// given; 0 keeps none).
func WithReserve(bytes uint64) Option { return func(s *Store) { s.reserve = bytes } }

// Space is the state file system's room as the store sees it.
type Space struct {
	// Free is what the agent can still write (statfs f_bavail), the
	// reserve not included.
	Free uint64
	// Reserve is the reserve's configured size; Held whether it is laid
	// down (false after a delete gave it up, until there is room again).
	Reserve uint64
	Held    bool
	// OverlayGrowth is what the instances' qcow2 overlays may still grow
	// to: their virtual sizes less what they have allocated.
	OverlayGrowth uint64
	// Unsized: the file system reports no sizes at all (statfs gives 0
	// blocks: some FUSE file systems): Free means nothing, and spawns are
	// not refused for room.
	Unsized bool
	// Err says why a figure could not be read (it is then 0).
	Err error
	// Measured: the file system answered statfs, so Free, Unsized and Held
	// were read (Err may still be the overlays').
	Measured bool
}

// Low reports whether the state file system is below its reserve (or the
// reserve was given up): deletes still go through, spawns are refused.
func (sp Space) Low() bool { return !sp.Unsized && sp.Err == nil && (sp.Free < sp.Reserve || !sp.Held) }

// Space reads the state file system's room, every overlay measured (and
// the index's counts of them refreshed).
func (s *Store) Space() Space { return s.space(s.overlayGrowth) }

// space is Space with the overlays' growth summed by growth.
func (s *Store) space(growth func() (uint64, error)) Space {
	sp := Space{Reserve: s.reserve}
	var st unix.Statfs_t
	if err := unix.Statfs(s.root, &st); err != nil {
		sp.Err = fmt.Errorf("statfs %s: %w", s.root, err)
		return sp
	}
	sp.Free, sp.Unsized, sp.Measured = st.Bavail*uint64(st.Bsize), st.Blocks == 0, true
	_, err := os.Lstat(s.reservePath())
	sp.Held = err == nil || s.reserve == 0
	sp.OverlayGrowth, sp.Err = growth()
	return sp
}

func (s *Store) reservePath() string { return filepath.Join(s.root, reserveFile) }

// checkRoom refuses a spawn (ErrDiskFull) the state file system cannot hold
// beside the reserve and the running overlays' growth; disk is its own
// overlay's. A reserve given up earlier is laid down first when it fits.
func (s *Store) checkRoom(disk uint64) error {
	s.layReserve()
	growth := s.overlayGrowth
	if ix := s.ix.Load(); ix != nil {
		growth = func() (uint64, error) { return ix.growthSum(s) }
	}
	sp := s.space(growth)
	if sp.Err != nil {
		return fmt.Errorf("%w: cannot tell how much room is left: %w", ErrDiskFull, sp.Err)
	}
	if sp.Unsized {
		return nil
	}
	need := uint64(createHeadroom) + disk + sp.OverlayGrowth
	if !sp.Held {
		need += sp.Reserve
	}
	if sp.Free < need {
		return fmt.Errorf("%w: %d bytes free on %s, %d of them may still be written by the instances' disk overlays; this spawn needs %d (its disk may grow to %d; the %d-byte reserve %s)",
			ErrDiskFull, sp.Free, s.root, sp.OverlayGrowth, uint64(createHeadroom)+disk, disk, sp.Reserve, heldWord(sp.Held))
	}
	return nil
}

// diskSize is what an overlay over the image at path may grow to (the image's
// size); 0 without a readable disk, which the launch admits.
func diskSize(path string) uint64 {
	if path == "" {
		return 0
	}
	fi, err := os.Stat(path)
	if err != nil || !fi.Mode().IsRegular() {
		return 0
	}
	return uint64(fi.Size())
}

func heldWord(held bool) string {
	if held {
		return "in place"
	}
	return "given up, to be laid down again"
}

// layReserve lays the reserve down when missing and there is room for it and a
// spawn; best effort (Space reports it missing).
func (s *Store) layReserve() {
	if s.reserve == 0 {
		return
	}
	path := s.reservePath()
	if _, err := os.Lstat(path); err == nil {
		return
	}
	var st unix.Statfs_t
	if err := unix.Statfs(s.root, &st); err != nil || st.Bavail*uint64(st.Bsize) < s.reserve+createHeadroom {
		return
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return
	}
	err = allocate(f, s.reserve)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(path) // a partial reserve is no reserve
	}
}

// allocate gives f size bytes of real blocks: fallocate, or zeros written
// where the file system cannot (a sparse file would reserve nothing).
func allocate(f *os.File, size uint64) error {
	err := unix.Fallocate(int(f.Fd()), 0, 0, int64(size))
	if !errors.Is(err, unix.EOPNOTSUPP) {
		return err
	}
	buf := make([]byte, 64<<10)
	for left := size; left > 0; {
		n := min(left, uint64(len(buf)))
		if _, err := f.Write(buf[:n]); err != nil {
			return err
		}
		left -= n
	}
	return f.Sync()
}

// giveUpReserve removes the reserve so that a delete's write that found the
// file system full gets through; reports whether there was one to give.
func (s *Store) giveUpReserve() bool {
	if s.reserve == 0 {
		return false
	}
	return os.Remove(s.reservePath()) == nil
}

// withReserve runs a delete's write; when it fails for want of space, the
// reserve is given up and the write tried once more.
func (s *Store) withReserve(write func() error) error {
	err := write()
	if errors.Is(err, syscall.ENOSPC) && s.giveUpReserve() {
		err = write()
	}
	return err
}

// overlayGrowth sums what every instance's qcow2 overlay may still grow
// to: its virtual size (the qcow2 header's) less its allocated blocks, or,
// before the first launch made it, its disk's whole size. An unreadable
// record counts nothing: it must not refuse every spawn on the host.
func (s *Store) overlayGrowth() (uint64, error) {
	ids, err := s.IDs()
	if err != nil {
		return 0, err
	}
	var sum uint64
	for _, id := range ids {
		g, err := s.growthOf(id, nil)
		if err != nil {
			return 0, err
		}
		if ix := s.ix.Load(); ix != nil {
			ix.measured(id, g)
		}
		sum += g
	}
	return sum, nil
}

// growthOf is what instance id's overlay may still grow to (overlayGrowth);
// rec is its record when the caller has it (nil: read from disk).
func (s *Store) growthOf(id string, rec *vmflowv1.InstanceRecord) (uint64, error) {
	p, err := s.Paths(id)
	if err != nil {
		return 0, err
	}
	if _, err := os.Lstat(p.Overlay); errors.Is(err, fs.ErrNotExist) {
		if rec == nil {
			if rec, err = readRecord(p, id); err != nil {
				return 0, nil
			}
		}
		return diskSize(rec.GetSpec().GetDisk()), nil
	}
	return growth(p.Overlay)
}

// growth is how much more path, a qcow2 image, may take on disk; 0 for no
// file or one that is not qcow2.
func growth(path string) (uint64, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("overlay %s: %w", path, err)
	}
	defer f.Close()
	var hdr [32]byte
	if _, err := io.ReadFull(f, hdr[:]); err != nil || string(hdr[:4]) != "QFI\xfb" {
		return 0, nil
	}
	virtual := binary.BigEndian.Uint64(hdr[24:32])
	fi, err := f.Stat()
	if err != nil {
		return 0, fmt.Errorf("overlay %s: %w", path, err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return virtual, nil
	}
	allocated := uint64(st.Blocks) * 512
	if allocated >= virtual {
		return 0, nil
	}
	return virtual - allocated, nil
}
