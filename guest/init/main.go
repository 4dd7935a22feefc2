// Command init is PID 1 of vmflow's small real guest. It mounts /proc, /sys
// and /dev, loads the kernel modules shipped in the initramfs (the ACPI
// button and evdev drivers, the virtio NIC drivers), says it is up on the
// serial console, and powers the machine off when the ACPI power button is
// pressed, which is what QMP system_powerdown does. That makes the graceful
// step of the host's stop ladder real: the guest acts on the button and QEMU
// exits by itself.
//
// With guest.NetParam on the kernel command line it also configures eth0
// and serves the probe port (package probe); a network that fails is
// reported and left alone, never a reason to stop.
//
// PID 1 must never exit (the kernel panics), so every fatal error is printed
// and followed by a power-off. Built static (CGO_ENABLED=0) by
// vmflow/guest/build; it only makes sense as /init inside the guest.
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"vmflow/guest"
	"vmflow/guest/init/evdev"
	"vmflow/guest/init/netcfg"
	"vmflow/guest/init/probe"
)

const (
	modulesDir  = "/lib/modules"
	inputClass  = "/sys/class/input"
	powerButton = "Power Button"

	// findTimeout bounds the wait for the power button's input device:
	// button.ko registers it during its init, but the event handler's
	// device node may show up a moment later.
	findTimeout = 10 * time.Second

	// netIface is the NIC the agent gives a VM: the kernel's first
	// Ethernet name (no udev renames it here).
	netIface = "eth0"
	// netTimeout bounds the network setup, mostly the wait for eth0,
	// which virtio_net registers as it probes the device.
	netTimeout = 10 * time.Second
)

func main() {
	defer func() {
		// A panic in main must not end PID 1: report it and power off.
		if r := recover(); r != nil {
			fatal(fmt.Errorf("panic: %v", r))
		}
	}()
	if err := run(); err != nil {
		fatal(err)
	}
	powerOff()
}

// run returns only when the machine should power off: nil after a power
// button press, an error on anything that keeps the init from doing its job.
func run() error {
	if err := mountAll(); err != nil {
		return err
	}
	ensureConsole()
	if err := loadModules(modulesDir); err != nil {
		return err
	}
	startNetwork()
	nodes, err := waitPowerButtons(inputClass, findTimeout)
	if err != nil {
		return err
	}
	pressed := make(chan error, len(nodes))
	for _, n := range nodes {
		f, err := os.Open(n)
		if err != nil {
			return fmt.Errorf("open power button %s: %w", n, err)
		}
		go func() { pressed <- watchPowerButton(f) }()
	}
	// "up" only once the button is watched: a powerdown sent after this
	// line is never lost.
	say(guest.UpLine)
	if err := <-pressed; err != nil {
		return err
	}
	say(guest.PowerOffLine)
	return nil
}

// startNetwork configures eth0 and serves the probe port, in the
// background, when the kernel command line asks for a network. Nothing it
// meets stops the init: a guest whose network failed still powers off on
// the button, so it is reported with guest.NetErrorPrefix and left.
func startNetwork() {
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		say(guest.NetErrorPrefix + err.Error())
		return
	}
	c, ok, err := guest.NetConfigFromCmdline(string(cmdline))
	if !ok {
		return // no network asked for
	}
	if err != nil {
		say(guest.NetErrorPrefix + err.Error())
		return
	}
	go func() {
		// A panic here must not end PID 1 either; the power button path
		// goes on without the network.
		defer func() {
			if r := recover(); r != nil {
				say(guest.NetErrorPrefix + fmt.Sprintf("panic: %v", r))
			}
		}()
		// Listening before the address exists is fine (the wildcard), and
		// means a client that saw "net up" is served.
		ln, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", guest.ProbePort))
		if err != nil {
			say(guest.NetErrorPrefix + "probe port: " + err.Error())
			return
		}
		if err := netcfg.Up(netIface, c, netTimeout); err != nil {
			_ = ln.Close()
			say(guest.NetErrorPrefix + err.Error())
			return
		}
		say(guest.NetUpPrefix + c.Addr.String())
		err = probe.Serve(context.Background(), ln)
		say(guest.NetErrorPrefix + "probe server: " + err.Error())
	}()
}

func say(line string) {
	// Errors are ignored on purpose: the console is the only place to report them.
	_, _ = fmt.Fprintln(os.Stdout, line)
}

func fatal(err error) {
	say(guest.FatalPrefix + err.Error())
	powerOff()
}

// powerOff never returns: if the reboot syscall fails there is nothing left
// to do but idle, since exiting would panic the kernel.
func powerOff() {
	unix.Sync()
	if err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
		say(guest.FatalPrefix + "power off: " + err.Error())
	}
	for {
		// A sleeping loop, not select{}: with every goroutine blocked the Go
		// runtime would abort with "all goroutines are asleep", ending PID 1.
		time.Sleep(time.Hour)
	}
}

// mountAll mounts the pseudo filesystems the init reads, /dev too (Debian's
// CONFIG_DEVTMPFS_MOUNT is off); EBUSY means already mounted.
func mountAll() error {
	for _, m := range []struct{ src, dir, fstype string }{
		{"proc", "/proc", "proc"},
		{"sysfs", "/sys", "sysfs"},
		{"devtmpfs", "/dev", "devtmpfs"},
	} {
		if err := os.MkdirAll(m.dir, 0o755); err != nil {
			return fmt.Errorf("mkdir %s: %w", m.dir, err)
		}
		err := unix.Mount(m.src, m.dir, m.fstype, unix.MS_NOSUID|unix.MS_NOEXEC, "")
		if err != nil && !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("mount %s on %s: %w", m.fstype, m.dir, err)
		}
	}
	return nil
}

// ensureConsole gives the init a stdout if the kernel could not open
// /dev/console before starting it (the initramfs has the node, unless lost).
func ensureConsole() {
	var st unix.Stat_t
	if unix.Fstat(1, &st) == nil {
		return
	}
	fd, err := unix.Open("/dev/console", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	for _, target := range []int{0, 1, 2} {
		_ = unix.Dup3(fd, target, 0)
	}
	_ = unix.Close(fd)
}

// loadModules loads every *.ko in dir, in name order, which the builder
// makes the dependency order (it numbers the files). EEXIST means the
// module is already there (built in, or loaded): not an error.
func loadModules(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("read %s: %w", dir, err)
	}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".ko") {
			continue
		}
		if err := loadModule(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open module %s: %w", path, err)
	}
	defer f.Close()
	if err := unix.FinitModule(int(f.Fd()), "", 0); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("load module %s: %w", path, err)
	}
	return nil
}

// waitPowerButtons polls until at least one input device named "Power
// Button" has an event node, and returns the nodes' paths.
func waitPowerButtons(class string, timeout time.Duration) ([]string, error) {
	deadline := time.Now().Add(timeout)
	for {
		nodes, err := findPowerButtons(class)
		if err != nil {
			return nil, err
		}
		if len(nodes) > 0 {
			return nodes, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no %q input device with an event node under %s after %s", powerButton, class, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// findPowerButtons returns the event node of every "Power Button" input device
// (ACPI may register two: LNXPWRBN and PNP0C0C), creating a node devtmpfs has
// not made yet from the handler's dev file.
func findPowerButtons(class string) ([]string, error) {
	events, err := filepath.Glob(filepath.Join(class, "event*"))
	if err != nil {
		return nil, fmt.Errorf("glob %s: %w", class, err)
	}
	sort.Strings(events)
	var nodes []string
	for _, ev := range events {
		name, err := os.ReadFile(filepath.Join(ev, "device", "name"))
		if err != nil || strings.TrimSpace(string(name)) != powerButton {
			continue
		}
		dev, err := os.ReadFile(filepath.Join(ev, "dev"))
		if err != nil {
			continue // the handler is going away or not ready: try again later
		}
		major, minor, err := evdev.ParseDevNumber(string(dev))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", ev, err)
		}
		node := filepath.Join("/dev/input", filepath.Base(ev))
		if err := ensureCharNode(node, major, minor); err != nil {
			return nil, err
		}
		nodes = append(nodes, node)
	}
	return nodes, nil
}

func ensureCharNode(path string, major, minor uint32) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("mkdir %s: %w", filepath.Dir(path), err)
	}
	err := unix.Mknod(path, unix.S_IFCHR|0o600, int(unix.Mkdev(major, minor)))
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("mknod %s %d:%d: %w", path, major, minor, err)
	}
	return nil
}

// watchPowerButton reads input events until a power key press arrives
// (nil) or the device fails (an error).
func watchPowerButton(f *os.File) error {
	defer f.Close()
	buf := make([]byte, 64*evdev.Size)
	var pending int
	for {
		n, err := f.Read(buf[pending:])
		if err != nil {
			return fmt.Errorf("read %s: %w", f.Name(), err)
		}
		events, rest := evdev.Parse(buf[:pending+n])
		for _, ev := range events {
			if ev.IsPowerPress() {
				return nil
			}
		}
		// evdev hands out whole events; keep a partial tail just in case.
		pending = copy(buf, rest)
	}
}
