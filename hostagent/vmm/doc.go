// Package vmm runs QEMU for vmflow: it turns a typed VMSpec into QEMU's argv
// (a pure function, no free-form passthrough), launches QEMU in a session of
// its own through hostagent/proc, talks QMP to it, and stops it with the
// ladder system_powerdown → quit → SIGKILL through a pidfd → wait for the
// whole thread group.
//
// The package never imports Temporal and never touches the instance store:
// it reports what the caller must persist through hooks (LaunchConfig.OnStarted,
// LaunchConfig.OnFailed, StopConfig.OnStep), called at the moments the
// ARCHITECTURE invariants name — the pid right after the fork, the cleared pid
// only once a failed launch is reaped, each stop step as it is taken.
//
// Exit is only ever concluded from the pidfd (proc.Handle.Wait), never from
// the QMP monitor's EOF: QEMU closes the monitor before its thread group,
// which on KVM includes the kernel's kvm-nx-lpage-re task, is gone.
//
// go-qemu's qmp monitor is not used (qmp.go says more): no per-call deadline
// or context, an unbuffered event channel that stalls replies, and a
// greeting read that races early events.
package vmm
