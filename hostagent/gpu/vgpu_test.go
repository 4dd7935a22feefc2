package gpu_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/gpu/vgpusim"
	"vmflow/hostagent/gpu/vgpusim/simtest"
	"vmflow/hostagent/topology"
)

const waitFor = 5 * time.Second

// releaseLog records Config.OnReleaseDone calls.
type releaseLog struct {
	mu    sync.Mutex
	calls []releaseCall
}

type releaseCall struct {
	dev gpu.Device
	err error
}

func (l *releaseLog) record(d gpu.Device, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, releaseCall{d, err})
}

func (l *releaseLog) get() []releaseCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]releaseCall(nil), l.calls...)
}

// waitBlocked waits until a write is blocked in the simulator.
func waitBlocked(t *testing.T, sim *simtest.Sim) {
	t.Helper()
	require.Eventually(t, func() bool { return sim.Server.Blocked() > 0 }, waitFor, time.Millisecond,
		"no write reached the device")
}

// untilBlocked is a context that ends once a write is blocked in the
// simulator (at the latest after waitFor): a caller that gives up then.
func untilBlocked(t *testing.T, sim *simtest.Sim) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	t.Cleanup(cancel)
	go func() {
		defer cancel()
		for ctx.Err() == nil && sim.Server.Blocked() == 0 {
			time.Sleep(time.Millisecond) // polling a counter: there is no event for it
		}
	}()
	return ctx
}

func (l *releaseLog) waitLen(t *testing.T, n int) []releaseCall {
	t.Helper()
	require.Eventually(t, func() bool { return len(l.get()) >= n }, waitFor, time.Millisecond)
	return l.get()
}

// fixture describes one driver against its simulator.
type fixture struct {
	kind gpu.Kind
	opts vgpusim.Options
	// profile has room for several devices; scarce for scarceN in total.
	profile, scarce string
	scarceN         int
}

var fixtures = []fixture{
	{kind: gpu.KindMdev, opts: vgpusim.Options{MdevParents: 2}, profile: "GRID A100-4C", scarce: "GRID A100-40C", scarceN: 2},
	{kind: gpu.KindVendor, opts: vgpusim.Options{VendorVFs: 4}, profile: "NVIDIA L40-4Q", scarce: "NVIDIA L40-24Q", scarceN: 2},
}

type env struct {
	sim      *simtest.Sim
	drv      gpu.Driver
	log      *releaseLog
	stateDir string
}

func (f fixture) start(t *testing.T) *env {
	t.Helper()
	sim := simtest.Start(t, f.opts)
	e := &env{sim: sim, log: &releaseLog{}, stateDir: t.TempDir()}
	drv, err := gpu.New(gpu.Config{SysfsRoot: sim.Root, StateDir: e.stateDir, OnReleaseDone: e.log.record})
	require.NoError(t, err)
	require.Equal(t, f.kind, drv.Kind(), "detection")
	e.drv = drv
	return e
}

func eachDriver(t *testing.T, fn func(t *testing.T, f fixture)) {
	for _, f := range fixtures {
		t.Run(string(f.kind), func(t *testing.T) { fn(t, f) })
	}
}

func (e *env) create(t *testing.T, profile string) gpu.Device {
	t.Helper()
	dev, err := e.drv.Create(context.Background(), gpu.CreateRequest{Profile: profile, UUID: uuid.NewString()})
	require.NoError(t, err)
	return dev
}

func (e *env) devices(t *testing.T) []gpu.Device {
	t.Helper()
	devs, err := e.drv.Devices(context.Background())
	require.NoError(t, err)
	return devs
}

func available(t *testing.T, drv gpu.Driver, profile string) int {
	t.Helper()
	profs, err := drv.Profiles(context.Background())
	require.NoError(t, err)
	n := 0
	for _, p := range profs {
		if p.Name == profile {
			n += p.Available
		}
	}
	return n
}

func TestDetect(t *testing.T) {
	mdev := simtest.Start(t, vgpusim.Options{MdevParents: 1, VendorVFs: 1})
	k, err := gpu.Detect(mdev.Root)
	require.NoError(t, err)
	assert.Equal(t, gpu.KindMdev, k, "mdev when class/mdev_bus has parents")

	vendor := simtest.Start(t, vgpusim.Options{VendorVFs: 1})
	k, err = gpu.Detect(vendor.Root)
	require.NoError(t, err)
	assert.Equal(t, gpu.KindVendor, k)

	drv, err := gpu.New(gpu.Config{SysfsRoot: mdev.Root, StateDir: t.TempDir(), Kind: gpu.KindVendor})
	require.NoError(t, err)
	assert.Equal(t, gpu.KindVendor, drv.Kind(), "override")
	_, err = gpu.New(gpu.Config{SysfsRoot: mdev.Root, Kind: "bogus"})
	assert.ErrorIs(t, err, gpu.ErrInvalid)
}

func TestProfilesNamedAsHardware(t *testing.T) {
	e := fixtures[0].start(t)
	profs, err := e.drv.Profiles(context.Background())
	require.NoError(t, err)
	// Without NUMA every parent is on no node, under the one root.
	at := func(e *env, parent string) topology.PCILocality {
		l, ok := e.sim.Server.PCILocality(parent)
		require.True(t, ok, parent)
		require.Equal(t, topology.NoNode, l.NUMANode)
		require.Equal(t, "pci0000:00", l.PCIeRoot)
		return l
	}
	assert.Contains(t, profs, gpu.Profile{Name: "GRID A100-4C", TypeID: "nvidia-471", Parent: vgpusim.MdevParent(0), Available: 10, PCILocality: at(e, vgpusim.MdevParent(0))})
	assert.Contains(t, profs, gpu.Profile{Name: "GRID A100-40C", TypeID: "nvidia-477", Parent: vgpusim.MdevParent(1), Available: 1, PCILocality: at(e, vgpusim.MdevParent(1))})

	v := fixtures[1].start(t)
	profs, err = v.drv.Profiles(context.Background())
	require.NoError(t, err)
	assert.Contains(t, profs, gpu.Profile{Name: "NVIDIA L40-4Q", TypeID: "592", Parent: vgpusim.VendorPF, Available: 4, PCILocality: at(v, vgpusim.VendorPF)})
}

func TestCreateListRelease(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		ctx := context.Background()
		before := available(t, e.drv, f.profile)
		u := uuid.NewString()
		dev, err := e.drv.Create(ctx, gpu.CreateRequest{Profile: f.profile, UUID: u})
		require.NoError(t, err)
		assert.Equal(t, f.kind, dev.Kind)
		assert.Equal(t, u, dev.UUID)
		assert.Equal(t, f.profile, dev.Profile)
		assert.Equal(t, before-1, available(t, e.drv, f.profile))

		devs := e.devices(t)
		require.Len(t, devs, 1)
		assert.Equal(t, dev.ID, devs[0].ID)
		assert.Equal(t, dev.TypeID, devs[0].TypeID)
		assert.Equal(t, dev.Parent, devs[0].Parent)
		assert.Equal(t, f.profile, devs[0].Profile)

		require.NoError(t, e.drv.Release(ctx, dev))
		assert.Empty(t, e.devices(t))
		assert.Equal(t, before, available(t, e.drv, f.profile))
		require.NoError(t, e.drv.Release(ctx, dev), "release twice: already gone is success")
		calls := e.log.waitLen(t, 2)
		assert.NoError(t, calls[0].err)
		assert.Equal(t, dev.ID, calls[0].dev.ID)
	})
}

// TestDevicePath: a driver names a device by its sysfs directory (QEMU's
// syntax is vmm's alone), and gpu.DevicePath, which picks the bus by the
// device's kind, agrees with each driver.
func TestDevicePath(t *testing.T) {
	const u, vf = "9f7f2d3f-cda3-4448-b47b-66251838b903", "0000:c1:00.4"
	m := gpu.NewMdev(gpu.Config{})
	assert.Equal(t, "/sys/bus/mdev/devices/"+u, m.DevicePath(gpu.Device{ID: u}))
	assert.Equal(t, m.DevicePath(gpu.Device{ID: u}), gpu.DevicePath("/sys", gpu.Device{Kind: gpu.KindMdev, ID: u}))
	v := gpu.NewVendor(gpu.Config{SysfsRoot: "/x/sys"})
	assert.Equal(t, "/x/sys/bus/pci/devices/"+vf, v.DevicePath(gpu.Device{ID: vf}))
	assert.Equal(t, v.DevicePath(gpu.Device{ID: vf}), gpu.DevicePath("/x/sys", gpu.Device{Kind: gpu.KindVendor, ID: vf}))
}

func TestPlacementLeastUsedFirst(t *testing.T) {
	e := fixtures[0].start(t)
	a := e.create(t, "GRID A100-4C")
	b := e.create(t, "GRID A100-4C")
	c := e.create(t, "GRID A100-4C")
	assert.Equal(t, vgpusim.MdevParent(0), a.Parent)
	assert.Equal(t, vgpusim.MdevParent(1), b.Parent, "the emptier parent")
	assert.Equal(t, vgpusim.MdevParent(0), c.Parent)
	// Both parents run A100-4C now; a GPU runs one type at a time.
	_, err := e.drv.Create(context.Background(), gpu.CreateRequest{Profile: "GRID A100-40C", UUID: uuid.NewString()})
	assert.ErrorIs(t, err, gpu.ErrNoCapacity)

	v := fixtures[1].start(t)
	seen := map[string]bool{}
	for i := 0; i < 4; i++ {
		dev := v.create(t, "NVIDIA L40-4Q")
		assert.Equal(t, vgpusim.VendorPF, dev.Parent)
		assert.False(t, seen[dev.ID], "VF %s used twice", dev.ID)
		seen[dev.ID] = true
	}
}

func TestCapacityExhausted(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		// Checked on an idle host: a busy vendor GPU lists only what is
		// creatable now, so there an unlisted name is "no capacity".
		_, err := e.drv.Create(context.Background(), gpu.CreateRequest{Profile: "GRID Z9000-1Q", UUID: uuid.NewString()})
		assert.ErrorIs(t, err, gpu.ErrUnknownProfile)
		for i := 0; i < f.scarceN; i++ {
			e.create(t, f.scarce)
		}
		_, err = e.drv.Create(context.Background(), gpu.CreateRequest{Profile: f.scarce, UUID: uuid.NewString()})
		assert.ErrorIs(t, err, gpu.ErrNoCapacity)
		assert.Len(t, e.devices(t), f.scarceN)

		_, err = e.drv.Create(context.Background(), gpu.CreateRequest{Profile: f.profile, UUID: "nope"})
		assert.ErrorIs(t, err, gpu.ErrInvalid)
	})
}

// The kernel's own "full" answer (EUSERS from the mdev core) is both
// ErrNoCapacity and the errno.
func TestCapacityErrnoFromKernel(t *testing.T) {
	e := fixtures[0].start(t)
	at := &gpu.Placement{Profile: "GRID A100-40C", TypeID: "nvidia-477", Parent: vgpusim.MdevParent(0)}
	_, err := e.drv.Create(context.Background(), gpu.CreateRequest{UUID: uuid.NewString(), At: at})
	require.NoError(t, err)
	_, err = e.drv.Create(context.Background(), gpu.CreateRequest{UUID: uuid.NewString(), At: at})
	assert.ErrorIs(t, err, gpu.ErrNoCapacity)
	assert.ErrorIs(t, err, syscall.EUSERS)
}

func TestInjectedReleaseErrno(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		for _, tc := range []struct {
			name  string
			errno syscall.Errno
		}{
			{"EBUSY", syscall.EBUSY},
			{"EIO", syscall.EIO},
			{"EAGAIN", syscall.EAGAIN},
			{"ENODEV", syscall.ENODEV},
		} {
			t.Run(tc.name, func(t *testing.T) {
				dev := e.create(t, f.profile)
				e.sim.Set(t, vgpusim.CtlFailRelease, tc.name)
				err := e.drv.Release(context.Background(), dev)
				require.Error(t, err)
				assert.ErrorIs(t, err, tc.errno)
				got, ok := gpu.Errno(err)
				assert.True(t, ok)
				assert.Equal(t, tc.errno, got)
				assert.Len(t, e.devices(t), 1, "a failed release keeps the device")

				e.sim.Clear(t, vgpusim.CtlFailRelease)
				require.NoError(t, e.drv.Release(context.Background(), dev))
				assert.Empty(t, e.devices(t))
			})
		}
	})
}

func TestInjectedCreateErrno(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		for _, name := range []string{"EBUSY", "EIO", "EAGAIN", "ENODEV"} {
			e.sim.Set(t, vgpusim.CtlFailCreate, name)
			_, err := e.drv.Create(context.Background(), gpu.CreateRequest{Profile: f.profile, UUID: uuid.NewString()})
			assert.ErrorIs(t, err, vgpusim.ParseErrno(name), name)
			assert.Empty(t, e.devices(t))
		}
		e.sim.Clear(t, vgpusim.CtlFailCreate)
		e.create(t, f.profile)
	})
}

func TestBlockedReleaseBoundedJoinedAndCompleted(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		dev := e.create(t, f.profile)
		e.sim.Set(t, vgpusim.CtlBlockRelease, "")

		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		err := e.drv.Release(ctx, dev)
		require.ErrorIs(t, err, gpu.ErrReleaseInProgress)
		assert.NotErrorIs(t, err, context.DeadlineExceeded, "the caller's deadline is not the release's failure")
		var rip *gpu.ReleaseInProgressError
		require.ErrorAs(t, err, &rip)
		assert.Equal(t, dev.ID, rip.Device.ID)
		// The write goes on after the caller gave up; on a loaded machine it
		// may reach the device only after the caller's deadline.
		waitBlocked(t, e.sim)
		assert.Equal(t, 1, e.sim.Server.Blocked())

		// A second caller joins the write in flight rather than starting one.
		// The first caller gave up: nobody waits on the write any more.
		require.Equal(t, 0, gpu.ReleaseWaiters(e.drv, dev))
		joined := make(chan error, 1)
		go func() { joined <- e.drv.Release(context.Background(), dev) }()
		// Waiting on the one write, with no second write started.
		require.Eventually(t, func() bool { return gpu.ReleaseWaiters(e.drv, dev) == 1 }, waitFor, time.Millisecond,
			"the second caller never waited on the write in flight")
		assert.Equal(t, 1, e.sim.Server.Blocked(), "one write blocked, not two")
		select {
		case err := <-joined:
			t.Fatalf("joined release returned while blocked: %v", err)
		default:
		}

		e.sim.Clear(t, vgpusim.CtlBlockRelease)
		select {
		case err := <-joined:
			require.NoError(t, err)
		case <-time.After(waitFor):
			t.Fatal("release still blocked after the block was lifted")
		}
		calls := e.log.waitLen(t, 1)
		require.Len(t, calls, 1, "one write for both callers")
		assert.NoError(t, calls[0].err)
		assert.Empty(t, e.devices(t))
		require.NoError(t, e.drv.Release(context.Background(), dev))
	})
}

func TestBlockedReleaseOutcomeGoesToNextCaller(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		dev := e.create(t, f.profile)
		e.sim.Set(t, vgpusim.CtlBlockRelease, "")
		e.sim.Set(t, vgpusim.CtlFailRelease, "EIO")

		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		require.ErrorIs(t, e.drv.Release(ctx, dev), gpu.ErrReleaseInProgress)

		// Nobody waits when the write finally returns: the hook sees it,
		// and so does the next caller.
		e.sim.Clear(t, vgpusim.CtlBlockRelease)
		calls := e.log.waitLen(t, 1)
		assert.ErrorIs(t, calls[0].err, syscall.EIO)
		e.sim.Clear(t, vgpusim.CtlFailRelease)
		assert.ErrorIs(t, e.drv.Release(context.Background(), dev), syscall.EIO, "the kept outcome")
		assert.Len(t, e.devices(t), 1)
		require.NoError(t, e.drv.Release(context.Background(), dev), "a fresh attempt")
		assert.Empty(t, e.devices(t))
	})
}

// Two drivers (as two agents would) share the host lock through the state
// dir: concurrent creates never pick the same VF or take a slot twice.
func TestConcurrentCreatesNeverOverbook(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		other, err := gpu.New(gpu.Config{SysfsRoot: e.sim.Root, StateDir: e.stateDir})
		require.NoError(t, err)
		drivers := []gpu.Driver{e.drv, other}
		const n = 8
		errs := make(chan error, n)
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func(d gpu.Driver) {
				defer wg.Done()
				_, err := d.Create(context.Background(), gpu.CreateRequest{Profile: f.scarce, UUID: uuid.NewString()})
				errs <- err
			}(drivers[i%2])
		}
		wg.Wait()
		close(errs)
		ok := 0
		for err := range errs {
			if err == nil {
				ok++
				continue
			}
			assert.ErrorIs(t, err, gpu.ErrNoCapacity)
		}
		assert.Equal(t, f.scarceN, ok)
		assert.Len(t, e.devices(t), f.scarceN)
	})
}

func TestHostLockHonoursContext(t *testing.T) {
	e := fixtures[0].start(t)
	f, err := os.OpenFile(filepath.Join(e.stateDir, "vgpu.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX)) // another agent holds it

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err = e.drv.Create(ctx, gpu.CreateRequest{Profile: "GRID A100-4C", UUID: uuid.NewString()})
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_UN))
	e.create(t, "GRID A100-4C")
}

func TestIntentIsWrittenAhead(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		var got gpu.Placement
		dev, err := e.drv.Create(context.Background(), gpu.CreateRequest{
			Profile: f.profile, UUID: uuid.NewString(),
			Intent: func(p gpu.Placement) error {
				got = p
				assert.Empty(t, e.devices(t), "intent runs before the device exists")
				return nil
			},
		})
		require.NoError(t, err)
		assert.Equal(t, dev.Parent, got.Parent)
		assert.Equal(t, dev.TypeID, got.TypeID)
		assert.Equal(t, f.profile, got.Profile)

		refuse := errors.New("store is read-only")
		_, err = e.drv.Create(context.Background(), gpu.CreateRequest{
			Profile: f.profile, UUID: uuid.NewString(),
			Intent: func(gpu.Placement) error { return refuse },
		})
		assert.ErrorIs(t, err, refuse)
		assert.Len(t, e.devices(t), 1, "no device without its intent")
	})
}

// Finishing a recorded intent after a crash: creating again at the same
// placement with the same UUID returns the device instead of failing.
func TestPinnedCreateIsIdempotent(t *testing.T) {
	eachDriver(t, func(t *testing.T, f fixture) {
		e := f.start(t)
		var pl gpu.Placement
		u := uuid.NewString()
		dev, err := e.drv.Create(context.Background(), gpu.CreateRequest{
			Profile: f.profile, UUID: u, Intent: func(p gpu.Placement) error { pl = p; return nil },
		})
		require.NoError(t, err)
		again, err := e.drv.Create(context.Background(), gpu.CreateRequest{UUID: u, At: &pl})
		require.NoError(t, err)
		assert.Equal(t, dev.ID, again.ID)
		assert.Len(t, e.devices(t), 1)
	})
}

func TestVendorReleaseLeavesAnotherTypeAlone(t *testing.T) {
	e := fixtures[1].start(t)
	dev := e.create(t, "NVIDIA L40-4Q")
	stale := dev
	stale.TypeID = "598"
	err := e.drv.Release(context.Background(), stale)
	assert.ErrorIs(t, err, gpu.ErrDeviceMismatch)
	assert.Len(t, e.devices(t), 1)
	require.NoError(t, e.drv.Release(context.Background(), dev))
}
