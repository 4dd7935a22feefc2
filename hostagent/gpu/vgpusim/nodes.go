package vgpusim

import (
	"context"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// sysfsSize is the size sysfs reports for every attribute file; readers
// must read until EOF, never trust st_size.
const sysfsSize = 4096

// attrNode is one sysfs attribute: show renders it for read(2), store
// handles a write(2). A nil show makes the file write-only and a nil store
// read-only; like kernfs, opening for an access the attribute lacks is
// EACCES even for root.
type attrNode struct {
	fs.Inode
	mode  uint32
	show  func() string
	store func(ctx context.Context, data []byte) syscall.Errno
}

var (
	_ fs.NodeOpener    = (*attrNode)(nil)
	_ fs.NodeReader    = (*attrNode)(nil)
	_ fs.NodeWriter    = (*attrNode)(nil)
	_ fs.NodeGetattrer = (*attrNode)(nil)
	_ fs.NodeSetattrer = (*attrNode)(nil)
)

func roAttr(show func() string) *attrNode { return &attrNode{mode: 0o444, show: show} }

func woAttr(store func(context.Context, []byte) syscall.Errno) *attrNode {
	return &attrNode{mode: 0o200, store: store}
}

func rwAttr(show func() string, store func(context.Context, []byte) syscall.Errno) *attrNode {
	return &attrNode{mode: 0o644, show: show, store: store}
}

func (a *attrNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	acc := flags & syscall.O_ACCMODE
	if (acc == syscall.O_RDONLY || acc == syscall.O_RDWR) && a.show == nil {
		return nil, 0, syscall.EACCES
	}
	if (acc == syscall.O_WRONLY || acc == syscall.O_RDWR) && a.store == nil {
		return nil, 0, syscall.EACCES
	}
	// Direct I/O: the content changes behind the kernel's back
	// (available_instances), so the page cache must never answer a read,
	// and every write must reach us as one request so its errno is the
	// writer's.
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (a *attrNode) Read(ctx context.Context, f fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if a.show == nil {
		return nil, syscall.EACCES
	}
	s := a.show()
	if off >= int64(len(s)) {
		return fuse.ReadResultData(nil), 0
	}
	end := off + int64(len(dest))
	if end > int64(len(s)) {
		end = int64(len(s))
	}
	return fuse.ReadResultData([]byte(s[off:end])), 0
}

func (a *attrNode) Write(ctx context.Context, f fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	if a.store == nil {
		return 0, syscall.EACCES
	}
	// Like sysfs, each write(2) is one store call whatever the offset.
	if errno := a.store(ctx, data); errno != 0 {
		return 0, errno
	}
	return uint32(len(data)), 0
}

func (a *attrNode) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | a.mode
	out.Size = sysfsSize
	out.Nlink = 1
	return 0
}

// Setattr accepts truncation so that a shell's "echo x > attr" (O_TRUNC)
// works, as it does on sysfs; the attribute itself is unaffected.
func (a *attrNode) Setattr(ctx context.Context, f fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	return a.Getattr(ctx, f, out)
}

// dirNode is a plain directory whose children are managed by the model.
type dirNode struct {
	fs.Inode
}

// rootNode builds the tree when go-fuse mounts it.
type rootNode struct {
	fs.Inode
	srv *Server
}

var _ fs.NodeOnAdder = (*rootNode)(nil)

func (r *rootNode) OnAdd(ctx context.Context) {
	r.srv.build(ctx, &r.Inode)
}

// mkdir returns the child directory name of parent, creating it if needed.
func mkdir(ctx context.Context, parent *fs.Inode, name string) *fs.Inode {
	if ch := parent.GetChild(name); ch != nil {
		return ch
	}
	ch := parent.NewPersistentInode(ctx, &dirNode{}, fs.StableAttr{Mode: syscall.S_IFDIR})
	parent.AddChild(name, ch, false)
	return ch
}

// mkpath creates each directory of a slash-free path list under parent.
func mkpath(ctx context.Context, parent *fs.Inode, names ...string) *fs.Inode {
	for _, n := range names {
		parent = mkdir(ctx, parent, n)
	}
	return parent
}

func addFile(ctx context.Context, parent *fs.Inode, name string, a *attrNode) {
	ch := parent.NewPersistentInode(ctx, a, fs.StableAttr{Mode: syscall.S_IFREG})
	parent.AddChild(name, ch, true)
}

func addLink(ctx context.Context, parent *fs.Inode, name, target string) {
	ch := parent.NewPersistentInode(ctx, &fs.MemSymlink{Data: []byte(target)}, fs.StableAttr{Mode: syscall.S_IFLNK})
	parent.AddChild(name, ch, true)
}
