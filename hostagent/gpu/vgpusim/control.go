package vgpusim

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Names of the fault-injection files in the control directory. Each takes
// effect while it exists and is checked at every write, so a test (or an
// operator with a shell) flips faults with touch/echo/rm, no API needed.
const (
	// CtlFailRelease holds an errno name; every release write fails with it.
	CtlFailRelease = "fail-release"
	// CtlBlockRelease makes every release write block until it is removed.
	CtlBlockRelease = "block-release"
	// CtlFailCreate holds an errno name; every create write fails with it.
	CtlFailCreate = "fail-create"
	// CtlFailUnbind holds an errno name; every PCI driver unbind write
	// fails with it, with nothing changed.
	CtlFailUnbind = "fail-unbind"
	// CtlBlockUnbind makes every PCI driver unbind block, after the
	// driver link is gone, until it is removed.
	CtlBlockUnbind = "block-unbind"
	// CtlFailReset holds an errno name; every PCI reset write fails with it.
	CtlFailReset = "fail-reset"
	// CtlFailProbe makes every drivers_probe leave its function unbound,
	// as a driver whose probe fails does (the write itself succeeds: the
	// kernel ignores a probe's error there).
	CtlFailProbe = "fail-probe"
	// CtlBlockProbe makes every drivers_probe of an unbound function
	// block, holding its device lock as a slow driver probe does, until
	// it is removed.
	CtlBlockProbe = "block-probe"
	// CtlNoIntRemap clears the IOMMU's interrupt-remapping capability
	// (ecap bit 3), as on a host without it.
	CtlNoIntRemap = "no-intremap"
	// CtlUnsafeInterrupts sets vfio_iommu_type1's
	// allow_unsafe_interrupts to Y.
	CtlUnsafeInterrupts = "unsafe-interrupts"
)

// At names the per-device form of a PCI control file (CtlFailUnbind,
// CtlBlockUnbind, CtlFailReset, CtlFailProbe, CtlBlockProbe): "fail-unbind@0000:81:00.0"
// acts on that function alone, so a test can show one bad card beside a
// healthy one. The global file still acts on every function.
func At(name, addr string) string { return name + "@" + addr }

// blockPoll is how often a blocked write re-checks its block file (or a
// device node's holders). The
// control directory is a plain directory on the real file system; polling
// keeps the simulator free of inotify and works on any file system.
const blockPoll = 10 * time.Millisecond

// holderPoll is how often an unbind waiting for a device node's users
// looks again: each look reads every process's descriptors.
const holderPoll = 100 * time.Millisecond

// errnoNames are the errno names a control file may hold.
var errnoNames = map[string]syscall.Errno{
	"EBUSY":     syscall.EBUSY,
	"EIO":       syscall.EIO,
	"EAGAIN":    syscall.EAGAIN,
	"ENODEV":    syscall.ENODEV,
	"EINVAL":    syscall.EINVAL,
	"ENOENT":    syscall.ENOENT,
	"EEXIST":    syscall.EEXIST,
	"ENOSPC":    syscall.ENOSPC,
	"EUSERS":    syscall.EUSERS,
	"EPERM":     syscall.EPERM,
	"EACCES":    syscall.EACCES,
	"EINTR":     syscall.EINTR,
	"ENOMEM":    syscall.ENOMEM,
	"ETIMEDOUT": syscall.ETIMEDOUT,
}

// ParseErrno turns an errno name ("EBUSY") or number into an Errno; anything
// else is EIO, so an existing fault file always fails the write.
func ParseErrno(s string) syscall.Errno {
	s = strings.ToUpper(strings.TrimSpace(s))
	if e, ok := errnoNames[s]; ok {
		return e
	}
	if n, err := strconv.Atoi(s); err == nil && n > 0 && n < 512 {
		return syscall.Errno(n)
	}
	return syscall.EIO
}

// control reads the fault-injection directory. The zero value (no dir)
// injects nothing.
type control struct {
	dir string
}

// fault returns the errno held in file name, or 0 when the file is absent.
func (c control) fault(name string) syscall.Errno {
	if c.dir == "" || name == "" {
		return 0
	}
	b, err := os.ReadFile(filepath.Join(c.dir, name))
	if err != nil {
		return 0 // absent (or unreadable): no fault
	}
	return ParseErrno(string(b))
}

// faultAt is fault of name, else of its per-device form for addr.
func (c control) faultAt(name, addr string) syscall.Errno {
	if e := c.fault(name); e != 0 {
		return e
	}
	return c.fault(At(name, addr))
}

// existsAt is exists of name or of its per-device form for addr.
func (c control) existsAt(name, addr string) bool {
	return c.exists(name) || c.exists(At(name, addr))
}

// exists reports whether control file name exists ("" never does).
func (c control) exists(name string) bool {
	if c.dir == "" || name == "" {
		return false
	}
	_, err := os.Lstat(filepath.Join(c.dir, name))
	return err == nil
}
