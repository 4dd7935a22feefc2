// Package powercut is a FUSE file system for tests that can lose power.
//
// A SIGKILL keeps the page cache, so no crash test proves that a writer
// fsyncs: only losing what was never fsynced does. This file system holds
// its files in memory and remembers, for every file, its content as of its
// last fsync, and for every directory, its entries as of its last fsync.
// Cut fails every operation from then on, as a dead disk does; Restart
// unmounts and mounts again with exactly the fsynced state: file data
// written since the file's last fsync is gone, and so is every directory
// change (create, mkdir, rename, unlink) since the directory's last fsync.
// A file whose entry survived shows its content as of its own last fsync,
// so a file renamed into place without an fsync of its data comes back
// empty, as on ext4 with delalloc.
//
// That is the weakest durability POSIX promises, stricter than most real
// file systems (ext4 often commits a rename with the file it names), which
// is the point: a writer correct here is correct on any of them. Metadata
// other than names and content (mode, times) is kept as it is; hard links,
// symlinks, xattrs and mmap are not supported. Locks are the kernel's local
// flock, as on any FUSE mount that does not claim them.
package powercut

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sort"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"vmflow/hostagent/proc/proctest"
)

// node is one file or directory, both as it is now and as it was at its
// last fsync. It outlives mounts: Restart rebuilds the FUSE tree over the
// same nodes.
type node struct {
	ino  uint64
	dir  bool
	mode uint32 // permission bits

	data, synced []byte // a file's content now and at its last fsync

	entries, syncedEntries map[string]*node // a directory's, likewise
}

// FS is a mounted power-cut file system.
type FS struct {
	dir string

	mu      sync.Mutex // guards everything below and every node
	root    *node
	nextIno uint64
	gen     uint64 // bumped by Restart: nodes of an older mount answer EIO
	cut     bool
	srv     *fuse.Server
	fsyncs  int
}

// Mount mounts an empty file system at dir, which must exist. Everything a
// test writes before its first fsyncs is as volatile as anything later.
func Mount(dir string) (*FS, error) {
	f := &FS{dir: dir, nextIno: 2}
	f.root = &node{ino: 1, dir: true, mode: 0o755, entries: map[string]*node{}, syncedEntries: map[string]*node{}}
	if err := f.mount(); err != nil {
		return nil, err
	}
	return f, nil
}

// Start mounts a file system in a fresh temporary directory for t and
// unmounts it when t ends; it skips t where FUSE is missing.
func Start(t testing.TB) *FS {
	t.Helper()
	proctest.RequiresFUSE(t)
	f, err := Mount(t.TempDir())
	if err != nil {
		t.Fatalf("powercut: %v", err)
	}
	// Registered after TempDir's cleanup, so it runs before the removal.
	t.Cleanup(func() {
		if err := f.Unmount(); err != nil {
			t.Errorf("powercut: %v", err)
		}
	})
	return f
}

// Dir is the mount point.
func (f *FS) Dir() string { return f.dir }

// Fsyncs counts the fsync and fsyncdir calls served so far (all mounts),
// so a test can check its writer reached the file system at all.
func (f *FS) Fsyncs() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fsyncs
}

// Cut loses power: from now on every operation fails with EIO and nothing
// more becomes durable. Call Restart to see what survived.
func (f *FS) Cut() {
	f.mu.Lock()
	f.cut = true
	f.mu.Unlock()
}

// Restart cuts the power if on, unmounts, restores every file and directory to
// its last fsync and remounts. Stop the writers first: an open file keeps the
// old mount alive, detached, answering EIO.
func (f *FS) Restart() error {
	f.Cut()
	if err := f.unmount(); err != nil {
		return err
	}
	f.mu.Lock()
	revert(f.root)
	f.gen++
	f.cut = false
	f.mu.Unlock()
	return f.mount()
}

// Unmount unmounts; the file system is gone.
func (f *FS) Unmount() error {
	f.Cut()
	return f.unmount()
}

// revert brings n and everything its fsynced entries reach back to their
// fsynced state. Nodes only the current entries reach are dropped with them.
func revert(n *node) {
	if !n.dir {
		n.data = cloneBytes(n.synced)
		return
	}
	n.entries = maps.Clone(n.syncedEntries)
	for _, c := range n.entries {
		revert(c)
	}
}

func (f *FS) mount() error {
	// Short timeouts: a test reads right after a restart, and nothing but
	// this file system changes it between restarts, which remount anyway.
	sec := time.Second
	opts := &fs.Options{
		EntryTimeout:    &sec,
		AttrTimeout:     &sec,
		NegativeTimeout: &sec,
		MountOptions: fuse.MountOptions{
			DirectMount: true,
			FsName:      "powercut",
			Name:        "powercut",
		},
	}
	f.mu.Lock()
	root := &fnode{f: f, n: f.root, gen: f.gen}
	f.mu.Unlock()
	srv, err := fs.Mount(f.dir, root, opts)
	if err != nil {
		return fmt.Errorf("powercut: mount %s: %w", f.dir, err)
	}
	f.mu.Lock()
	f.srv = srv
	f.mu.Unlock()
	return nil
}

func (f *FS) unmount() error {
	f.mu.Lock()
	srv := f.srv
	f.srv = nil
	f.mu.Unlock()
	if srv == nil {
		return nil
	}
	if uerr := srv.Unmount(); uerr != nil {
		// A file still open (a writer that has not noticed the cut yet):
		// detach, so the kernel ends the old mount when it is closed.
		if derr := syscall.Unmount(f.dir, syscall.MNT_DETACH); derr != nil {
			return fmt.Errorf("powercut: unmount %s: %w", f.dir, errors.Join(uerr, derr))
		}
	}
	return nil
}

func cloneBytes(b []byte) []byte {
	if b == nil {
		return nil
	}
	return append([]byte(nil), b...)
}

// fnode is a node as one mount serves it.
type fnode struct {
	fs.Inode
	f   *FS
	n   *node
	gen uint64
}

var (
	_ fs.NodeLookuper  = (*fnode)(nil)
	_ fs.NodeReaddirer = (*fnode)(nil)
	_ fs.NodeGetattrer = (*fnode)(nil)
	_ fs.NodeSetattrer = (*fnode)(nil)
	_ fs.NodeMkdirer   = (*fnode)(nil)
	_ fs.NodeCreater   = (*fnode)(nil)
	_ fs.NodeUnlinker  = (*fnode)(nil)
	_ fs.NodeRmdirer   = (*fnode)(nil)
	_ fs.NodeRenamer   = (*fnode)(nil)
	_ fs.NodeOpener    = (*fnode)(nil)
	_ fs.NodeReader    = (*fnode)(nil)
	_ fs.NodeWriter    = (*fnode)(nil)
	_ fs.NodeFsyncer   = (*fnode)(nil)
	_ fs.NodeFlusher   = (*fnode)(nil)
)

// lock takes the file system's lock and reports whether the power is on
// for this mount; when it is not, the caller answers EIO (and unlocks).
func (x *fnode) lock() bool {
	x.f.mu.Lock()
	return !x.f.cut && x.gen == x.f.gen
}

func (x *fnode) unlock() { x.f.mu.Unlock() }

func (x *fnode) attr(n *node, out *fuse.Attr) {
	out.Ino = n.ino
	if n.dir {
		out.Mode = syscall.S_IFDIR | n.mode
		out.Nlink = 2
	} else {
		out.Mode = syscall.S_IFREG | n.mode
		out.Nlink = 1
		out.Size = uint64(len(n.data))
	}
}

func stable(n *node) fs.StableAttr {
	if n.dir {
		return fs.StableAttr{Mode: syscall.S_IFDIR, Ino: n.ino}
	}
	return fs.StableAttr{Mode: syscall.S_IFREG, Ino: n.ino}
}

func (x *fnode) child(ctx context.Context, n *node, out *fuse.EntryOut) *fs.Inode {
	x.attr(n, &out.Attr)
	return x.NewInode(ctx, &fnode{f: x.f, n: n, gen: x.gen}, stable(n))
}

func (x *fnode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	if !x.lock() {
		x.unlock()
		return nil, syscall.EIO
	}
	defer x.unlock()
	c, ok := x.n.entries[name]
	if !ok {
		return nil, syscall.ENOENT
	}
	return x.child(ctx, c, out), 0
}

func (x *fnode) Readdir(ctx context.Context) (fs.DirStream, syscall.Errno) {
	if !x.lock() {
		x.unlock()
		return nil, syscall.EIO
	}
	defer x.unlock()
	names := make([]string, 0, len(x.n.entries))
	for name := range x.n.entries {
		names = append(names, name)
	}
	sort.Strings(names)
	list := make([]fuse.DirEntry, 0, len(names))
	for _, name := range names {
		c := x.n.entries[name]
		list = append(list, fuse.DirEntry{Name: name, Ino: c.ino, Mode: stable(c).Mode})
	}
	return fs.NewListDirStream(list), 0
}

func (x *fnode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	if !x.lock() {
		x.unlock()
		return syscall.EIO
	}
	defer x.unlock()
	x.attr(x.n, &out.Attr)
	return 0
}

func (x *fnode) Setattr(ctx context.Context, fh fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if !x.lock() {
		x.unlock()
		return syscall.EIO
	}
	defer x.unlock()
	if m, ok := in.GetMode(); ok {
		x.n.mode = m & 0o7777
	}
	if sz, ok := in.GetSize(); ok {
		if x.n.dir {
			return syscall.EISDIR
		}
		if sz <= uint64(len(x.n.data)) {
			x.n.data = x.n.data[:sz]
		} else {
			x.n.data = append(x.n.data, make([]byte, sz-uint64(len(x.n.data)))...)
		}
	}
	x.attr(x.n, &out.Attr)
	return 0
}

// add makes a new node named name in x, refusing a name in use.
func (x *fnode) add(ctx context.Context, name string, dir bool, mode uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	if !x.n.dir {
		return nil, syscall.ENOTDIR
	}
	if _, ok := x.n.entries[name]; ok {
		return nil, syscall.EEXIST
	}
	n := &node{ino: x.f.nextIno, dir: dir, mode: mode & 0o7777}
	x.f.nextIno++
	if dir {
		n.entries, n.syncedEntries = map[string]*node{}, map[string]*node{}
	}
	x.n.entries[name] = n
	return x.child(ctx, n, out), 0
}

func (x *fnode) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	if !x.lock() {
		x.unlock()
		return nil, syscall.EIO
	}
	defer x.unlock()
	return x.add(ctx, name, true, mode, out)
}

func (x *fnode) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	if !x.lock() {
		x.unlock()
		return nil, nil, 0, syscall.EIO
	}
	defer x.unlock()
	in, errno := x.add(ctx, name, false, mode, out)
	return in, nil, fuse.FOPEN_DIRECT_IO, errno
}

func (x *fnode) remove(name string, dir bool) syscall.Errno {
	if !x.lock() {
		x.unlock()
		return syscall.EIO
	}
	defer x.unlock()
	c, ok := x.n.entries[name]
	switch {
	case !ok:
		return syscall.ENOENT
	case dir && !c.dir:
		return syscall.ENOTDIR
	case !dir && c.dir:
		return syscall.EISDIR
	case dir && len(c.entries) > 0:
		return syscall.ENOTEMPTY
	}
	delete(x.n.entries, name)
	return 0
}

func (x *fnode) Unlink(ctx context.Context, name string) syscall.Errno { return x.remove(name, false) }

func (x *fnode) Rmdir(ctx context.Context, name string) syscall.Errno { return x.remove(name, true) }

// Rename follows rename(2); RENAME_NOREPLACE refuses any target,
// RENAME_EXCHANGE is not supported.
func (x *fnode) Rename(ctx context.Context, name string, newParent fs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	if !x.lock() {
		x.unlock()
		return syscall.EIO
	}
	defer x.unlock()
	np, ok := newParent.(*fnode)
	if !ok || !np.n.dir {
		return syscall.ENOTDIR
	}
	if flags&^uint32(unix.RENAME_NOREPLACE) != 0 {
		return syscall.EINVAL
	}
	c, ok := x.n.entries[name]
	if !ok {
		return syscall.ENOENT
	}
	if t, ok := np.n.entries[newName]; ok {
		switch {
		case t == c:
			return 0
		case flags&uint32(unix.RENAME_NOREPLACE) != 0:
			return syscall.EEXIST
		case c.dir && !t.dir:
			return syscall.ENOTDIR
		case !c.dir && t.dir:
			return syscall.EISDIR
		case t.dir && len(t.entries) > 0:
			return syscall.ENOTEMPTY
		}
	}
	if c.dir && isWithin(np.n, c) {
		return syscall.EINVAL // a directory into itself
	}
	delete(x.n.entries, name)
	np.n.entries[newName] = c
	return 0
}

// isWithin reports whether d is dir or below it (current entries).
func isWithin(d, dir *node) bool {
	if d == dir {
		return true
	}
	for _, c := range dir.entries {
		if c.dir && isWithin(d, c) {
			return true
		}
	}
	return false
}

func (x *fnode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if !x.lock() {
		x.unlock()
		return nil, 0, syscall.EIO
	}
	defer x.unlock()
	if flags&syscall.O_TRUNC != 0 && !x.n.dir {
		x.n.data = x.n.data[:0]
	}
	// Direct I/O: every read and write reaches this file system, so the
	// kernel's page cache never shows data that a restart dropped.
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (x *fnode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if !x.lock() {
		x.unlock()
		return nil, syscall.EIO
	}
	defer x.unlock()
	if off >= int64(len(x.n.data)) {
		return fuse.ReadResultData(nil), 0
	}
	end := min(off+int64(len(dest)), int64(len(x.n.data)))
	return fuse.ReadResultData(cloneBytes(x.n.data[off:end])), 0
}

func (x *fnode) Write(ctx context.Context, fh fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	if !x.lock() {
		x.unlock()
		return 0, syscall.EIO
	}
	defer x.unlock()
	if end := off + int64(len(data)); end > int64(len(x.n.data)) {
		x.n.data = append(x.n.data, make([]byte, end-int64(len(x.n.data)))...)
	}
	copy(x.n.data[off:], data)
	return uint32(len(data)), 0
}

// Fsync makes a file's content, or a directory's names (not their files'
// content), durable: what Restart brings back.
func (x *fnode) Fsync(ctx context.Context, fh fs.FileHandle, flags uint32) syscall.Errno {
	if !x.lock() {
		x.unlock()
		return syscall.EIO
	}
	defer x.unlock()
	x.f.fsyncs++
	if x.n.dir {
		x.n.syncedEntries = maps.Clone(x.n.entries)
	} else {
		x.n.synced = cloneBytes(x.n.data)
	}
	return 0
}

// Flush (close) makes nothing durable; after a cut it must not fail the
// close of a writer that is only cleaning up.
func (x *fnode) Flush(ctx context.Context, fh fs.FileHandle) syscall.Errno { return 0 }
