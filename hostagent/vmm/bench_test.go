package vmm

import (
	"context"
	"os/exec"
	"testing"
	"time"
)

// BenchmarkLaunchToRunning: fork to QMP query-status "running" for
// -machine none. The stop after each launch is not timed.
func BenchmarkLaunchToRunning(b *testing.B) {
	requiresQEMU(b)
	cfg := testLaunchConfig(b, "bench")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var total time.Duration
	for b.Loop() {
		start := time.Now()
		vm, err := Launch(ctx, cfg)
		total += time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if _, err := vm.Stop(ctx, StopConfig{SkipPowerdown: true}); err != nil {
			b.Fatal(err)
		}
		vm.Close()
		b.StartTimer()
	}
	b.ReportMetric(float64(total.Microseconds())/1000/float64(b.N), "ms/op")
}

// BenchmarkStopToGone: Stop called to the whole thread group gone (and
// reaped) for -machine none. "quit" is the ladder from quit (machine none
// ignores the power button, so a full ladder would only measure the
// graceful timeout); "sigkill" resumes at quit_sent with no quit wait, so it
// measures SIGKILL through the pidfd to group exit.
func BenchmarkStopToGone(b *testing.B) {
	requiresQEMU(b)
	for _, bc := range []struct {
		name string
		cfg  StopConfig
	}{
		{"quit", StopConfig{SkipPowerdown: true}},
		{"sigkill", StopConfig{From: StepQuitSent, QuitTimeout: time.Nanosecond}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			cfg := testLaunchConfig(b, "bench")
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			var total time.Duration
			for b.Loop() {
				b.StopTimer()
				vm, err := Launch(ctx, cfg)
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				start := time.Now()
				res, err := vm.Stop(ctx, bc.cfg)
				total += time.Since(start)
				if err != nil {
					b.Fatal(err)
				}
				if res.Reached != StepGone {
					b.Fatalf("reached %s", res.Reached)
				}
				b.StopTimer()
				vm.Close()
				b.StartTimer()
			}
			b.ReportMetric(float64(total.Microseconds())/1000/float64(b.N), "ms/op")
		})
	}
}

// BenchmarkLimitWrapper: what exec'ing QEMU through the rlimit wrapper
// (LimitWrapper) adds to a launch: fork+exec+wait of /bin/true, directly
// and through the wrapper with a launch's limits. The difference is the
// wrapper's exec.
func BenchmarkLimitWrapper(b *testing.B) {
	wrapper, err := exec.LookPath(LimitWrapper)
	if err != nil {
		b.Skipf("no %s: %v", LimitWrapper, err)
	}
	truePath, err := exec.LookPath("true")
	if err != nil {
		b.Skip(err)
	}
	for _, bc := range []struct {
		name string
		argv []string
	}{
		{"direct", []string{truePath}},
		{"wrapped", wrapperArgs(Limits{Memlock: memlockSmall, NProc: nprocBase, FSize: fsizeMargin, NoFile: nofileBase}, truePath, nil)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			path := bc.argv[0]
			if bc.name == "wrapped" {
				path = wrapper
			}
			for b.Loop() {
				cmd := &exec.Cmd{Path: path, Args: bc.argv, Env: qemuEnv()}
				if err := cmd.Run(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
