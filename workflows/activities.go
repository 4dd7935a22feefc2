package workflows

import (
	"context"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// HostActivities is the contract between the workflows and the host agent:
// the activities the workflows schedule on vmflow-host-<host_id>, by method
// name. activities.Activities implements it (checked at compile time), and
// the workflow tests mock exactly these methods.
type HostActivities interface {
	// ValidateSpawn checks a spawn request against the host (image roots,
	// vGPU profiles, size) before anything is created.
	ValidateSpawn(ctx context.Context, req *vmflowv1.SpawnRequest) error
	CreateRecord(ctx context.Context, req *vmflowv1.SpawnRequest) (*vmflowv1.CreateRecordResult, error)
	// ClaimDevices gives the instance the GPUs it asks for (vGPUs or
	// whole GPUs), all or none. (The agent also registers it as ClaimVGPU,
	// its name in runs recorded before the lease engine:
	// HostActivityNames.)
	ClaimDevices(ctx context.Context, req *vmflowv1.ClaimVGPURequest) (*vmflowv1.ClaimVGPUResult, error)
	// LaunchVM starts QEMU and returns once QMP says running.
	LaunchVM(ctx context.Context, req *vmflowv1.LaunchVMRequest) (*vmflowv1.LaunchVMResult, error)
	// BeginDelete writes the manual-stop marker and moves the record to
	// Deleting, before any stop action.
	BeginDelete(ctx context.Context, req *vmflowv1.BeginDeleteRequest) (*vmflowv1.BeginDeleteResult, error)
	StopVM(ctx context.Context, req *vmflowv1.StopVMRequest) (*vmflowv1.StopVMResult, error)
	// WaitVMExit returns once the VM's whole thread group is gone.
	WaitVMExit(ctx context.Context, ref *vmflowv1.InstanceRef) error
	// ReleaseLeases releases every lease the instance holds, once its
	// thread group is gone (also registered as ReleaseVGPU, its name
	// before the lease engine).
	ReleaseLeases(ctx context.Context, ref *vmflowv1.InstanceRef) (*vmflowv1.ReleaseVGPUResult, error)
	TearDown(ctx context.Context, ref *vmflowv1.InstanceRef) error
	DeleteRecord(ctx context.Context, ref *vmflowv1.InstanceRef) error
	ReconcileHost(ctx context.Context, req *vmflowv1.ReconcileVGPURequest) (*vmflowv1.ReconcileVGPUResult, error)
}
