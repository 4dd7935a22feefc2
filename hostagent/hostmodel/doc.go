// Package hostmodel is a state-machine property test of the host agent's
// durable state: the instance store, the vGPU claims and both vGPU drivers
// (mdev and NVIDIA vendor VFIO) over the FUSE simulator, with real
// short-lived processes (zombie leaders with a live thread, holding their
// device's VFIO node open) standing in for QEMU.
//
// pgregory.net/rapid draws random sequences of create, claim, launch, exit,
// begin-delete, release (ok, failing with an errno, blocked, blocked and
// "crashed" between the sysfs write and the record update), reconcile,
// teardown, delete, agent restart, a host reboot (every process and device
// gone, the claims kept), a stray device, a corrupted record and its
// repair, QEMU uid assignment, and a state file system filled to the last
// byte and freed again. After every step the invariants of ARCHITECTURE.md are
// checked against the real system (the sysfs listing, store.List, /proc),
// not against a model of it:
//
//   - no device without a held claim past the orphan grace (after a
//     reconcile; relaxed while any record is unreadable);
//   - no held claim without its record (a record holding a claim never
//     disappears, and the store refuses to delete it);
//   - no record removed while the process it names lives;
//   - a delete's step never fails for want of space while the reserve is
//     there to give up;
//   - after a reboot a held claim's device can be re-created at a launch:
//     no other claim took its slot or put another type on its parent;
//   - no VF or mdev UUID named by two held claims;
//   - no QEMU uid named by two records, one that cannot be read included;
//   - a device goes away only when every instance whose held claim named it
//     has no live process group.
//
// The package holds tests only. `make test` runs a short version;
// `make fuzz` a long one (VMFLOW_MODEL_CHECKS checks per driver kind, or
// rapid's -rapid.checks flag). A failure prints the minimal sequence and a
// -rapid.seed to replay it.
package hostmodel
