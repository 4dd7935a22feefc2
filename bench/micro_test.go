package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	commonpb "go.temporal.io/api/common/v1"

	"vmflow/hostagent/admission"
	"vmflow/hostagent/proc"
	"vmflow/hostagent/vmm"
	"vmflow/platform"
	vmflowv1 "vmflow/proto/vmflow/v1"
	"vmflow/testsupport/stacktest"
)

// The hot functions below had no benchmark in their own packages; they are
// measured here, through their exported API, so a regression in time or
// allocations shows in BENCHMARKS.md.

// BenchmarkInspect is one liveness check of a live process (this one):
// what the /proc fallback poller and every "is it gone?" question cost.
func BenchmarkInspect(b *testing.B) {
	id, err := proc.ReadIdentity(os.Getpid())
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if st := proc.Inspect(id); !st.Alive {
			b.Fatalf("self not alive: %+v", st)
		}
	}
}

// BenchmarkReadIdentity reads pid, start time and boot id from /proc.
func BenchmarkReadIdentity(b *testing.B) {
	pid := os.Getpid()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := proc.ReadIdentity(pid); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkHostValidate is admission of a spawn request with a kernel, an
// initrd (each opened beneath the image root) and a vGPU profile.
func BenchmarkHostValidate(b *testing.B) {
	root := b.TempDir()
	for _, f := range []string{"vmlinuz", "initrd.img"} {
		if err := os.WriteFile(filepath.Join(root, f), []byte("x"), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	roots, err := admission.OpenImageRoots([]string{root})
	if err != nil {
		b.Fatal(err)
	}
	defer roots.Close()
	h := admission.Host{Images: roots, MaxVCPUs: 64, MaxMemoryMiB: 1 << 20,
		Profiles: func(context.Context) ([]string, error) { return []string{"GRID A100-4C", "GRID A100-8C"}, nil }}
	req := &vmflowv1.SpawnRequest{InstanceId: "web-1", HostId: "h1", Vcpus: 4, MemoryMib: 4096, Machine: "q35", Accel: "kvm",
		Kernel: filepath.Join(root, "vmlinuz"), Initrd: filepath.Join(root, "initrd.img"), Cmdline: "console=ttyS0", VgpuProfile: "GRID A100-4C"}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := h.Validate(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkVMSpecValidate is vmm's own check of a typed spec (pure).
func BenchmarkVMSpecValidate(b *testing.B) {
	s := vmm.VMSpec{Name: "web-1", UUID: "6f1c1b0e-1c1a-4d4e-9f55-0123456789ab", VCPUs: 4, MemoryMiB: 4096,
		Machine: vmm.MachineQ35, Accel: vmm.AccelKVM, Kernel: os.Stdin, Cmdline: "console=ttyS0",
		VFIO: []string{"/sys/bus/mdev/devices/5e1b5c4a-2c55-4b1e-9a34-7d0c3f2a9b10"}, SerialToLog: true}
	b.ReportAllocs()
	for b.Loop() {
		if err := s.Validate(); err != nil {
			b.Fatal(err)
		}
	}
}

var spawnJSON = []byte(`{"instance_id":"vm1","host_id":"h1","vcpus":1,"memory_mib":128,"machine":"none","vgpu_profile":"GRID A100-4C"}`)

// BenchmarkFromPayload decodes a CLI-style snake_case spawn request with
// the strict converter (unknown-key walk, then protojson), into **T as the
// SDK passes a workflow argument.
func BenchmarkFromPayload(b *testing.B) {
	c := platform.NewStrictJSONPayloadConverter()
	p := &commonpb.Payload{Metadata: map[string][]byte{"encoding": []byte("json/plain")}, Data: spawnJSON}
	b.ReportAllocs()
	for b.Loop() {
		var req *vmflowv1.SpawnRequest
		if err := c.FromPayload(p, &req); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkToPayload encodes a spawn request.
func BenchmarkToPayload(b *testing.B) {
	c := platform.NewStrictJSONPayloadConverter()
	req := &vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 1, MemoryMib: 128, Machine: "none", VgpuProfile: "GRID A100-4C"}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.ToPayload(req); err != nil {
			b.Fatal(err)
		}
	}
}

// benchLine is one result line of `go test -bench -benchmem`.
var benchLine = regexp.MustCompile(`^(Benchmark\S+?)(?:-\d+)?\s+(\d+)\s+([\d.]+) ns/op(?:\s+[\d.]+ MB/s)?(?:\s+([\d.]+) B/op\s+(\d+) allocs/op)?`)

// microBenchmarks runs the pure-function (and /proc) Go benchmarks of
// several packages with -benchmem and tabulates them.
func microBenchmarks(t *testing.T) string {
	root, err := stacktest.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	pkgs := []string{"./hostagent/vmm", "./hostagent/proc", "./hostagent/store", "./bench"}
	pattern := "^Benchmark(Argv|ParseStat|EncodeRecord|DecodeRecord|Inspect|ReadIdentity|HostValidate|VMSpecValidate|FromPayload|ToPayload)$"
	benchtime := "1s"
	if quick() {
		benchtime = "100ms"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	args := append([]string{"test", "-run", "^$", "-bench", pattern, "-benchmem", "-benchtime", benchtime, "-count", "1"}, pkgs...)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	// The nested run must measure, not recurse into the driver.
	cmd.Env = append(os.Environ(), envBench+"=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	tab := Table{Header: []string{"package", "benchmark", "ns/op", "B/op", "allocs/op"}}
	pkg := ""
	for _, l := range strings.Split(string(out), "\n") {
		if p, ok := strings.CutPrefix(l, "pkg: "); ok {
			pkg = strings.TrimPrefix(p, "vmflow/")
		}
		if m := benchLine.FindStringSubmatch(l); m != nil {
			tab.Add(pkg, m[1], m[3], m[4], m[5])
		}
	}
	if len(tab.Rows) == 0 {
		t.Fatalf("no benchmark results in:\n%s", out)
	}
	var b strings.Builder
	b.WriteString("## 5. Hot functions (Go benchmarks, allocations)\n\n")
	b.WriteString("`go test -run '^$' -bench '" + pattern + "' -benchmem -benchtime " + benchtime + " " + strings.Join(pkgs, " ") + "`. Inspect and ReadIdentity read `/proc` (of this process); HostValidate opens two images beneath the image root (openat2); the rest are pure. A regression shows as a jump in allocs/op first.\n\n")
	b.WriteString(tab.Markdown())
	return b.String()
}
