package gpu_test

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/internal/errdefs"
)

type ptEnv struct {
	sim *simtest.Sim
	p   *gpu.Passthrough
}

func newPassthrough(t *testing.T, opts vgpusim.Options, filter string) *ptEnv {
	t.Helper()
	f, err := gpu.ParseGPUFilter(filter)
	require.NoError(t, err)
	sim := simtest.Start(t, opts)
	return &ptEnv{sim: sim, p: gpu.NewPassthrough(gpu.PassthroughConfig{
		SysfsRoot: sim.Root, StateDir: t.TempDir(), DevRoot: sim.DevRoot, Filter: f,
	})}
}

// state is every function of GPU i's group: driver and driver_override.
func (e *ptEnv) state(t *testing.T, i int) map[string]string {
	t.Helper()
	g := vgpusim.PCIGPUAt(i)
	out := map[string]string{}
	for _, a := range []string{g.GPU, g.Audio, g.Bridge, g.NIC} {
		if a == "" {
			continue
		}
		drv, ok := e.sim.Server.PCIDriver(a)
		require.True(t, ok, a)
		b, err := os.ReadFile(e.sim.Path("bus", "pci", "devices", a, "driver_override"))
		require.NoError(t, err)
		out[a] = drv + " override=" + strings.TrimSpace(string(b))
	}
	return out
}

func (e *ptEnv) nodeExists(g vgpusim.PCIGPU) bool {
	_, err := os.Stat(filepath.Join(e.sim.DevRoot, "vfio", g.Group))
	return err == nil
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestPassthroughListsGPUs(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{MdevParents: 1, VendorVFs: 2, PCIGPUs: 4}, "all")
	gpus, err := e.p.GPUs(context.Background())
	require.NoError(t, err)
	by := map[string]gpu.GPU{}
	for _, g := range gpus {
		by[g.Addr] = g
	}
	require.Len(t, gpus, 1+1+2+4, "mdev parent, PF, 2 VFs, 4 PCI GPUs; no audio, bridge or NIC")
	for _, a := range []string{vgpusim.MdevParent(0), vgpusim.VendorPF, vgpusim.VendorVF(0)} {
		assert.True(t, by[a].VGPUParent, a)
		assert.False(t, by[a].Offered, "%s serves vGPUs: never offered whole", a)
	}
	zero, one, two, three := by[vgpusim.PCIGPUAt(0).GPU], by[vgpusim.PCIGPUAt(1).GPU], by[vgpusim.PCIGPUAt(2).GPU], by[vgpusim.PCIGPUAt(3).GPU]
	assert.Equal(t, "10de:2335", zero.ID())
	assert.Equal(t, "nvidia", zero.Driver)
	assert.Equal(t, vgpusim.PCIGPUAt(0).Group, zero.Group)
	assert.True(t, zero.Viable && zero.Offered && !zero.Marked)
	require.Len(t, one.Others, 1)
	assert.Equal(t, vgpusim.PCIGPUAt(1).Audio, one.Others[0].Addr)
	assert.Equal(t, "snd_hda_intel", one.Others[0].Driver)
	assert.True(t, one.Viable)
	require.Len(t, two.Bridges, 1)
	assert.Empty(t, two.Others)
	assert.True(t, two.Viable)
	assert.False(t, three.Viable)
	assert.Equal(t, "group "+vgpusim.PCIGPUAt(3).Group+" also holds "+vgpusim.PCIGPUAt(3).NIC+" (network controller)", three.NotViable)
	assert.False(t, three.Offered)

	only, err := gpu.ParseGPUFilter("10de:2684")
	require.NoError(t, err)
	e.p = gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot: e.sim.Root, StateDir: t.TempDir(), DevRoot: e.sim.DevRoot, Filter: only})
	gpus, err = e.p.GPUs(context.Background())
	require.NoError(t, err)
	for _, g := range gpus {
		assert.Equal(t, g.Addr == vgpusim.PCIGPUAt(1).GPU, g.Offered, g.Addr)
	}
}

// TestPassthroughRoundTrip: bind then return restores every function's
// driver; a companion audio function travels with its GPU; a bridge is
// never unbound; the lease hook sees the drivers before any write.
func TestPassthroughRoundTrip(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{PCIGPUs: 3}, "all")
	for i, want := range [][]gpu.BoundFunction{
		{{Addr: vgpusim.PCIGPUAt(0).GPU, Previous: "nvidia", Display: true, ID: "10de:2335", Serial: "48-30-00-00-00-00-00-81"}},
		{{Addr: vgpusim.PCIGPUAt(1).GPU, Previous: "nvidia", Display: true, ID: "10de:2684", Serial: "48-30-00-00-00-00-00-82"},
			{Addr: vgpusim.PCIGPUAt(1).Audio, Previous: "snd_hda_intel", ID: "10de:22ba"}},
		{{Addr: vgpusim.PCIGPUAt(2).GPU, Previous: "nvidia", Display: true, ID: "10de:2335", Serial: "48-30-00-00-00-00-00-83"}},
	} {
		g := vgpusim.PCIGPUAt(i)
		before := e.state(t, i)
		var intent *gpu.Binding
		b, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Intent: func(b gpu.Binding) error {
			intent = &b
			assert.Equal(t, before, e.state(t, i), "the lease is written before the first write")
			return nil
		}})
		require.NoError(t, err, i)
		require.NotNil(t, intent)
		assert.Equal(t, b, *intent)
		assert.Equal(t, gpu.Binding{Group: g.Group, Functions: want}, b)
		for _, bf := range b.Functions {
			assert.Equal(t, "vfio-pci override=vfio-pci", e.state(t, i)[bf.Addr], bf.Addr)
		}
		if g.Bridge != "" {
			assert.Equal(t, "pcieport override=(null)", e.state(t, i)[g.Bridge], "bridge untouched")
		}
		assert.True(t, e.nodeExists(g))
		gpus, err := e.p.GPUs(context.Background())
		require.NoError(t, err)
		for _, gpu := range gpus {
			if gpu.Addr == g.GPU {
				assert.True(t, gpu.Marked)
				assert.True(t, gpu.Viable, "a group vmflow bound is viable: %s", gpu.NotViable)
			}
		}

		require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b), i)
		assert.Equal(t, before, e.state(t, i), "every function back as it was")
		assert.False(t, e.nodeExists(g))
		require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b), "already returned is success")
	}
}

func TestPassthroughRefusesWithNothingChanged(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{VendorVFs: 1, PCIGPUs: 4}, "all")
	before := e.state(t, 3)
	called := false
	intent := func(gpu.Binding) error { called = true; return nil }
	_, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: vgpusim.PCIGPUAt(3).Group, Intent: intent})
	require.ErrorIs(t, err, gpu.ErrGroupNotViable)
	assert.Equal(t, errdefs.Refused, errdefs.ClassOf(err))
	assert.Contains(t, err.Error(), vgpusim.PCIGPUAt(3).NIC)
	assert.False(t, called, "no lease for a refused group")
	assert.Equal(t, before, e.state(t, 3), "nothing written")

	// A VF's group: one GPU is never both a vGPU and a whole GPU.
	_, err = e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: "100", Intent: intent})
	require.ErrorIs(t, err, gpu.ErrVGPUParent)
	_, err = e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: "999", Intent: intent})
	require.ErrorIs(t, err, gpu.ErrNoGroup)
	_, err = e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: "../1", Intent: intent})
	require.ErrorIs(t, err, gpu.ErrInvalid)
	assert.False(t, called)
}

// TestPassthroughFaults: each fault gives its typed error, and once it
// clears the same call completes and the GPU can be bound again.
func TestPassthroughFaults(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{PCIGPUs: 2}, "all")
	g := vgpusim.PCIGPUAt(1)
	before := e.state(t, 1)
	bind := func(resume *gpu.Binding) (gpu.Binding, error) {
		return e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Resume: resume})
	}

	e.sim.Set(t, vgpusim.CtlFailUnbind, "EIO")
	b, err := bind(nil)
	require.ErrorIs(t, err, gpu.ErrUnbindFailed)
	assert.ErrorIs(t, err, syscall.EIO)
	assert.Equal(t, errdefs.Unavailable, errdefs.ClassOf(err))
	_, err = bind(nil)
	require.ErrorIs(t, err, gpu.ErrAlreadyBound, "a retry without the recorded binding refuses: the marks are set")
	e.sim.Clear(t, vgpusim.CtlFailUnbind)
	b, err = bind(&b)
	require.NoError(t, err, "the recorded binding resumes")
	assert.Equal(t, "snd_hda_intel", b.Functions[1].Previous, "previous drivers kept from the record")

	e.sim.Set(t, vgpusim.CtlFailReset, "EIO")
	err = e.p.Return(ctxFor(t, 10*time.Second), b)
	require.ErrorIs(t, err, gpu.ErrResetFailed)
	assert.Equal(t, errdefs.Unavailable, errdefs.ClassOf(err))
	assert.Equal(t, "vfio-pci override=vfio-pci", e.state(t, 1)[g.GPU], "still bound and marked after a failed reset")
	e.sim.Clear(t, vgpusim.CtlFailReset)

	e.sim.Set(t, vgpusim.CtlFailUnbind, "EIO")
	require.ErrorIs(t, e.p.Return(ctxFor(t, 10*time.Second), b), gpu.ErrUnbindFailed)
	e.sim.Clear(t, vgpusim.CtlFailUnbind)

	e.sim.Set(t, vgpusim.CtlBlockUnbind, "")
	// The caller gives up once the unbind blocks: a deadline could end
	// the call before it wrote the unbind (reset goes first).
	err = e.p.Return(untilBlocked(t, e.sim), b)
	require.ErrorIs(t, err, gpu.ErrReleaseInProgress)
	assert.Equal(t, errdefs.Busy, errdefs.ClassOf(err))
	assert.NotErrorIs(t, err, gpu.ErrUnbindFailed, "waiting is not failing")
	err = e.p.Return(ctxFor(t, 200*time.Millisecond), b)
	require.ErrorIs(t, err, gpu.ErrReleaseInProgress, "the retry waits for the write in flight")
	assert.Equal(t, 1, e.sim.Server.Blocked(), "one unbind written, not two")
	e.sim.Clear(t, vgpusim.CtlBlockUnbind)
	require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b))
	assert.Equal(t, before, e.state(t, 1))

	b, err = bind(nil)
	require.NoError(t, err, "claimable again")
	require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b))
}

// TestPassthroughWaitsForTheGPUsUser: the NVIDIA driver's unbind waits
// while a host process has the GPU open; the bind says Busy and completes
// on retry once the process lets go.
func TestPassthroughWaitsForTheGPUsUser(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{PCIGPUs: 1}, "all")
	g := vgpusim.PCIGPUAt(0)
	nv, err := e.sim.Server.NvidiaNode(0)
	require.NoError(t, err)
	user, err := os.Open(nv)
	require.NoError(t, err)
	var rec gpu.Binding
	_, err = e.p.Bind(ctxFor(t, 300*time.Millisecond), gpu.BindRequest{Group: g.Group, Intent: func(b gpu.Binding) error { rec = b; return nil }})
	require.ErrorIs(t, err, gpu.ErrReleaseInProgress)
	assert.Equal(t, errdefs.Busy, errdefs.ClassOf(err))
	require.NoError(t, user.Close())
	b, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Resume: &rec})
	require.NoError(t, err)
	assert.Equal(t, "nvidia", b.Functions[0].Previous)

	// vfio-pci's unbind waits for the VFIO user (QEMU) the same way.
	vm, err := os.Open(e.p.VFIONode(g.Group))
	require.NoError(t, err)
	require.ErrorIs(t, e.p.Return(ctxFor(t, 300*time.Millisecond), b), gpu.ErrReleaseInProgress)
	require.NoError(t, vm.Close())
	require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b))
	drv, _ := e.sim.Server.PCIDriver(g.GPU)
	assert.Equal(t, "nvidia", drv)
}

// TestPassthroughHalfDone: a bind or return an agent died in the middle of
// completes from each step it may have reached.
func TestPassthroughHalfDone(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{PCIGPUs: 1}, "all")
	g := vgpusim.PCIGPUAt(0)
	before := e.state(t, 0)
	rec := gpu.Binding{Group: g.Group, Functions: []gpu.BoundFunction{{Addr: g.GPU, Previous: "nvidia", Display: true}}}
	attr := func(name string) string { return e.sim.Path("bus", "pci", "devices", g.GPU, name) }
	drivers := e.sim.Path("bus", "pci", "drivers")

	for _, tc := range []struct {
		name  string
		steps func()
	}{
		{"bind: override written", func() { require.NoError(t, sysWrite(attr("driver_override"), "vfio-pci")) }},
		{"bind: unbound from nvidia", func() {
			require.NoError(t, sysWrite(attr("driver_override"), "vfio-pci"))
			require.NoError(t, sysWrite(filepath.Join(drivers, "nvidia", "unbind"), g.GPU))
		}},
	} {
		tc.steps()
		b, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Resume: &rec})
		require.NoError(t, err, tc.name)
		assert.Equal(t, rec, b, tc.name)
		assert.Equal(t, "vfio-pci override=vfio-pci", e.state(t, 0)[g.GPU], tc.name)
		require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b), tc.name)
		assert.Equal(t, before, e.state(t, 0), tc.name)
	}

	for _, tc := range []struct {
		name  string
		steps func()
	}{
		{"return: unbound from vfio-pci", func() {
			require.NoError(t, sysWrite(filepath.Join(drivers, "vfio-pci", "unbind"), g.GPU))
		}},
		{"return: override cleared", func() {
			require.NoError(t, sysWrite(filepath.Join(drivers, "vfio-pci", "unbind"), g.GPU))
			require.NoError(t, sysWrite(attr("driver_override"), "\n"))
		}},
	} {
		b, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group})
		require.NoError(t, err, tc.name)
		tc.steps()
		require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b), tc.name)
		assert.Equal(t, before, e.state(t, 0), tc.name)
	}
	// A bind rolled back before its unbind: the mark alone is cleared.
	require.NoError(t, sysWrite(attr("driver_override"), "vfio-pci"))
	require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), rec))
	assert.Equal(t, before, e.state(t, 0))
}

// TestPassthroughCrashBetweenAnyTwoWrites stops Bind, then Return, after
// each of their sysfs writes in turn (the goroutine exits in the
// AfterWrite hook, as a killed agent stops: nothing after that write
// runs), and checks that the next call, given what the lease recorded,
// completes from there.
func TestPassthroughCrashBetweenAnyTwoWrites(t *testing.T) {
	sim := simtest.Start(t, vgpusim.Options{PCIGPUs: 2})
	g := vgpusim.PCIGPUAt(1) // GPU and audio: two functions
	e := &ptEnv{sim: sim}
	before := e.state(t, 1)
	crashAt, writes := 0, 0 // crashAt 0: disarmed
	p := gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot: sim.Root, StateDir: t.TempDir(), DevRoot: sim.DevRoot,
		AfterWrite: func(addr, attr string) {
			writes++
			if writes == crashAt {
				runtime.Goexit()
			}
		}})
	// crashed runs f armed to stop after write n, and reports whether it
	// stopped there.
	crashed := func(n int, f func()) bool {
		crashAt, writes = n, 0
		defer func() { crashAt = 0 }()
		done := make(chan bool, 1)
		go func() {
			finished := false
			defer func() { done <- !finished }()
			f()
			finished = true
		}()
		return <-done
	}
	for _, phase := range []string{"bind", "return"} {
		n := 1
		for ; ; n++ {
			var rec gpu.Binding
			if phase == "return" {
				var err error
				rec, err = p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group})
				require.NoError(t, err)
			}
			hit := crashed(n, func() {
				if phase == "bind" {
					_, _ = p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Intent: func(b gpu.Binding) error { rec = b; return nil }})
					return
				}
				_ = p.Return(ctxFor(t, 10*time.Second), rec)
			})
			if !hit {
				require.NoError(t, p.Return(ctxFor(t, 10*time.Second), rec))
				break // it finished: no write left to stop after
			}
			if phase == "bind" {
				b, err := p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Resume: &rec})
				require.NoError(t, err, "bind resumed after write %d", n)
				assert.Equal(t, rec, b)
				assert.True(t, e.nodeExists(g))
			}
			require.NoError(t, p.Return(ctxFor(t, 10*time.Second), rec), "%s: return after write %d", phase, n)
			assert.Equal(t, before, e.state(t, 1), "%s: stopped after write %d", phase, n)
		}
		assert.Greater(t, n, 6, "%s: stopped after each of its writes", phase)
	}
}

// TestPassthroughNeverTouchesOthers: Return leaves alone a function vmflow
// did not bind: one on vfio-pci without vmflow's mark, and one never
// moved (reset and unbind would fail here, so none was written).
func TestPassthroughNeverTouchesOthers(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{PCIGPUs: 2}, "all")
	g := vgpusim.PCIGPUAt(0)
	attr := func(name string) string { return e.sim.Path("bus", "pci", "devices", g.GPU, name) }
	// An operator's own passthrough: bound to vfio-pci, override cleared.
	require.NoError(t, sysWrite(attr("driver_override"), "vfio-pci"))
	require.NoError(t, sysWrite(e.sim.Path("bus", "pci", "drivers", "nvidia", "unbind"), g.GPU))
	require.NoError(t, sysWrite(e.sim.Path("bus", "pci", "drivers_probe"), g.GPU))
	require.NoError(t, sysWrite(attr("driver_override"), "\n"))
	theirs := e.state(t, 0)

	err := e.p.Return(ctxFor(t, 10*time.Second), gpu.Binding{Group: g.Group, Functions: []gpu.BoundFunction{{Addr: g.GPU, Previous: "nvidia"}}})
	require.ErrorIs(t, err, gpu.ErrNotOurs)
	assert.Equal(t, theirs, e.state(t, 0), "untouched")
	_, err = e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group})
	require.ErrorIs(t, err, gpu.ErrAlreadyBound, "and never placed on")
	gpus, err := e.p.GPUs(context.Background())
	require.NoError(t, err)
	for _, gpu := range gpus {
		assert.Equal(t, gpu.Addr != g.GPU, gpu.Offered, "%s: an operator's vfio-pci GPU is not offered", gpu.Addr)
	}

	e.sim.Set(t, vgpusim.CtlFailReset, "EIO")
	e.sim.Set(t, vgpusim.CtlFailUnbind, "EIO")
	one := vgpusim.PCIGPUAt(1)
	before := e.state(t, 1)
	require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), gpu.Binding{Group: one.Group, Functions: []gpu.BoundFunction{
		{Addr: one.GPU, Previous: "nvidia"}, {Addr: one.Audio, Previous: "snd_hda_intel"},
	}}), "never bound: nothing to return")
	assert.Equal(t, before, e.state(t, 1))
}

// sysWrite is one write(2), as an agent (or an operator's shell) makes it.
var sysWrite = simtest.Write

// TestPassthroughMarkedGroups: reconcile's view. A group vmflow bound whose
// lease is gone is found by its mark and returned to whatever driver
// drivers_probe finds; a function only marked (a bind stopped before its
// unbind) has the mark cleared and keeps its driver.
func TestPassthroughMarkedGroups(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{PCIGPUs: 2}, "all")
	before0, before1 := e.state(t, 0), e.state(t, 1)
	_, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: vgpusim.PCIGPUAt(1).Group})
	require.NoError(t, err)
	require.NoError(t, sysWrite(e.sim.Path("bus", "pci", "devices", vgpusim.PCIGPUAt(0).GPU, "driver_override"), "vfio-pci"))

	marked, err := e.p.MarkedGroups(context.Background())
	require.NoError(t, err)
	require.Len(t, marked, 2)
	assert.Equal(t, gpu.Binding{Group: vgpusim.PCIGPUAt(0).Group, Functions: []gpu.BoundFunction{
		{Addr: vgpusim.PCIGPUAt(0).GPU, Previous: gpu.AnyDriver, Display: true}}}, marked[0])
	assert.Len(t, marked[1].Functions, 2)
	for _, b := range marked {
		require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b))
	}
	assert.Equal(t, before0, e.state(t, 0))
	assert.Equal(t, before1, e.state(t, 1), "the GPU on nvidia, its audio function on snd_hda_intel")
	marked, err = e.p.MarkedGroups(context.Background())
	require.NoError(t, err)
	assert.Empty(t, marked)
}

// TestPassthroughRespectsOtherClaims: invariant 10 under the host lock. A
// group another instance's held claim names is refused with nothing
// written, even when sysfs shows it free (that agent died between its
// lease and its first write); unreadable records refuse a fresh bind but
// not a resumed one.
func TestPassthroughRespectsOtherClaims(t *testing.T) {
	e := newPassthrough(t, vgpusim.Options{PCIGPUs: 2}, "all")
	g := vgpusim.PCIGPUAt(1)
	before := e.state(t, 1)
	called := false
	intent := func(gpu.Binding) error { called = true; return nil }
	for _, key := range []string{g.GPU, g.Audio} {
		_, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Intent: intent,
			Taken: func(context.Context) (map[string]string, error) { return map[string]string{key: "vm-other"}, nil }})
		require.ErrorIs(t, err, gpu.ErrClaimedByOther, key)
		assert.Contains(t, err.Error(), "vm-other")
	}
	unreadable := func(context.Context) (map[string]string, error) {
		return map[string]string{}, gpu.ErrRecordsUnreadable
	}
	_, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Intent: intent, Taken: unreadable})
	require.ErrorIs(t, err, gpu.ErrRecordsUnreadable)
	assert.False(t, called)
	assert.Equal(t, before, e.state(t, 1), "nothing written")

	rec := gpu.Binding{Group: g.Group, Functions: []gpu.BoundFunction{
		{Addr: g.GPU, Previous: "nvidia", Display: true}, {Addr: g.Audio, Previous: "snd_hda_intel"}}}
	b, err := e.p.Bind(ctxFor(t, 10*time.Second), gpu.BindRequest{Group: g.Group, Resume: &rec, Taken: unreadable})
	require.NoError(t, err, "a resumed bind goes on with the readable records")
	require.NoError(t, e.p.Return(ctxFor(t, 10*time.Second), b))
}

// BenchmarkPassthroughRoundTrip: Bind then Return of a GPU with its audio
// function on the simulator, whose unbinds each read every process's
// descriptors (as it looks for the GPU's users).
func BenchmarkPassthroughRoundTrip(b *testing.B) {
	sim := simtest.Start(b, vgpusim.Options{PCIGPUs: 2})
	p := gpu.NewPassthrough(gpu.PassthroughConfig{SysfsRoot: sim.Root, StateDir: b.TempDir(), DevRoot: sim.DevRoot})
	g := vgpusim.PCIGPUAt(1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for b.Loop() {
		bd, err := p.Bind(ctx, gpu.BindRequest{Group: g.Group})
		if err != nil {
			b.Fatal(err)
		}
		if err := p.Return(ctx, bd); err != nil {
			b.Fatal(err)
		}
	}
}
