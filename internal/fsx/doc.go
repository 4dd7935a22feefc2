// Package fsx holds the file-system primitives the host agent's packages
// share, so each rule is written once: the durable atomic replace of a file
// (ARCHITECTURE invariant 7), the context-aware flock(2) poller, and the
// reading and removal of a QEMU pidfile an older agent had QEMU write.
//
// It imports nothing of Temporal or of the agent's own packages;
// testsupport/powercut is a FUSE file system for tests that loses every
// write not yet fsynced.
package fsx
