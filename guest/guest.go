// Package guest is vmflow's small real guest: a Debian cloud kernel and an
// initramfs holding a static Go init (guest/init) that powers the VM off when
// the ACPI power button is pressed. It makes the graceful step of the stop
// ladder real in tests: QMP system_powerdown → the guest powers off → QEMU
// exits by itself. Given NetParam it also configures eth0 and serves
// ProbePort, so the VM's network can be checked from both ends.
//
// The artefacts are built by package vmflow/guest/build (`make guest`). This
// package holds only what the host side needs to drive such a guest: the
// kernel command line and the lines the init prints on the serial console.
package guest

const (
	// UpLine is printed on the serial console once the init has loaded the
	// ACPI button and evdev modules and has the power button's event device
	// open: from then on a system_powerdown is acted on, not lost.
	UpLine = "vmflow-guest: up"

	// PowerOffLine is printed when the power button press arrives, just
	// before the init syncs and powers the machine off.
	PowerOffLine = "vmflow-guest: power button, powering off"

	// FatalPrefix starts the line the init prints before it powers off on a
	// fatal error (PID 1 must never exit: that is a kernel panic).
	FatalPrefix = "vmflow-guest: fatal: "

	// KernelCmdline sends the console to the first serial port (what QEMU's
	// -serial captures) and makes a kernel panic stop the guest instead of
	// rebooting it (with -no-reboot QEMU then exits).
	KernelCmdline = "console=ttyS0 panic=-1"
)

// The guest's network, for a VM spawned with a network. The agent puts
// NetParam on the kernel command line; the init configures eth0 from it and
// serves ProbePort. (Debian's cloud kernel has no IP_PNP: `ip=` does nothing.)
const (
	// NetParam is the kernel parameter `vmflow.net=<ipv4>/<prefix>,<gateway>`,
	// for example vmflow.net=10.88.0.2/24,10.88.0.1: NetConfig.Param writes
	// it, ParseNetConfig says whether the init can configure a value.
	NetParam = "vmflow.net"

	// ProbePort is the TCP port the init serves once eth0 is up. It writes
	// ProbeHello, then reads one line: "dial <ipv4>:<port>" makes the guest
	// try that TCP connection (bounded by a few seconds) and answer "ok" or
	// "fail <reason>", one line each, so a test can check what the guest can
	// reach as well as what reaches it.
	ProbePort = 7777

	// ProbeHello is the probe server's first line.
	ProbeHello = "vmflow-guest: net ok"

	// The probe's request and reply words: ProbeDial + "<ipv4>:<port>"
	// asks for a connection; the reply is ProbeOK or ProbeFail + a reason.
	ProbeDial = "dial "
	ProbeOK   = "ok"
	ProbeFail = "fail "

	// ProbeMaxLine bounds a request line, its newline excluded.
	ProbeMaxLine = 256

	// NetUpPrefix starts the serial line the init prints once eth0 has its
	// address: "vmflow-guest: net up <ipv4>/<prefix>". The probe port is
	// listening by then, so a connection made after this line is served.
	NetUpPrefix = "vmflow-guest: net up "

	// NetErrorPrefix starts the line the init prints when the network
	// cannot be set up (a malformed NetParam, no eth0, a netlink error).
	// Unlike FatalPrefix the init keeps running without a network: the
	// power button still powers it off.
	NetErrorPrefix = "vmflow-guest: net error: "
)
