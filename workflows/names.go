// Package workflows holds vmflow's durable workflows (SpawnInstance,
// DeleteInstance, ReconcileVGPU) and the typed client the platform API uses
// to start, signal and query them.
//
// Workflow code is deterministic and never touches the OS: everything that
// happens on a host is an activity on that host's task queue,
// vmflow-host-<host_id>, named by the constants below. The activities
// package registers methods with exactly these names (a test there checks).
package workflows

import (
	"go.temporal.io/sdk/temporal"

	"vmflow/internal/contract"
)

// Workflow type names, as the CLI and the platform API spell them.
const (
	SpawnWorkflow     = "SpawnInstance"
	DeleteWorkflow    = "DeleteInstance"
	ReconcileWorkflow = "ReconcileVGPU"
	// FleetHostWorkflow holds one host's published view in its memo
	// (FleetViewMemo) and waits, with no timer, until the host's next
	// publish replaces it: one per host, fleet-host/<host_id>.
	FleetHostWorkflow = "FleetHost"
)

// WorkflowNames lists every workflow type the worker registers.
var WorkflowNames = []string{SpawnWorkflow, DeleteWorkflow, ReconcileWorkflow, FleetHostWorkflow}

// FleetHostWorkflowID is the id of a host's FleetHost workflow.
func FleetHostWorkflowID(hostID string) string { return "fleet-host/" + hostID }

// FleetViewMemo is the memo field of a FleetHost workflow that holds the
// host's vmflowv1.HostView.
const FleetViewMemo = "view"

// Local activities the workflow worker runs for placement (platform/fleet
// registers them under these names).
const (
	// LocalActivityChooseHosts reads the fleet view and returns the
	// hosts to ask for a grant, best first.
	LocalActivityChooseHosts = "ChooseHosts"
	// LocalActivityFindInstanceHost finds the host an instance's latest
	// spawn was placed on.
	LocalActivityFindInstanceHost = "FindInstanceHost"
)

// LostGrantDeleteWorkflowID is the id of the clean-up a placing spawn
// starts on a host whose grant's outcome it could not learn (the agent
// took the task and was not heard of again) before it moves on: a delete
// of only this spawn's record on that host, apart from the instance's own
// delete/<instance_id>.
func LostGrantDeleteWorkflowID(instanceID, hostID string) string {
	return "delete/" + instanceID + "/lost-grant/" + hostID
}

// DefaultTaskQueue is where the workflows run (the worker's --task-queue,
// the agent's --workflow-task-queue).
const DefaultTaskQueue = contract.DefaultTaskQueue

// HostTaskQueue is the task queue of one host's agent.
func HostTaskQueue(hostID string) string { return contract.HostTaskQueuePrefix + hostID }

// SpawnWorkflowID is the id of an instance's spawn workflow.
func SpawnWorkflowID(instanceID string) string { return "spawn/" + instanceID }

// DeleteWorkflowID is the id of an instance's delete workflow.
func DeleteWorkflowID(instanceID string) string { return "delete/" + instanceID }

// ReconcileScheduleID is the id of a host's reconcile schedule.
func ReconcileScheduleID(hostID string) string { return "reconcile-vgpu/" + hostID }

// Messages. retry and abandon are both an update (answers with the new
// status or the reason it was refused) and a signal (tctl, the reconcile).
const (
	RetrySignal   = "retry"
	AbandonSignal = "abandon"
	RetryUpdate   = RetrySignal
	AbandonUpdate = AbandonSignal
	StatusQuery   = "status"
)

// Host activity names (methods of activities.Activities).
const (
	ActivityValidateSpawn = "ValidateSpawn"
	ActivityCreateRecord  = "CreateRecord"
	ActivityClaimDevices  = "ClaimDevices"
	ActivityClaimVGPU     = "ClaimVGPU" // ClaimDevices' name before the lease engine
	ActivityLaunchVM      = "LaunchVM"
	ActivityBeginDelete   = "BeginDelete"
	ActivityStopVM        = "StopVM"
	ActivityWaitVMExit    = "WaitVMExit"
	ActivityReleaseLeases = "ReleaseLeases"
	ActivityReleaseVGPU   = "ReleaseVGPU" // ReleaseLeases' name before the lease engine
	ActivityTearDown      = "TearDown"
	ActivityDeleteRecord  = "DeleteRecord"
	ActivityReconcileHost = "ReconcileHost"

	// Combined activities (CombinedActivities) of spawn runs of
	// changeLazySA version 4 and delete runs of versionStuckBound 5.
	ActivityPrepareSpawn   = "PrepareSpawn"   // CreateRecord + ClaimDevices
	ActivityStopInstance   = "StopInstance"   // BeginDelete + StopVM + WaitVMExit
	ActivityRemoveInstance = "RemoveInstance" // TearDown + DeleteRecord
)

// HostActivityNames lists every activity the host agent must register.
var HostActivityNames = []string{
	ActivityValidateSpawn, ActivityCreateRecord, ActivityClaimDevices, ActivityClaimVGPU, ActivityLaunchVM,
	ActivityBeginDelete, ActivityStopVM, ActivityWaitVMExit, ActivityReleaseLeases, ActivityReleaseVGPU,
	ActivityTearDown, ActivityDeleteRecord, ActivityReconcileHost,
	ActivityPrepareSpawn, ActivityStopInstance, ActivityRemoveInstance,
}

// Error types: the Type of every application error a host activity
// returns, which the workflows branch on and the Web UI shows. Each host
// error class has one (errorTypes); HostError is an error from outside the
// host's code, ReleaseFailed such an error from a vGPU release.
const (
	// Non-retryable: no retry can change the answer.

	ErrTypeInvalidInput     = "InvalidInput"
	ErrTypeIdentityMismatch = "IdentityMismatch"
	ErrTypeConflict         = "Conflict"         // a record with another spec exists
	ErrTypeInstanceDeleting = "InstanceDeleting" // spawn of an instance being deleted
	ErrTypeHostUnreachable  = "HostUnreachable"  // the spawn gave up waiting for its host
	// A spawn without a host found none that could serve it: the message
	// names what was asked, the fleet's best offer and the hosts tried.
	ErrTypeNoFleetCapacity = "NoFleetCapacity"
	// A spawn found an instance another spawn created that is not running
	// as asked (exited, paused, hung, a launch in progress, unreadable): it
	// reports what is there and touches nothing (invariant 9).
	ErrTypeInstanceExists = "InstanceExists"
	// The instance's record cannot be read (truncated, hand-edited, from a
	// newer agent): nothing acts on it until an operator repairs it.
	ErrTypeRecordUnreadable = "RecordUnreadable"
	// The instance holds a lease of a kind this agent cannot serve (a
	// vGPU with --vgpu-driver=none, an address without --net-subnet, a
	// whole GPU without --gpu-passthrough). The string keeps its first
	// name: operators' filters and recorded failures carry it.
	ErrTypeVGPUUnavailable = "VGPUUnavailable"
	// An operator action (the retry or abandon update) was refused; the
	// message says why ("abandon refused: host h1 is reachable (stage
	// stopping)").
	ErrTypeRefused = "Refused"
	// The host's admission policy refused to launch a recorded instance:
	// its spec is outside the policy the agent runs with now (an image
	// root removed, a lower maximum), or the record was written by a
	// caller that skipped admission. Nothing was started or opened.
	ErrTypeAdmissionRefused = "AdmissionRefused"
	// Two held claims name one vGPU device (invariant 10 broken by a
	// record from before the ledger, or by hand). Acting on the device
	// could destroy the other instance's vGPU, so an operator decides.
	ErrTypeDeviceClaimedTwice = "DeviceClaimedTwice"
	// More than one process looks like the instance's unrecorded QEMU (a
	// record from an agent before launch markers, and a copy someone
	// started by hand). Nothing is signalled; an operator decides.
	ErrTypeAmbiguousQEMU = "AmbiguousQEMU"
	// The host cannot run this launch as configured: /dev/kvm's group cannot
	// open it (so a confined QEMU could not either), a launch came without a
	// uid of its own for QEMU, or the agent's wiring gives no launch spec
	// for the record (supervise.ErrNoSpec). No retry changes that; the spawn
	// fails at once saying why, and an operator fixes the host.
	ErrTypeHostMisconfigured = "HostMisconfigured"
	// A stop or a move to deleting was asked for without the manual-stop
	// marker (invariant 6): the caller skipped BeginDelete, or the marker
	// was removed by hand. Stopping anyway would let the restart policy
	// bring the VM back.
	ErrTypeManualStopMissing = "ManualStopMissing"

	// Retryable: the host may answer otherwise later.

	ErrTypeBusy = "Busy" // another operation works on the instance
	// The VM's thread group outlived the stop ladder: treat it as alive.
	ErrTypeStillAlive = "VMStillAlive"
	// QEMU exited or did not answer QMP in time during a launch.
	ErrTypeLaunchFailed = "LaunchFailed"
	// A vGPU release failed for a reason from outside the host's code (the
	// kernel refused the write); the claim and the record are kept. A
	// refusal of a class (the VM may still run) keeps its class's type.
	ErrTypeReleaseFailed = "ReleaseFailed"
	// The record still holds a vGPU claim (invariant 1).
	ErrTypeClaimHeld = "ClaimHeld"
	// No vGPU of the profile is free on the host.
	ErrTypeNoCapacity = "NoVGPUCapacity"
	// The host's capacity ledger has no room for the VM's vCPUs, memory
	// or hugepages now; the message says what was asked and what is free.
	ErrTypeNoHostCapacity = "NoHostCapacity"
	// The host is draining (vmflow-hostagent drain): it grants no new VM
	// until undrained; its running VMs stay. Placement moves on.
	ErrTypeHostDraining = "HostDraining"
	// Every uid of the agent's --qemu-uid-range is taken (by records or
	// live processes): a launch waits for one to be freed.
	ErrTypeNoQEMUUID = "NoQEMUUID"
	// The instance's claimed vGPU is missing (after a reboot) and could not
	// be re-created where the claim says: the launch waits for it.
	ErrTypeClaimDeviceMissing = "ClaimDeviceMissing"
	// What the activity looked for is not there now (a record, a process,
	// a running VM).
	ErrTypeNotFound = "NotFound"
	// A part the host drives did not answer as it should (QMP closed or out
	// of protocol, the supervisor closing, records it needs unreadable).
	ErrTypeUnavailable = "Unavailable"
	// The host's own code or data broke a rule it keeps: a bug or a hand
	// edit, for a developer or an operator to look at.
	ErrTypeInternal = "HostInternal"
	// An error of no class: one from outside the host's code (a syscall,
	// file I/O, sysfs), which the next attempt may not meet.
	ErrTypeHost = "HostError"
)

// Search attributes that make stuck work findable in the Web UI.
var (
	SAInstanceID     = temporal.NewSearchAttributeKeyKeyword(contract.SAInstanceID)
	SAHostID         = temporal.NewSearchAttributeKeyKeyword(contract.SAHostID)
	SAStage          = temporal.NewSearchAttributeKeyKeyword(contract.SAStage)
	SANeedsAttention = temporal.NewSearchAttributeKeyBool(contract.SANeedsAttention)
)

// Stages (the VmStage values and the status query's stage).
const (
	StageValidating     = "validating"
	StageCreatingRecord = "creating-record"
	StageClaimingGPUs   = "claiming-gpus"
	StageClaimingVGPU   = "claiming-vgpu" // StageClaimingGPUs in runs recorded before the lease engine
	StageLaunching      = "launching"
	StageRunning        = "running"
	StageSpawnFailed    = "spawn-failed"
	// A spawn without a host asks hosts for a grant (status hosts_tried).
	StagePlacing         = "placing"
	StageMarkingStopped  = "marking-stopped"
	StageStopping        = "stopping"
	StageWaitingExit     = "waiting-exit"
	StageReleasingLeases = "releasing-leases"
	StageReleasingVGPU   = "releasing-vgpu" // StageReleasingLeases in runs recorded before the lease engine
	StageReleaseFailed   = "release-failed"
	StageTearingDown     = "tearing-down"
	StageDeleted         = "deleted"
	StageAlreadyAbsent   = "already-absent"
	StageAbandoned       = "abandoned"
	// A failed spawn's clean-up found a record another spawn created and
	// left it alone (invariant 9).
	StageNotOwned        = "not-owned"
	StageHostUnreachable = "host-unreachable"
	StageReconciling     = "reconciling"
	StageReconciled      = "reconciled"
)

// idPattern is the id rule's text, for messages.
const idPattern = contract.IDPattern

// ValidID reports whether s is a valid instance or host id.
func ValidID(s string) bool { return contract.ValidID(s) }
