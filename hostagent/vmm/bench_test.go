package vmm

import (
	"context"
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
