package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmflow/guest"
	"vmflow/guest/build"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/vmm"
	"vmflow/hostagent/vmm/vmmtest"
	"vmflow/testsupport/stacktest"
)

// vmKind is one VM type of the stop table.
type vmKind struct {
	name string
	spec vmm.VMSpec
	// boots: wait for the guest's init on the serial console before the
	// stop (the ACPI button means nothing to a kernel still booting).
	boots bool
	// raw is the QMP command the raw baseline sends.
	raw string
	// cfg is the ladder vmflow runs.
	cfg vmm.StopConfig
	// kernel and initrd are opened into the spec for each launch (QEMU is
	// given the files, never their paths; Launch closes them).
	kernel, initrd string
}

// vmSpec is the kind's spec with its boot files opened.
func (k vmKind) vmSpec() (vmm.VMSpec, error) {
	s := k.spec
	if k.kernel == "" {
		return s, nil
	}
	var err error
	if s.Kernel, err = os.Open(k.kernel); err != nil {
		return s, err
	}
	if s.Initrd, err = os.Open(k.initrd); err != nil {
		s.Kernel.Close()
		return s, err
	}
	return s, nil
}

// shortDir is a fresh folder under /tmp (a QMP socket path holds at most
// 107 bytes), removed when t ends.
var shortDir = proctest.ShortDir

func paths(dir string) vmm.Paths {
	return vmm.Paths{QMPSocket: filepath.Join(dir, "qmp.sock"), PIDFile: filepath.Join(dir, "qemu.pid"), Log: filepath.Join(dir, "qemu.log")}
}

// waitConsole waits until QEMU's log holds line, polling it every 20 ms
// until ctx's deadline.
func waitConsole(ctx context.Context, log, line string) error {
	return pollUntilErr(ctx, 20*time.Millisecond, func() bool {
		b, err := os.ReadFile(log)
		return err == nil && strings.Contains(string(b), line)
	}, func() string {
		b, _ := os.ReadFile(log)
		if len(b) > 400 {
			b = b[len(b)-400:]
		}
		return fmt.Sprintf("waiting for %q in %s; tail: %q", line, log, b)
	})
}

// pollUntilErr is pollUntil with a description of what was awaited.
func pollUntilErr(ctx context.Context, every time.Duration, cond func() bool, what func() string) error {
	if err := stacktest.PollUntil(ctx, every, cond); err != nil {
		return fmt.Errorf("%s: %w", what(), err)
	}
	return nil
}

// stopVmflow launches kind with vmm.Launch and times vm.Stop (the ladder,
// reusing the launch's QMP connection, until the group is gone and reaped).
func stopVmflow(t *testing.T, kind vmKind) (time.Duration, error) {
	dir := shortDir(t, "vfb")
	p := paths(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec, err := kind.vmSpec()
	if err != nil {
		return 0, fmt.Errorf("open boot files: %w", err)
	}
	vm, err := vmm.Launch(ctx, vmm.LaunchConfig{Spec: spec, Paths: p, ReadyTimeout: 30 * time.Second,
		Confine: vmmtest.Confine()}) // confined as the agent launches it
	if err != nil {
		return 0, fmt.Errorf("launch: %w", err)
	}
	defer vm.Close()
	// Whatever happens below, nothing of this VM outlives the round.
	defer func() {
		if gone, _ := vm.Exited(); !gone {
			_, _ = vm.Stop(context.Background(), vmm.StopConfig{From: vmm.StepQuitSent, QuitTimeout: time.Nanosecond})
		}
	}()
	if kind.boots {
		if err := waitConsole(ctx, p.Log, guest.UpLine); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	res, err := vm.Stop(ctx, kind.cfg)
	d := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("stop: %w", err)
	}
	if res.Reached != vmm.StepGone {
		return 0, fmt.Errorf("stop reached %s", res.Reached)
	}
	// The ladder must have ended on its first step: a fall-through to
	// quit or SIGKILL would measure a timeout, not vmflow's overhead.
	if len(res.Steps) == 0 || !res.Steps[0].Exited || res.Steps[0].Via != "qmp" {
		return 0, fmt.Errorf("ladder did not end on its first step: %+v", res.Steps)
	}
	return d, nil
}

// stopRaw starts the same QEMU command line by hand, connects a minimal
// QMP client, and times the raw action: the command, then a pidfd wait for
// the whole thread group.
// rawVM is a QEMU started by hand from vmm.Argv, as vmflow would run it
// but without vmflow: the floor the benchmarks hold vmflow against.
type rawVM struct {
	child *proc.Child
	h     *proc.Handle
	q     *RawQMP
	log   string
	// ready is how long from the fork to QMP past qmp_capabilities.
	ready time.Duration
}

// close kills and reaps the VM: nothing outlives the round.
func (r *rawVM) close(t *testing.T) {
	if r.q != nil {
		r.q.Close()
	}
	_ = r.h.Signal(syscall.SIGKILL)
	select {
	case <-r.child.Done():
	case <-time.After(30 * time.Second):
		t.Errorf("raw QEMU %v not reaped 30 s after SIGKILL", r.child.Identity())
	}
	r.h.Close()
}

// startRaw starts kind's QEMU by hand and connects a minimal QMP client.
func startRaw(ctx context.Context, t *testing.T, kind vmKind) (*rawVM, error) {
	dir := shortDir(t, "vfb")
	p := paths(dir)
	spec, err := kind.vmSpec()
	if err != nil {
		return nil, fmt.Errorf("open boot files: %w", err)
	}
	defer spec.Close()
	var fds vmm.FDTable
	argv, err := vmm.BuildArgv(spec, p, &fds)
	if err != nil {
		return nil, fmt.Errorf("argv: %w", err)
	}
	// The argv's QMP is a listener passed as fd vmm.QMPFD, as vmflow binds
	// it: bind one the same way.
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: p.QMPSocket, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("qmp listener: %w", err)
	}
	l.SetUnlinkOnClose(false)
	lf, err := l.File()
	l.Close()
	if err != nil {
		return nil, fmt.Errorf("qmp listener: %w", err)
	}
	defer lf.Close()
	if err := fds.Fill(vmm.QMPFD, lf); err != nil {
		return nil, err
	}
	bin, err := exec.LookPath(vmm.DefaultBinary)
	if err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	logf, err := os.Create(p.Log)
	if err != nil {
		return nil, fmt.Errorf("log: %w", err)
	}
	cmd := exec.Command(bin, argv...)
	cmd.Stdout, cmd.Stderr, cmd.ExtraFiles = logf, logf, fds.Files()
	began := time.Now()
	child, err := proc.Start(cmd) // reaps it in the background
	logf.Close()
	if err != nil {
		return nil, fmt.Errorf("start qemu: %w", err)
	}
	h, err := proc.Open(child.Identity())
	if err != nil {
		_ = syscall.Kill(child.Identity().PID, syscall.SIGKILL)
		return nil, fmt.Errorf("pidfd: %w", err)
	}
	r := &rawVM{child: child, h: h, log: p.Log}
	if r.q, err = DialRawQMP(ctx, p.QMPSocket); err != nil {
		r.close(t)
		return nil, err
	}
	r.ready = time.Since(began)
	return r, nil
}

func stopRaw(t *testing.T, kind vmKind) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := startRaw(ctx, t, kind)
	if err != nil {
		return 0, err
	}
	defer r.close(t)
	if kind.boots {
		if err := waitConsole(ctx, r.log, guest.UpLine); err != nil {
			return 0, err
		}
	}
	start := time.Now()
	if err := r.q.Execute(ctx, kind.raw); err != nil && !errors.Is(err, ErrQMPClosed) {
		return 0, err
	}
	if err := r.h.Wait(ctx); err != nil {
		return 0, fmt.Errorf("wait for group: %w", err)
	}
	return time.Since(start), nil
}

// rawStartToReady is the floor of a launch: kind's QEMU started by hand to
// QMP answering (greeting and qmp_capabilities), n times.
func rawStartToReady(t *testing.T, kind vmKind, n int) ([]time.Duration, error) {
	var out []time.Duration
	for range n {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		r, err := startRaw(ctx, t, kind)
		cancel()
		if err != nil {
			return nil, err
		}
		out = append(out, r.ready)
		r.close(t)
	}
	return out, nil
}

func stopToGone(t *testing.T) string {
	if _, err := exec.LookPath(vmm.DefaultBinary); err != nil {
		t.Fatalf("needs %s (make tools installs it): %v", vmm.DefaultBinary, err)
	}
	g, err := guestArtifacts()
	if err != nil {
		t.Fatal(err)
	}
	kinds := []struct {
		kind vmKind
		n    int
	}{
		{vmKind{
			name: "real guest (q35, TCG, 256 MiB)",
			spec: vmm.VMSpec{Name: "bench-guest", VCPUs: 1, MemoryMiB: 256, Machine: vmm.MachineQ35, Accel: vmm.AccelTCG,
				Cmdline: guest.KernelCmdline, SerialToLog: true, NoReboot: true},
			kernel: g.Kernel, initrd: g.Initrd,
			boots: true, raw: "system_powerdown",
			cfg: vmm.StopConfig{GracefulTimeout: 30 * time.Second},
		}, reps(8, 2)},
		{vmKind{
			name: fmt.Sprintf("-machine none (%s, 16 MiB)", vmmtest.Accel()),
			spec: vmm.VMSpec{Name: "bench-none", VCPUs: 1, MemoryMiB: 16, Machine: vmm.MachineNone, Accel: vmmtest.Accel()},
			raw:  "quit",
			cfg:  vmm.StopConfig{SkipPowerdown: true},
		}, reps(40, 5)},
	}
	tab := Table{Header: []string{"VM", "method", "N", "median ms", "p99 ms", "vmflow ÷ raw (median)", "overhead ms (median)"}}
	worst := time.Duration(0)
	for _, k := range kinds {
		var vf, raw []time.Duration
		// Interleaved, so drifting load hits both alike.
		for range k.n {
			d, err := stopVmflow(t, k.kind)
			if err != nil {
				t.Fatalf("%s: vmflow: %v", k.kind.name, err)
			}
			vf = append(vf, d)
			d, err = stopRaw(t, k.kind)
			if err != nil {
				t.Fatalf("%s: raw: %v", k.kind.name, err)
			}
			raw = append(raw, d)
		}
		sv, sr := Summarize(vf), Summarize(raw)
		over := sv.Median - sr.Median
		worst = max(worst, over)
		ladder := "vmflow `vm.Stop`: powerdown → (gone)"
		if k.kind.cfg.SkipPowerdown {
			ladder = "vmflow `vm.Stop` (SkipPowerdown): quit → (gone)"
		}
		tab.Add(k.kind.name, ladder, fmt.Sprint(sv.N), MS(sv.Median), MS(sv.P99), Ratio(sv.Median, sr.Median), MS(over))
		tab.Add(k.kind.name, "raw: QMP `"+k.kind.raw+"` + pidfd wait", fmt.Sprint(sr.N), MS(sr.Median), MS(sr.P99), "1.00×", "—")
	}
	var s strings.Builder
	s.WriteString("## 2. Stop to gone\n\n")
	s.WriteString("From the stop call to the whole thread group gone. vmflow: `vmm.Launch` then `vm.Stop` (the stop ladder; it reuses the launch's QMP connection, verifies identity, opens a pidfd, waits for the group and for the reap). Raw: the same `vmm.Argv` command line started by hand, a minimal QMP client already past `qmp_capabilities`, the one command, then `proc.Open(id).Wait` (pidfd). The two alternate, one VM each per round; the guest's stop starts once its init printed `" + guest.UpLine + "` on the serial console.\n\n")
	s.WriteString(tab.Markdown() + "\n")
	s.WriteString("A negative overhead is noise: the TCG guest's own shutdown varies from run to run by more than vmflow adds.\n\n")
	s.WriteString(target("Target: stop overhead under 50 ms over raw (worst VM type, medians)", max(worst, 0), 50*time.Millisecond) + "\n")
	return s.String()
}

// guestArtifacts is the guest `make guest` built; the driver never
// downloads a kernel itself.
func guestArtifacts() (build.Artifacts, error) {
	dir, err := build.DefaultDir()
	if err != nil {
		return build.Artifacts{}, fmt.Errorf("guest dir: %w", err)
	}
	a := build.Artifacts{Dir: dir, Kernel: filepath.Join(dir, build.KernelFile), Initrd: filepath.Join(dir, build.InitrdFile)}
	for _, f := range []string{a.Kernel, a.Initrd} {
		if _, err := os.Stat(f); err != nil {
			return a, fmt.Errorf("guest not built (%w): `make guest` builds it into %s", err, dir)
		}
	}
	return a, nil
}
