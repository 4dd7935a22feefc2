package vmm

import (
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"vmflow/internal/errdefs"
)

// The jail: QEMU in namespaces of its own (network, mount, pid, IPC, UTS)
// and a root holding only what it needs. Go's exec has no hook between fork
// and exec, so the agent's own binary is exec'd first as a small setup stage
// (JailSetupCommand), forked by the agent with the new namespaces
// (clone flags), in a session of its own, still root: it waits until the
// agent has recorded its pid and placed it in its cgroup, builds the root
// on a tmpfs (binds read-only of QEMU's binary, its libraries, Debian's
// module folder and its firmware; a fresh procfs; a /dev of null, zero,
// urandom and, when used, kvm and the VFIO nodes), pivot_roots into it,
// lowers its rlimits, closes every descriptor but QEMU's, drops to QEMU's uid
// and gid with no capabilities left, installs vmflow's seccomp allowlist
// (seccomp.go) and execs QEMU in place. QEMU is the
// process the agent forked and reaps, PID 1 of its pid namespace, with no
// init in between. Firecracker's jailer works the same way (chroot +
// pivot_root, namespaces, cgroup, rlimits, then exec of the VMM); libvirt
// gives QEMU a private mount namespace with its own /dev.

// JailSetupCommand is the agent subcommand that is the setup stage
// (vmflow-hostagent qemu-jail CONFIG -- QEMU ARGV...). Not for people.
const JailSetupCommand = "qemu-jail"

// jailCloneflags are the namespaces QEMU gets: no route to the host's
// network (its own loopback only, down), mounts, pids, System V IPC and
// hostname of its own.
const jailCloneflags = syscall.CLONE_NEWNET | syscall.CLONE_NEWNS | syscall.CLONE_NEWPID |
	syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS

// Jail says how to jail a launch.
type Jail struct {
	// Setup is the binary exec'd as the setup stage: the agent's own
	// (os.Executable), run with JailSetupCommand.
	Setup string
	// Dir is an empty directory the root is mounted on (in the jail's own
	// mount namespace only); the launch creates it.
	Dir string
	// DevRoot is where the host's VFIO nodes are (<DevRoot>/vfio/...);
	// they appear in the jail at /dev/vfio/. Empty: /dev.
	DevRoot string
}

// jailConfig is what the setup stage is told, as JSON in its argv (nothing
// secret: the same as QEMU's own argv).
type jailConfig struct {
	Root     string      `json:"root"`
	UID      uint32      `json:"uid"`
	Groups   []uint32    `json:"groups"`
	Binds    []string    `json:"binds"`     // files and folders bound read-only at their own paths
	Symlinks [][2]string `json:"symlinks"`  // path, target: the host's links on the way to each bind (/lib64 -> usr/lib64)
	Devices  [][2]string `json:"devices"`   // host node, path in the jail under /dev: bound read-write
	NFiles   int         `json:"n_files"`   // descriptors QEMU keeps: 0..NFiles-1
	SyncFD   int         `json:"sync_fd"`   // read one byte from it before building the root
	Limits   Limits      `json:"limits"`    //
	Env      []string    `json:"env"`       // QEMU's whole environment
	Hostname string      `json:"hostname"`  //
	SysBinds []string    `json:"sys_binds"` // the claimed devices' own sysfs folders, read-only at their real paths
	SysDirs  []string    `json:"sys_dirs"`  // empty folders their subsystem links resolve to
	SysLinks [][2]string `json:"sys_links"` // path QEMU is given, its real folder
}

// qemuDataDirs are the folders QEMU 7.2 from Debian reads besides its
// libraries: the module folder (TCG itself is a module there), firmware.
var qemuDataDirs = []string{
	"/usr/lib/x86_64-linux-gnu/qemu",
	"/usr/share/qemu",
	"/usr/share/seabios",
	"/usr/lib/ipxe/qemu",
}

// libDirs are where an ELF's DT_NEEDED libraries are looked up (Debian's
// multiarch layout first).
var libDirs = []string{
	"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib",
}

// jailFiles lists, as real paths (binds land at their own paths), what QEMU
// binary bin needs in its root: binary, interpreter, libraries, modules whose
// libraries are installed, firmware; and the symlinks on the way to recreate.
func jailFiles(bin string) ([]string, [][2]string, error) {
	seen := map[string]bool{}
	links := map[string]string{}
	var out []string
	add := func(p string) {
		symlinkChain(p, links)
		if real, err := filepath.EvalSymlinks(p); err == nil && !seen[real] {
			seen[real] = true
			out = append(out, real)
		}
	}
	var walk func(path string, required bool) error
	walk = func(path string, required bool) error {
		real, err := filepath.EvalSymlinks(path)
		if err != nil {
			return err
		}
		if seen[real] {
			return nil
		}
		f, err := elf.Open(real)
		if err != nil {
			return fmt.Errorf("jail: read %s: %w", real, err)
		}
		defer f.Close()
		add(real)
		for _, p := range f.Progs {
			if p.Type == elf.PT_INTERP {
				b := make([]byte, p.Filesz)
				if _, err := p.ReadAt(b, 0); err == nil {
					add(strings.TrimRight(string(b), "\x00"))
				}
			}
		}
		libs, err := f.ImportedLibraries()
		if err != nil {
			return fmt.Errorf("jail: libraries of %s: %w", real, err)
		}
		for _, lib := range libs {
			found := ""
			for _, d := range libDirs {
				if _, err := os.Stat(filepath.Join(d, lib)); err == nil {
					found = filepath.Join(d, lib)
					break
				}
			}
			if found == "" {
				if required {
					return errdefs.Misconfigured.Errorf("jail: %s needs %s, found in none of %v", real, lib, libDirs)
				}
				continue
			}
			symlinkChain(found, links)
			if err := walk(found, required); err != nil {
				return err
			}
		}
		return nil
	}
	symlinkChain(bin, links)
	if interp, ok := scriptInterpreter(bin); ok {
		// A --qemu that is a script (a wrapper adding options): its
		// interpreter, its own folder (what it names beside itself) and
		// the QEMU on PATH it execs.
		symlinkChain(interp, links)
		if err := walk(interp, true); err != nil {
			return nil, nil, err
		}
		if real, err := filepath.EvalSymlinks(bin); err == nil {
			add(filepath.Dir(real))
		}
		qemu, err := exec.LookPath(DefaultBinary)
		if err != nil {
			return nil, nil, fmt.Errorf("jail: %s is a script: %w", bin, err)
		}
		bin = qemu
		symlinkChain(bin, links)
	}
	if err := walk(bin, true); err != nil {
		return nil, nil, err
	}
	for _, d := range qemuDataDirs {
		if _, err := os.Stat(d); err != nil {
			continue
		}
		add(d)
		if d != qemuDataDirs[0] {
			continue
		}
		mods, _ := filepath.Glob(filepath.Join(d, "*.so"))
		for _, m := range mods {
			if err := walk(m, false); err != nil {
				continue // an unreadable module: QEMU fails to load it, not to start
			}
		}
	}
	if _, err := os.Stat("/etc/ld.so.cache"); err == nil {
		add("/etc/ld.so.cache")
	}
	// A bound folder covers what lies in it.
	slices.Sort(out)
	var kept []string
	for _, p := range out {
		if n := len(kept); n > 0 && strings.HasPrefix(p, kept[n-1]+"/") {
			continue
		}
		kept = append(kept, p)
	}
	var ls [][2]string
	for p, t := range links {
		ls = append(ls, [2]string{p, t})
	}
	slices.SortFunc(ls, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	return kept, ls, nil
}

// scriptInterpreter is the interpreter of a "#!" script, false for
// anything else (an ELF binary).
func scriptInterpreter(path string) (string, bool) {
	f, err := os.Open(path)
	if err != nil {
		return "", false
	}
	defer f.Close()
	buf := make([]byte, 256)
	n, _ := f.Read(buf)
	line, _, _ := strings.Cut(string(buf[:n]), "\n")
	rest, ok := strings.CutPrefix(line, "#!")
	if !ok {
		return "", false
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return "", false
	}
	return fields[0], true
}

// symlinkChain records in links every symlink met on the way to path (each
// component, then the targets' components), as the kernel follows them.
func symlinkChain(path string, links map[string]string) {
	for range 40 { // ELOOP's bound
		parts := strings.Split(strings.TrimPrefix(filepath.Clean(path), "/"), "/")
		cur, next := "/", ""
		for i, part := range parts {
			p := filepath.Join(cur, part)
			fi, err := os.Lstat(p)
			if err != nil {
				return
			}
			if fi.Mode()&fs.ModeSymlink == 0 {
				cur = p
				continue
			}
			t, err := os.Readlink(p)
			if err != nil {
				return
			}
			links[p] = t
			if !filepath.IsAbs(t) {
				t = filepath.Join(cur, t)
			}
			next = filepath.Join(append([]string{t}, parts[i+1:]...)...)
			break
		}
		if next == "" {
			return
		}
		path = next
	}
}

// jailArgv is the setup stage's argv for cfg and QEMU's bin and argv.
func jailArgv(setup string, cfg jailConfig, bin string, argv []string) ([]string, error) {
	b, err := json.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("jail: %w", err)
	}
	return append([]string{setup, JailSetupCommand, string(b), "--", bin}, argv...), nil
}

// JailMain is the setup stage (JailSetupCommand), args CONFIG -- QEMU ARGV; it
// returns only on failure, having said why on stderr (QEMU's log).
func JailMain(args []string) int {
	// Capabilities and the ambient set are per thread: everything from the
	// drop to the exec happens on this one.
	runtime.LockOSThread()
	if err := jailSetup(args); err != nil {
		fmt.Fprintf(os.Stderr, "vmflow jail: %v\n", err)
		return 1
	}
	return 0 // not reached: jailSetup execs QEMU
}

func jailSetup(args []string) error {
	if len(args) < 3 || args[1] != "--" {
		return errors.New("usage: qemu-jail CONFIG -- QEMU ARGV")
	}
	var cfg jailConfig
	if err := json.Unmarshal([]byte(args[0]), &cfg); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	bin, argv := args[2], args[2:]
	if cfg.UID == 0 {
		return ErrNoQEMUUID
	}
	// The root first, while the agent records the pid and places this
	// process in the VM's cgroup (whose first cgroup.procs write in a
	// while waits out an RCU grace period, about 10 ms here): it is all in
	// this process's own namespaces, seen by nobody else, and gone with it.
	if err := buildRoot(cfg); err != nil {
		return err
	}
	if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
		return fmt.Errorf("hostname: %w", err)
	}
	if err := setLimits(cfg.Limits); err != nil {
		return err
	}
	// The agent writes a byte once the pid is recorded and the cgroup
	// made; EOF means it gave up: never start QEMU then.
	goAhead := os.NewFile(uintptr(cfg.SyncFD), "sync")
	var one [1]byte
	if n, err := goAhead.Read(one[:]); n != 1 {
		return fmt.Errorf("waiting for the agent: %w", errors.Join(err, errors.New("no go-ahead")))
	}
	goAhead.Close()
	// Close-on-exec rather than closed: the setup stage's own runtime
	// (its netpoller's epoll descriptor) runs until the exec.
	if err := unix.CloseRange(uint(cfg.NFiles), ^uint(0), closeRangeCloexec); err != nil {
		return fmt.Errorf("close descriptors: %w", err)
	}
	if err := dropPrivileges(cfg.UID, cfg.Groups); err != nil {
		return err
	}
	// Last, on this locked thread: from here only the exec is made, and
	// QEMU starts under the allowlist (seccomp.go).
	if err := installQEMUSeccomp(); err != nil {
		return err
	}
	if err := unix.Exec(bin, argv, cfg.Env); err != nil {
		return fmt.Errorf("exec %s: %w", bin, err)
	}
	return nil
}

// buildRoot makes cfg.Root QEMU's root and pivots into it.
func buildRoot(cfg jailConfig) error {
	// Nothing mounted here propagates back to the host.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	root := cfg.Root
	if err := unix.Mount("vmflow-jail", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=1m"); err != nil {
		return fmt.Errorf("tmpfs on %s: %w", root, err)
	}
	// The binds are at real paths (no symlink on the way), so they go
	// first; the links then lead to them.
	for _, p := range append(slices.Clone(cfg.Binds), cfg.SysBinds...) {
		if err := bindInto(root, p, p, true, 0); err != nil {
			return err
		}
	}
	for _, d := range cfg.SysDirs {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return fmt.Errorf("sysfs folder %s: %w", d, err)
		}
	}
	for _, l := range append(slices.Clone(cfg.Symlinks), cfg.SysLinks...) {
		at := filepath.Join(root, l[0])
		if err := os.MkdirAll(filepath.Dir(at), 0o755); err != nil {
			return fmt.Errorf("symlink %s: %w", l[0], err)
		}
		if err := os.Symlink(l[1], at); err != nil {
			return fmt.Errorf("symlink %s: %w", l[0], err)
		}
	}
	dev := filepath.Join(root, "dev")
	if err := os.Mkdir(dev, 0o755); err != nil {
		return fmt.Errorf("mkdir /dev: %w", err)
	}
	if err := unix.Mount("vmflow-dev", dev, "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "mode=0755,size=64k"); err != nil {
		return fmt.Errorf("tmpfs on /dev: %w", err)
	}
	for _, d := range append([][2]string{{"/dev/null", "/dev/null"}, {"/dev/zero", "/dev/zero"}, {"/dev/urandom", "/dev/urandom"}}, cfg.Devices...) {
		if err := bindInto(root, d[0], d[1], false, unix.MS_NOSUID|unix.MS_NOEXEC); err != nil {
			return err
		}
	}
	old := filepath.Join(root, ".old")
	if err := os.Mkdir(old, 0o700); err != nil {
		return fmt.Errorf("mkdir .old: %w", err)
	}
	if err := unix.PivotRoot(root, old); err != nil {
		return fmt.Errorf("pivot_root %s: %w", root, err)
	}
	if err := unix.Chdir("/"); err != nil {
		return fmt.Errorf("chdir /: %w", err)
	}
	if err := unix.Unmount("/.old", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the host's root: %w", err)
	}
	if err := os.Remove("/.old"); err != nil {
		return fmt.Errorf("remove .old: %w", err)
	}
	// A procfs of QEMU's own pid namespace: kernels and initrds are
	// /proc/self/fd/N.
	if err := os.Mkdir("/proc", 0o555); err != nil {
		return fmt.Errorf("mkdir /proc: %w", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "hidepid=2"); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	// The root itself read-only from here: nothing of QEMU's is written
	// by path.
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=1m"); err != nil {
		return fmt.Errorf("remount / read-only: %w", err)
	}
	return nil
}

// bindInto binds host path src at dst inside root (read-only when ro),
// creating the mount point as a file or folder like src.
func bindInto(root, src, dst string, ro bool, flags uintptr) error {
	fi, err := os.Stat(src)
	if err != nil {
		return fmt.Errorf("bind %s: %w", src, err)
	}
	target := filepath.Join(root, dst)
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return fmt.Errorf("bind %s: %w", src, err)
	}
	if fi.IsDir() {
		err = os.Mkdir(target, 0o755)
	} else {
		var f *os.File
		if f, err = os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644); err == nil {
			err = f.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("bind %s: mount point: %w", src, err)
	}
	if err := unix.Mount(src, target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s: %w", src, err)
	}
	rf := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_NOSUID)
	if ro {
		rf |= unix.MS_RDONLY
	}
	if err := unix.Mount("", target, "", rf|flags, ""); err != nil {
		return fmt.Errorf("bind %s: remount: %w", src, err)
	}
	return nil
}

// setLimits lowers the setup stage's rlimits, soft and hard, to QEMU's
// (lowering one's own needs no capability); they survive the exec.
func setLimits(l Limits) error {
	for _, r := range []struct {
		res int
		v   uint64
	}{
		{unix.RLIMIT_MEMLOCK, l.Memlock}, {unix.RLIMIT_NPROC, l.NProc}, {unix.RLIMIT_FSIZE, l.FSize},
		{unix.RLIMIT_NOFILE, l.NoFile}, {unix.RLIMIT_CORE, 0},
	} {
		if err := unix.Setrlimit(r.res, &unix.Rlimit{Cur: r.v, Max: r.v}); err != nil {
			return fmt.Errorf("rlimit %d: %w", r.res, err)
		}
	}
	return nil
}

// dropPrivileges makes every thread uid:uid with only groups, then clears the
// ambient capabilities (file capabilities are ignored under no_new_privs).
func dropPrivileges(uid uint32, groups []uint32) error {
	gs := make([]int, len(groups))
	for i, g := range groups {
		gs[i] = int(g)
	}
	if err := syscall.Setgroups(gs); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setresgid(int(uid), int(uid), int(uid)); err != nil {
		return fmt.Errorf("setresgid: %w", err)
	}
	if err := syscall.Setresuid(int(uid), int(uid), int(uid)); err != nil {
		return fmt.Errorf("setresuid: %w", err)
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}

// jailCmd is the setup stage's command for a launch of bin with argv under
// limits, QEMU keeping files as fds 3.. (ExtraFiles) and nothing else.
func (l *launch) jailCmd(j Jail, bin string, argv []string, limits Limits, files []*os.File) (*exec.Cmd, error) {
	spec, c := l.cfg.Spec, l.cfg.Confine
	jf, err := jailFilesCached(bin)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(j.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("jail: %w", err)
	}
	cfg := jailConfig{
		Root: j.Dir, UID: c.UID, Groups: []uint32{}, Binds: jf.binds, Symlinks: jf.links,
		NFiles: firstInheritedFD + len(files), Limits: limits, Env: qemuEnv(), Hostname: "vmflow",
	}
	if spec.Accel == AccelKVM {
		cfg.Groups = append(cfg.Groups, c.KVM.GID)
		cfg.Devices = append(cfg.Devices, [2]string{DefaultKVMDevice, DefaultKVMDevice})
	}
	if len(spec.VFIO) > 0 {
		devRoot := j.DevRoot
		if devRoot == "" {
			devRoot = "/dev"
		}
		cfg.Devices = append(cfg.Devices, [2]string{filepath.Join(devRoot, "vfio", "vfio"), "/dev/vfio/vfio"})
		for _, p := range spec.VFIO {
			node, err := VFIOGroupNode(devRoot, p)
			if err != nil {
				return nil, fmt.Errorf("jail: %w", err)
			}
			if node != "" {
				cfg.Devices = append(cfg.Devices, [2]string{node, filepath.Join("/dev/vfio", filepath.Base(node))})
			}
		}
		if cfg.SysBinds, cfg.SysDirs, cfg.SysLinks, err = sysView(spec.VFIO); err != nil {
			return nil, fmt.Errorf("jail: %w", err)
		}
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("jail: sync pipe: %w", err)
	}
	l.syncRead, l.goAhead = r, w
	cfg.SyncFD = cfg.NFiles // the pipe follows QEMU's files; closed before the exec
	args, err := jailArgv(j.Setup, cfg, bin, argv)
	if err != nil {
		return nil, err
	}
	return &exec.Cmd{
		Path: j.Setup, Args: args, Env: qemuEnv(), Dir: "/",
		ExtraFiles:  append(slices.Clone(files), r),
		SysProcAttr: &syscall.SysProcAttr{Cloneflags: jailCloneflags},
	}, nil
}

// sysView is the /sys a QEMU with these VFIO devices sees: each device's own
// folder, its given path linked to it and an empty subsystem target; not the
// parent GPU, other VMs' mdevs or the rest of sysfs.
func sysView(devices []string) (binds, dirs []string, links [][2]string, err error) {
	for _, p := range devices {
		real, err := filepath.EvalSymlinks(p)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("device %s: %w", p, err)
		}
		binds = append(binds, real)
		if real != p {
			links = append(links, [2]string{p, real})
		}
		sub, err := filepath.EvalSymlinks(filepath.Join(real, "subsystem"))
		switch {
		case err == nil:
			dirs = append(dirs, sub)
		case !errors.Is(err, fs.ErrNotExist):
			return nil, nil, nil, fmt.Errorf("device %s: subsystem: %w", p, err)
		}
	}
	return binds, dirs, links, nil
}

var jailFilesCache sync.Map // QEMU binary path -> jailFileSet

type jailFileSet struct {
	binds []string
	links [][2]string
}

// jailFilesCached is jailFiles, once per binary for the agent's life: a QEMU
// upgrade needs an agent restart, as always.
func jailFilesCached(bin string) (jailFileSet, error) {
	if v, ok := jailFilesCache.Load(bin); ok {
		return v.(jailFileSet), nil
	}
	binds, links, err := jailFiles(bin)
	if err != nil {
		return jailFileSet{}, err
	}
	set := jailFileSet{binds, links}
	jailFilesCache.Store(bin, set)
	return set, nil
}
