// Package crashpoint kills the host agent at a named step, so the crash
// tests can prove that every persisted step survives a kill -9 (ARCHITECTURE
// invariant 8).
//
// The hooks are compiled in only under the build tag vmflow_crashpoints,
// which the test harness (testsupport/stacktest) builds the binaries with;
// without it (make build, production) Hit is an empty function the compiler
// removes, and the binary holds neither the switch nor its variable. In a
// tagged build the environment variable VMFLOW_CRASHPOINT arms one point,
// read once when the process starts:
//
//	VMFLOW_CRASHPOINT=vmm.launch.forked      die at the first hit
//	VMFLOW_CRASHPOINT=store.write.renamed@3  die at the third hit
//
// An armed point writes one line to stderr ("crashpoint NAME: SIGKILL") and
// sends SIGKILL to its own process: no deferred function, no cleanup, no
// log sync runs, as in a real crash. gofail was not used: it has no kill
// action and rewrites the sources when enabled.
//
// Every point is a constant below and listed in All; the e2e crash matrix
// arms each one in turn and reports a point no run hits.
package crashpoint

import (
	"fmt"
	"strconv"
	"strings"
)

// EnvVar names the point to arm: "name" or "name@N" (the N-th hit, from 1).
const EnvVar = "VMFLOW_CRASHPOINT"

// BuildTag is the build tag that compiles the points in.
const BuildTag = "vmflow_crashpoints"

// The points, in the order a spawn-with-vGPU then a delete reaches them.
// Each one is placed right after a step is persisted (or right before a
// step that creates something outside the record), so a kill there leaves
// the host exactly in the state that step's write describes.
const (
	// AgentReattached: the agent re-attached its records at start, before
	// it serves activities.
	AgentReattached = "agent.reattached"
	// StoreMigrated: agent start wrote one record back in the current
	// shape (Store.Migrate); re-attach has not run.
	StoreMigrated = "store.migrate.written"

	// StoreCreateDir: Create made the instance directory durable; no
	// record is in it yet.
	StoreCreateDir = "store.create.dir"
	// StoreWriteTemp: an atomic write (record or marker) has its temp file
	// written and fsynced, not yet renamed over the target.
	StoreWriteTemp = "store.write.temp"
	// StoreWriteRenamed: an atomic write renamed its temp file over the
	// target; the directory is not fsynced yet.
	StoreWriteRenamed = "store.write.renamed"
	// ActivityCreateRecordDone: CreateRecord did its work and is about to
	// report it (the worker never hears of it when the agent dies here).
	ActivityCreateRecordDone = "activity.create_record.done"

	// ClaimIntentWritten: the claim's intent (placement, UUID) is in the
	// record; the device is not created yet.
	ClaimIntentWritten = "vgpu.claim.intent_written"
	// ClaimDeviceCreated: the device exists in sysfs; the claim is still
	// an intent in the record.
	ClaimDeviceCreated = "vgpu.claim.device_created"
	// ClaimActivated: the record says the claim is active.
	ClaimActivated = "vgpu.claim.activated"
	// ActivityClaimDevicesDone: ClaimVGPU is about to report success.
	ActivityClaimDevicesDone = "activity.claim_devices.done"

	// StoreUIDLedgerWritten: the uid ledger names the instance's new QEMU
	// uid; the record does not yet.
	StoreUIDLedgerWritten = "store.uid.ledger_written"
	// LaunchBeforeFork: QEMU's argv and log are ready; nothing forked.
	LaunchBeforeFork = "vmm.launch.before_fork"
	// LaunchForked: QEMU is forked; its pid is not recorded yet.
	LaunchForked = "vmm.launch.forked"
	// LaunchPIDRecorded: QEMU's identity is in the record; QMP not awaited.
	LaunchPIDRecorded = "vmm.launch.pid_recorded"
	// LaunchQMPReady: QMP said running; the record still says Creating.
	LaunchQMPReady = "vmm.launch.qmp_ready"
	// LaunchRunningRecorded: the record says Running.
	LaunchRunningRecorded = "supervise.launch.running_recorded"
	// ActivityLaunchVMDone: LaunchVM is about to report success.
	ActivityLaunchVMDone = "activity.launch_vm.done"

	// MarkerWritten: the manual-stop marker is on disk.
	MarkerWritten = "store.marker.written"
	// BeginDeleteRecorded: the record says Deleting.
	BeginDeleteRecorded = "activity.begin_delete.recorded"

	// StopPowerdownSent .. StopGone: the stop ladder recorded that step
	// (StopStep names them from vmm's step names).
	StopPowerdownSent = "vmm.stop.powerdown_sent"
	StopQuitSent      = "vmm.stop.quit_sent"
	StopKillSent      = "vmm.stop.kill_sent"
	StopGone          = "vmm.stop.gone"
	// ActivityStopVMDone: StopVM is about to report success.
	ActivityStopVMDone = "activity.stop_vm.done"
	// ActivityWaitVMExitDone: WaitVMExit is about to report success.
	ActivityWaitVMExitDone = "activity.wait_vm_exit.done"

	// ClaimRollingBack: a claim of several that failed part-way marked one
	// of its leases rolling back; its device is not released yet.
	ClaimRollingBack = "vgpu.claim.rolling_back"
	// ClaimRolledBack: that lease's device is released and the lease
	// dropped from the record.
	ClaimRolledBack = "vgpu.claim.rolled_back"

	// PassthroughIntentWritten: a whole GPU's lease (its group, functions
	// and their drivers) is in the record; no sysfs write yet.
	PassthroughIntentWritten = "passthrough.claim.intent_written"
	// PassthroughSysfsWritten: one sysfs write of a bind or a return
	// succeeded (driver_override, unbind, drivers_probe, reset); armed at
	// its N-th hit it stops between any two of them.
	PassthroughSysfsWritten = "passthrough.sysfs.written"
	// PassthroughActivated: the lease says the group is bound to vfio-pci.
	PassthroughActivated = "passthrough.claim.activated"

	// ReleaseReleasing: the claim's phase says Releasing; nothing written
	// to sysfs yet.
	ReleaseReleasing = "vgpu.release.releasing_recorded"
	// ReleaseWritten: the release write to sysfs returned; the record
	// still holds the claim.
	ReleaseWritten = "vgpu.release.written"
	// ReleaseRecorded: the record says the claim is released.
	ReleaseRecorded = "vgpu.release.recorded"
	// PassthroughReleasing: a whole GPU's lease says releasing; its group
	// is still on vfio-pci.
	PassthroughReleasing = "passthrough.release.releasing_recorded"
	// PassthroughReturned: the group is back on its drivers; the record
	// still holds the lease.
	PassthroughReturned = "passthrough.release.returned"
	// PassthroughReleased: the record says the lease is released.
	PassthroughReleased = "passthrough.release.recorded"
	// ActivityReleaseLeasesDone: ReleaseVGPU is about to report success.
	ActivityReleaseLeasesDone = "activity.release_leases.done"
	// QuarantineDue: a device's release failed K times or more, the last
	// failure is in the record, and the quarantine file is not written yet
	// (hit on every such failure, even one that adds nothing).
	QuarantineDue = "gpu.quarantine.due"
	// QuarantineWritten: the quarantine file names the device.
	QuarantineWritten = "gpu.quarantine.written"
	// ReconcileReleased: a reconcile round released (and recorded) the
	// claim of an instance being deleted.
	ReconcileReleased = "vgpu.reconcile.released"

	// TearDownSocketRemoved: TearDown removed the QMP socket and pidfile.
	TearDownSocketRemoved = "activity.tear_down.socket_removed"
	// RecordTrashed: Delete renamed the instance directory to the trash;
	// its files are not removed yet.
	RecordTrashed = "store.delete.trashed"
	// ActivityDeleteRecordDone: DeleteRecord is about to report success.
	ActivityDeleteRecordDone = "activity.delete_record.done"

	// NetIntentWritten: the network lease's intent (address, TAP name,
	// MAC) is in the record; no TAP made yet.
	NetIntentWritten = "network.lease.intent_written"
	// NetTAPCreated: the lease's TAP exists on the bridge; the lease may
	// still say intent.
	NetTAPCreated = "network.tap.created"
	// NetActivated: the record says the network lease is active.
	NetActivated = "network.lease.activated"
	// NetReleasing: the network lease's phase says Releasing; the TAP is
	// still there.
	NetReleasing = "network.release.releasing_recorded"
	// NetTAPRemoved: the TAP is gone; the record still holds the lease.
	NetTAPRemoved = "network.release.tap_removed"
	// NetReleased: the record says the network lease is released.
	NetReleased = "network.release.recorded"

	// CapacityPlaced: a launch made the record's capacity lease active
	// (reserved again when its intent had expired); no QEMU started yet.
	CapacityPlaced = "capacity.placed"
	// CapacityReleasing: the capacity lease's phase says Releasing.
	CapacityReleasing = "capacity.release.releasing_recorded"
	// CapacityReleased: the record says the capacity lease is released.
	CapacityReleased = "capacity.release.recorded"
)

// All lists every point, in the order of the constants above.
var All = []string{
	StoreMigrated, AgentReattached,
	StoreCreateDir, StoreWriteTemp, StoreWriteRenamed, ActivityCreateRecordDone,
	ClaimIntentWritten, ClaimDeviceCreated, ClaimActivated, ClaimRollingBack, ClaimRolledBack,
	PassthroughIntentWritten, PassthroughSysfsWritten, PassthroughActivated, ActivityClaimDevicesDone,
	StoreUIDLedgerWritten, LaunchBeforeFork, LaunchForked, LaunchPIDRecorded, LaunchQMPReady, LaunchRunningRecorded, ActivityLaunchVMDone,
	MarkerWritten, BeginDeleteRecorded,
	StopPowerdownSent, StopQuitSent, StopKillSent, StopGone, ActivityStopVMDone, ActivityWaitVMExitDone,
	ReleaseReleasing, ReleaseWritten, ReleaseRecorded, PassthroughReleasing, PassthroughReturned, PassthroughReleased,
	QuarantineDue, QuarantineWritten, ActivityReleaseLeasesDone, ReconcileReleased,
	TearDownSocketRemoved, RecordTrashed, ActivityDeleteRecordDone,
	NetIntentWritten, NetTAPCreated, NetActivated, NetReleasing, NetTAPRemoved, NetReleased,
	CapacityPlaced, CapacityReleasing, CapacityReleased,
}

// StopStep is the point of a stop-ladder step, named as vmm names its steps
// ("powerdown_sent", "quit_sent", "kill_sent", "gone").
func StopStep(step string) string { return "vmm.stop." + step }

// Parse splits an EnvVar value into the point's name and the hit number.
// The name must be one of All.
func Parse(spec string) (name string, n int64, err error) {
	name, count, hasCount := strings.Cut(spec, "@")
	n = 1
	if hasCount {
		if n, err = strconv.ParseInt(count, 10, 64); err != nil || n < 1 {
			return "", 0, fmt.Errorf("%q: the hit number after @ must be a positive integer", spec)
		}
	}
	if !Known(name) {
		return "", 0, fmt.Errorf("%q: no such crash point", name)
	}
	return name, n, nil
}

// Known reports whether name is one of All.
func Known(name string) bool {
	for _, p := range All {
		if p == name {
			return true
		}
	}
	return false
}
