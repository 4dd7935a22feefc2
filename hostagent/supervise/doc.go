// Package supervise is the single owner of the VMs on one host. It launches
// QEMU through hostagent/vmm with the instance record in hostagent/store
// kept in step at every instant, re-attaches to the VMs that outlived an
// agent restart, watches every VM's exit (event driven: the reaper of a
// child, or a pidfd for a VM the agent re-attached to), records how each VM
// ended, applies the per-instance restart policy, and runs the stop ladder
// on behalf of a delete.
//
// The rules it keeps (ARCHITECTURE invariants 4-8, 11, 12):
//
//   - Every check-then-act on an instance runs under that instance's store
//     lock (a lock file, so a second agent on the same state dir is
//     excluded too) and, inside this process, under a per-instance operation
//     slot, so a Launch, a Stop, an exit being recorded and a restart never
//     interleave.
//   - No process without an owner (invariant 11): a launch marker is in the
//     record before the fork and QEMU's pid and start time replace it right
//     after; a marker left by a killed agent is resolved by finding the QEMU
//     by its uid and guest name (adopted) or clearing it. A failed launch leaves
//     nothing (vmm kills and reaps, the pid and marker are cleared).
//   - One bad record never stops the host (invariant 12): Start quarantines
//     an unreadable record and goes on; TearDown removes runtime files only
//     when no QEMU of the instance can live.
//   - A VM is restarted only while no manual-stop marker exists and the
//     record is not being deleted; the check and the launch happen under the
//     instance lock, so a marker written at any moment (also during a
//     restart's backoff) either precedes the check and blocks the restart,
//     or waits for the lock and sees a VM that its Stop will then stop.
//   - Stop refuses to run without the marker (the delete writes it first) and
//     records each step of the ladder, so a Stop after an agent restart
//     resumes where the previous one was.
//   - A process is signalled only through a pidfd verified against the
//     record's identity; a mismatched pid is treated as gone and never
//     signalled.
//
// Supervision never depends on anything outside the host: no Temporal, no
// network. The activities layer adapts it.
package supervise
