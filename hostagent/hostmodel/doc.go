// Package hostmodel is a state-machine property test of the host agent's
// durable state: the instance store and the lease engine over all four
// kinds of lease (vGPUs of both drivers, mdev and NVIDIA vendor VFIO;
// whole GPUs by passthrough; the network's address and TAP), over the
// FUSE simulator of the GPU sysfs and a network namespace, with real
// short-lived processes (zombie leaders with a live thread, holding their
// device's VFIO node open) standing in for QEMU.
//
// Each check is one host: a vGPU driver (a subtest per driver), five
// whole GPUs in three viable IOMMU groups beside it (two GPUs in one
// group, one with an audio function, one beside a bridge; a fourth group
// holds a NIC and is never offered), a bridge and a subnet, and five
// instances: three ask for vGPUs, two for one and two whole GPUs.
// --gpu-quarantine-after is drawn per check (1 to 3).
//
// pgregory.net/rapid draws random sequences of create, claim (whole GPUs
// with one PCI function failing or blocking its unbind or probe), launch,
// exit, begin-delete, release (ok, failing with an errno, blocked,
// blocked and "crashed" between the sysfs write and the record update;
// for whole GPUs a failed or blocked unbind, reset or probe of one
// function), the delete's release of every lease through the host's one
// engine, reconcile (vGPU and whole-GPU rounds), teardown, delete, spawn
// and remove steps that take one instance through up to four workflow
// stages (checked between them), agent restart, a host reboot (every
// process and device gone, the claims kept; the IOMMU groups renumbered,
// maybe a card removed or another put in its slot), a stray device and a
// stray vfio-pci group, a corrupted record and its repair, QEMU uid
// assignment, network attach and release, the bridge deleted and the TAP
// reconcile round, a quarantine cleared, and a state file system filled
// to the last byte and freed again. After every step the invariants of
// ARCHITECTURE.md are checked against the real system (the sysfs
// listing, the simulator's driver bindings, store.List, the quarantine's
// files, netlink, /proc), not against a model of it:
//
//   - no device without a held claim, and no group with vmflow's
//     vfio-pci mark that no held lease names, past the orphan grace
//     (after a reconcile; relaxed while any record is unreadable);
//   - no held claim without its record (a record holding a claim never
//     disappears, and the store refuses to delete it);
//   - no record removed while the process it names lives;
//   - a delete's step never fails for want of space while the reserve is
//     there to give up;
//   - after a reboot a held claim's device can be re-created at a launch:
//     no other claim took its slot or put another type on its parent; a
//     held whole-GPU lease whose cards are still there binds again;
//   - no VF, mdev UUID or PCI function named by two held leases;
//   - no QEMU uid named by two records, one that cannot be read included;
//   - a device goes away, or a whole GPU leaves vfio-pci, only through its
//     own lease's release (or a reboot), and only when every instance
//     whose held lease named it has no live process group;
//   - a whole GPU's function is on vfio-pci only while a held lease names
//     the card there (a failed claim's rollback leaves nothing bound), and
//     never for the lease of a card that was at its address before a
//     reboot: a launch refuses that lease, and its release counts it
//     released, so the delete finishes; the NIC and the bridge that share
//     GPUs' groups keep their drivers;
//   - a strike only for a failure injected on that device in that step (a
//     refusal or a wait never strikes), a device whose strikes reach
//     --gpu-quarantine-after is quarantined, and no lease of any kind is
//     placed on a quarantined device;
//   - the network's address goes back only after every GPU lease of its
//     record; every leased TAP of a readable record is a port of the
//     bridge, isolated and up, except between the bridge's loss and the
//     next TAP reconcile round.
//
// The package holds tests only. `make test` runs a short version;
// `make fuzz` a long one (VMFLOW_MODEL_CHECKS checks per driver kind, or
// rapid's -rapid.checks flag). A failure prints the minimal sequence and a
// -rapid.seed to replay it; -rapid.log prints every step of a passing run.
package hostmodel
