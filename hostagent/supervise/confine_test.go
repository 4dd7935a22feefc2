package supervise

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/proc/proctest"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

func requiresRoot(t *testing.T) { proctest.RequiresRoot(t, "QEMU is exec'd as a uid of its own") }

// statusOf returns the named fields of /proc/<pid>/status.
var statusOf = proctest.Status

func uids4(u uint32) string {
	s := strconv.FormatUint(uint64(u), 10)
	return strings.Join([]string{s, s, s, s}, " ")
}

// Confinement through the supervisor: two instances get
// different uids from the range, recorded in their records and in no other
// (the store's host-wide lock); each QEMU runs as its recorded uid, under
// seccomp, with no capabilities and PATH and LC_ALL=C as its environment;
// a restart keeps the uid. An exit nobody asked for is still reported to
// OnExitRecorded.
func TestConfinedLaunchOwnUIDs(t *testing.T) {
	requiresRoot(t)
	e := newEnv(t)
	detected := make(chan time.Duration, 1)
	sup := e.newSupervisor(func(c *Config) {
		c.OnExitRecorded = func(d time.Duration) { detected <- d }
	})
	e.create("vm1", "on-failure", 0)
	e.create("vm2", "never", 0)
	r1, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	r2, err := sup.Launch(ctxT(t, 30*time.Second), "vm2")
	require.NoError(t, err)

	u1, u2 := e.get("vm1").GetQemuUid(), e.get("vm2").GetQemuUid()
	assert.True(t, e.uids.Contains(u1) && e.uids.Contains(u2), "%d and %d from %s", u1, u2, e.uids)
	assert.NotEqual(t, u1, u2, "no two records share a uid")
	for _, c := range []struct {
		pid int
		uid uint32
	}{{r1.Identity.PID, u1}, {r2.Identity.PID, u2}} {
		st := statusOf(t, c.pid)
		assert.Equal(t, uids4(c.uid), st["Uid"])
		assert.Equal(t, uids4(c.uid), st["Gid"])
		assert.Equal(t, "2", st["Seccomp"])
		assert.Equal(t, "0000000000000000", st["CapEff"])
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", c.pid))
		require.NoError(t, err)
		assert.Equal(t, []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C"},
			strings.Split(string(bytes.TrimSuffix(env, []byte{0})), "\x00"))
	}

	// Killed from outside: recorded, reported, restarted by the policy
	// under the same uid.
	killFromOutside(t, e, "vm1")
	select {
	case d := <-detected:
		assert.GreaterOrEqual(t, d, time.Duration(0))
	case <-ctxT(t, 20*time.Second).Done():
		t.Fatal("OnExitRecorded was not called for a QEMU killed from outside")
	}
	require.Eventually(t, func() bool {
		p := e.get("vm1").GetProcess()
		return p != nil && int(p.GetPid()) != r1.Identity.PID
	}, 30*time.Second, 10*time.Millisecond, "restarted")
	rec := e.get("vm1")
	assert.Equal(t, u1, rec.GetQemuUid(), "a restart keeps its uid")
	require.Eventually(t, func() bool { return statusOf(t, int(rec.GetProcess().GetPid()))["Uid"] == uids4(u1) },
		10*time.Second, 10*time.Millisecond)
}

// A uid of the range that a live process holds (a stray process, or
// another agent's QEMU on a machine whose ranges overlap) is never given
// to an instance, although no record names it.
func TestHeldUIDNotReused(t *testing.T) {
	requiresRoot(t)
	e := newEnv(t)
	held := e.uids.First
	cmd := exec.Command("sleep", "600")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: held, Gid: held}}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	sup := e.newSupervisor(nil)
	e.create("vm1", "", 0)
	res, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.NoError(t, err)
	uid := e.get("vm1").GetQemuUid()
	assert.NotEqual(t, held, uid, "uid %d is held by pid %d", held, cmd.Process.Pid)
	assert.Equal(t, held+1, uid)
	assert.Equal(t, uids4(uid), statusOf(t, res.Identity.PID)["Uid"])
}

// A KVM node its group cannot open fails KVM launches with the typed error
// naming the mode (recorded as the instance's last error); the supervisor
// stays up and TCG launches go on. Fails if QEMU opens /dev/kvm as root,
// whatever its mode.
func TestKVMGroupCannotOpen(t *testing.T) {
	requiresRoot(t)
	e := newEnv(t)
	node := filepath.Join(t.TempDir(), "kvm")
	require.NoError(t, os.WriteFile(node, nil, 0o600))
	sup := e.newSupervisor(func(c *Config) { c.KVMDevice = node })
	_, err := e.st.Create(ctxT(t, 5*time.Second), &vmflowv1.InstanceRecord{Id: "kvm",
		Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: "kvm"}})
	require.NoError(t, err)
	_, err = e.st.Create(ctxT(t, 5*time.Second), &vmflowv1.InstanceRecord{Id: "tcg",
		Spec: &vmflowv1.VMSpec{Vcpus: 1, MemoryMib: 64, Machine: "none", Accel: "tcg"}})
	require.NoError(t, err)

	_, err = sup.Launch(ctxT(t, 30*time.Second), "kvm")
	require.ErrorIs(t, err, vmm.ErrKVMAccess)
	assert.Contains(t, err.Error(), "mode 0600")
	rec := e.get("kvm")
	assert.Nil(t, rec.GetProcess())
	assert.Nil(t, rec.GetLaunchStartedAt())
	assert.Contains(t, rec.GetLastError(), "mode 0600")

	require.NoError(t, sup.Alive(ctxT(t, 5*time.Second)))
	_, err = sup.Launch(ctxT(t, 30*time.Second), "tcg")
	require.NoError(t, err, "TCG needs no /dev/kvm")
}

// A VFIO device's group node is the instance uid's while its QEMU may run
// and root's again once the launch failed (or the QEMU is recorded gone);
// the record lists the node in between, so whichever agent records the end
// takes it back. The device here is a fake sysfs entry QEMU cannot open,
// so the launch fails after the fork.
func TestVFIOGroupNodeGivenAndTakenBack(t *testing.T) {
	requiresRoot(t)
	e := newEnv(t)
	sys, dev := t.TempDir(), t.TempDir()
	sysfsdev := filepath.Join(sys, "bus", "mdev", "devices", "5e1b5c4a-2c55-4b1e-9a34-7d0c3f2a9b10")
	require.NoError(t, os.MkdirAll(sysfsdev, 0o755))
	require.NoError(t, os.Symlink("../../../../kernel/iommu_groups/7", filepath.Join(sysfsdev, "iommu_group")))
	node := filepath.Join(dev, "vfio", "7")
	require.NoError(t, os.MkdirAll(filepath.Dir(node), 0o755))
	require.NoError(t, os.WriteFile(node, nil, 0o600))

	ownerAtFork := make(chan uint32, 1)
	sup := e.newSupervisor(func(c *Config) {
		c.DevRoot = dev
		c.PrepareLaunch = func(_ context.Context, _ *store.Locked, rec *vmflowv1.InstanceRecord) (vmm.VMSpec, error) {
			return vmm.VMSpec{Name: rec.GetId(), VCPUs: 1, MemoryMiB: 64, Machine: vmm.MachineQ35, Accel: vmm.AccelTCG,
				VFIO: []string{sysfsdev}}, nil
		}
	})
	sup.hooks.beforeRecorded = func(string, proc.Identity) {
		fi, err := os.Stat(node)
		if err == nil {
			ownerAtFork <- fi.Sys().(*syscall.Stat_t).Uid
		}
	}
	e.create("vm1", "", 0)
	_, err := sup.Launch(ctxT(t, 30*time.Second), "vm1")
	require.Error(t, err, "QEMU cannot open a fake sysfs device")
	rec := e.get("vm1")
	select {
	case owner := <-ownerAtFork: // beforeRecorded runs inside Launch
		assert.Equal(t, rec.GetQemuUid(), owner, "the node is the instance uid's while its QEMU may run")
	default:
		t.Fatalf("the launch failed before the fork: %v", err)
	}
	fi, err := os.Stat(node)
	require.NoError(t, err)
	assert.Equal(t, uint32(0), fi.Sys().(*syscall.Stat_t).Uid, "root's again after the failed launch")
	assert.Empty(t, rec.GetVfioGroupNodes())
}
