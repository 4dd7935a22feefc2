package fleet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

func view(host string, vcpus, mem uint32, gpus ...*vmflowv1.GpuOffer) *vmflowv1.HostView {
	return &vmflowv1.HostView{HostId: host, Kvm: true, VcpusTotal: 64, VcpusFree: vcpus, MemoryTotalMib: 65536, MemoryFreeMib: mem,
		PinnedMemoryFreeMib: mem, VmOverheadMib: 256, TcgOverheadMib: 1024, Gpus: gpus}
}

func vgpus(name string, free uint32) *vmflowv1.GpuOffer {
	return &vmflowv1.GpuOffer{Kind: KindVGPU, Name: name, Free: free, Driver: "mdev"}
}

func ids(cs []*vmflowv1.HostCandidate) []string {
	var out []string
	for _, c := range cs {
		if c.GetFits() {
			out = append(out, c.GetHostId())
		}
	}
	return out
}

// TestFits: each reason a host cannot serve an ask, the first that fails.
func TestFits(t *testing.T) {
	a := Ask{VCPUs: 4, MemoryMiB: 4096, GPUKind: KindVGPU, GPUName: "A", GPUs: 2, Network: true}
	ok := view("h", 8, 8192, vgpus("A", 2))
	ok.Network = true
	fits, why := Fits(ok, a)
	assert.True(t, fits, why)
	for name, c := range map[string]struct {
		mutate func(*vmflowv1.HostView)
		want   string
	}{
		"draining":      {func(v *vmflowv1.HostView) { v.Draining, v.DrainReason = true, "BIOS" }, "draining: BIOS"},
		"unreadable":    {func(v *vmflowv1.HostView) { v.UnreadableRecords = 1 }, "1 record(s) unreadable"},
		"no network":    {func(v *vmflowv1.HostView) { v.Network = false }, "no network"},
		"no KVM":        {func(v *vmflowv1.HostView) { v.Kvm = false }, "no KVM"},
		"vcpus":         {func(v *vmflowv1.HostView) { v.VcpusFree = 3 }, "3 of 64 vCPUs free"},
		"memory":        {func(v *vmflowv1.HostView) { v.MemoryFreeMib = 4300 }, "4300 MiB free (this VM holds 4352)"},
		"pinned memory": {func(v *vmflowv1.HostView) { v.PinnedMemoryFreeMib = 4000 }, "4000 MiB free"},
		"gpus":          {func(v *vmflowv1.HostView) { v.Gpus[0].Free = 1 }, `1 of vgpu "A" free`},
		"other profile": {func(v *vmflowv1.HostView) { v.Gpus[0].Name = "B" }, `0 of vgpu "A" free`},
		"too large":     {func(v *vmflowv1.HostView) { v.MaxVcpus, v.MaxMemoryMib = 2, 65536 }, "admits at most 2 vCPUs"},
	} {
		t.Run(name, func(t *testing.T) {
			v := view("h", 8, 8192, vgpus("A", 2))
			v.Network = true
			c.mutate(v)
			fits, why := Fits(v, a)
			assert.False(t, fits)
			assert.Contains(t, why, c.want)
		})
	}
	tcg := Ask{VCPUs: 1, MemoryMiB: 128, TCG: true}
	noKVM := view("h", 8, 1408)
	noKVM.Kvm = false
	fits, why = Fits(noKVM, tcg)
	assert.True(t, fits, "TCG needs no KVM and holds 128+256+1024 MiB: %s", why)
	noKVM.MemoryFreeMib = 1407
	fits, _ = Fits(noKVM, tcg)
	assert.False(t, fits)
}

// TestRankedPacksGPUsAndSpreadsCPUs: a GPU VM goes to the host it leaves
// with the fewest GPUs of its offer free; a CPU-only VM to the emptiest
// host without a free GPU; reservations in flight weigh against a host;
// ties go to the lower host id.
func TestRankedPacksGPUsAndSpreadsCPUs(t *testing.T) {
	views := []*vmflowv1.HostView{
		view("gpu-many", 60, 60000, vgpus("A", 8)),
		view("gpu-few", 60, 60000, vgpus("A", 2)),
		view("cpu-full", 10, 10000),
		view("cpu-empty", 60, 60000),
	}
	gpu := Ask{VCPUs: 2, MemoryMiB: 1024, GPUKind: KindVGPU, GPUName: "A", GPUs: 1}
	assert.Equal(t, []string{"gpu-few", "gpu-many"}, ids(Ranked(views, gpu, nil)), "packed onto the host with the fewest left")
	cpu := Ask{VCPUs: 2, MemoryMiB: 1024}
	assert.Equal(t, []string{"cpu-empty", "cpu-full", "gpu-few", "gpu-many"}, ids(Ranked(views, cpu, nil)), "spread, off the GPU hosts")

	twins := []*vmflowv1.HostView{view("b", 60, 60000), view("a", 60, 60000)}
	assert.Equal(t, []string{"a", "b"}, ids(Ranked(twins, cpu, nil)), "ties by host id")
	assert.Equal(t, []string{"b", "a"}, ids(Ranked(twins, cpu, map[string]uint32{"a": 2})), "in flight weighs against a")
	twins[1].InFlight = 3
	assert.Equal(t, []string{"b", "a"}, ids(Ranked(twins, cpu, nil)), "published in flight too")

	r := Ranked(append(views, view("tiny", 1, 100)), cpu, nil)
	last := r[len(r)-1]
	assert.Equal(t, "tiny", last.GetHostId())
	assert.False(t, last.GetFits())
	assert.Contains(t, last.GetWhy(), "1 of 64 vCPUs free")
}

// TestTakeAndBest: a placer's pending choice comes off the host's view,
// and the fleet's best names the host closest to fitting.
func TestTakeAndBest(t *testing.T) {
	v := view("h1", 4, 2000, vgpus("A", 1), &vmflowv1.GpuOffer{Kind: KindPassthrough, Name: "10de:2335", Free: 2})
	a := Ask{VCPUs: 2, MemoryMiB: 500, GPUKind: KindPassthrough, GPUs: 2}
	got := Take(v, a)
	assert.EqualValues(t, 2, got.GetVcpusFree())
	assert.EqualValues(t, 2000-756, got.GetMemoryFreeMib())
	assert.EqualValues(t, 0, got.GetGpus()[1].GetFree(), "any model takes from the passthrough offers")
	assert.EqualValues(t, 1, got.GetGpus()[0].GetFree())
	assert.EqualValues(t, 4, v.GetVcpusFree(), "the view itself is left as it was")

	big := Ask{VCPUs: 64, MemoryMiB: 1000, GPUKind: KindPassthrough, GPUName: "10de:2335", GPUs: 2}
	views := []*vmflowv1.HostView{view("h1", 8, 4000, &vmflowv1.GpuOffer{Kind: KindPassthrough, Name: "10de:2335", Free: 1}),
		view("h2", 32, 4000, &vmflowv1.GpuOffer{Kind: KindPassthrough, Name: "10de:2335", Free: 1})}
	assert.Equal(t, `h2 has 1 passthrough "10de:2335" free, 32 vCPUs and 4000 MiB free`, Best(views, big))
	assert.Equal(t, `2 × passthrough "10de:2335" with 64 vCPUs and 1000 MiB`, big.String())
	views[1].Draining = true
	assert.Contains(t, Best(views, big), "h1 has")
	assert.Equal(t, "no host has published a view", Best(nil, big))
}

// TestAskOf: what a spawn request asks, in the views' terms.
func TestAskOf(t *testing.T) {
	a := AskOf(&vmflowv1.SpawnRequest{Vcpus: 2, MemoryMib: 512, Accel: "tcg", VgpuProfile: "GRID A100-4C", Network: "default"})
	assert.Equal(t, Ask{VCPUs: 2, MemoryMiB: 512, TCG: true, GPUKind: KindVGPU, GPUName: "GRID A100-4C", GPUs: 1, Network: true}, a)
	a = AskOf(&vmflowv1.SpawnRequest{Vcpus: 1, MemoryMib: 64, GpuPassthroughCount: 2})
	assert.Equal(t, Ask{VCPUs: 1, MemoryMiB: 64, GPUKind: KindPassthrough, GPUs: 2}, a)
}

// TestPendingChoicesCountUntilTheHostRepublishes: a placer's own choice
// comes off its host's view until a view published after it arrives.
func TestPendingChoicesCountUntilTheHostRepublishes(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 9, 0, 0, 0, time.UTC)
	now := t0
	p := &Placer{Now: func() time.Time { return now }}
	old := view("h1", 4, 60000)
	old.PublishedAt = t0.Add(-time.Second).Format(time.RFC3339Nano)
	a := Ask{VCPUs: 2, MemoryMiB: 128}
	p.remember("h1", a, t0)
	vs, n := p.withPending([]*vmflowv1.HostView{old}, now)
	require.Len(t, vs, 1)
	assert.EqualValues(t, 2, vs[0].GetVcpusFree())
	assert.EqualValues(t, 1, n["h1"])

	fresh := view("h1", 2, 60000)
	fresh.PublishedAt = t0.Add(time.Second).Format(time.RFC3339Nano)
	vs, n = p.withPending([]*vmflowv1.HostView{fresh}, now)
	assert.EqualValues(t, 2, vs[0].GetVcpusFree(), "the new view includes it: not taken twice")
	assert.Zero(t, n["h1"])

	p.remember("h1", a, t0)
	now = t0.Add(time.Minute)
	vs, _ = p.withPending([]*vmflowv1.HostView{old}, now)
	assert.EqualValues(t, 4, vs[0].GetVcpusFree(), "a choice past its TTL no longer counts")
}

// TestFitsDedicatedAndHugepages: a VM with dedicated CPUs needs them, not
// the shared vCPUs; one with hugepages needs its guest RAM in the pools
// and only QEMU's own memory beside.
func TestFitsDedicatedAndHugepages(t *testing.T) {
	v := view("h", 0, 300)
	v.DedicatedCpusFree, v.HugepagesFreeMib = 4, 4096
	fits, why := Fits(v, Ask{VCPUs: 4, MemoryMiB: 4096, Dedicated: true, Hugepages: true})
	assert.True(t, fits, "no shared vCPU and 256 of 300 MiB beside the pools: %s", why)
	fits, why = Fits(v, Ask{VCPUs: 5, MemoryMiB: 1024, Dedicated: true})
	assert.False(t, fits)
	assert.Contains(t, why, "4 dedicated CPUs free")
	fits, why = Fits(v, Ask{VCPUs: 1, MemoryMiB: 8192, Dedicated: true, Hugepages: true})
	assert.False(t, fits)
	assert.Contains(t, why, "4096 MiB of hugepages free")
	after := Take(v, Ask{VCPUs: 2, MemoryMiB: 2048, Dedicated: true, Hugepages: true})
	assert.EqualValues(t, 2, after.GetDedicatedCpusFree())
	assert.EqualValues(t, 2048, after.GetHugepagesFreeMib())
	assert.EqualValues(t, 44, after.GetMemoryFreeMib())
	a := AskOf(&vmflowv1.SpawnRequest{Vcpus: 2, MemoryMib: 2048, DedicatedCpus: true, Hugepages: "2M"})
	assert.True(t, a.Dedicated && a.Hugepages)
}
