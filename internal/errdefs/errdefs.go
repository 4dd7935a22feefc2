// Package errdefs holds the classes of failure every host package declares
// its errors in, where they are made, in the manner of containerd's errdefs:
// a sentinel is its class's New ("store.ErrConflict =
// errdefs.Conflict.New(...)"), so errors.Is matches both the sentinel and
// its class, and each class says whether a retry can change the answer.
// The activity edge turns a class into its Temporal error type (one each,
// workflows.ErrorType) and nothing else decides retryability.
//
// An error of no class is one from outside the host's code (a syscall, file
// I/O, the kernel's sysfs): the edge makes it the generic retryable
// HostError, and only such errors get it. Every exported sentinel under
// hostagent/ is declared in a class (TestEverySentinelClassified fails on
// one that is not), and an error made ad hoc is made with its class's
// Errorf wherever the class is known there.
//
// This package imports only the standard library: hostagent/ imports it
// and never imports Temporal.
package errdefs

import (
	"errors"
	"fmt"
)

// Class is a kind of failure. Match it with errors.Is(err, errdefs.Busy).
type Class struct {
	name      string
	retryable bool
}

func (c *Class) Error() string { return c.name }

// Retryable reports whether a later attempt may succeed where this one
// failed, with nobody changing the request or the host.
func (c *Class) Retryable() bool { return c.retryable }

// New returns a sentinel of class c with text as its message: errors.Is holds
// for both the sentinel and c.
func (c *Class) New(text string) error { return &sentinel{text: text, class: c} }

// Errorf is fmt.Errorf of class c, for an error with no sentinel made where its
// class is known; a wrapped class earlier in Classes still wins.
func (c *Class) Errorf(format string, a ...any) error {
	return &classed{err: fmt.Errorf(format, a...), class: c}
}

type classed struct {
	err   error
	class *Class
}

func (e *classed) Error() string        { return e.err.Error() }
func (e *classed) Unwrap() error        { return e.err }
func (e *classed) Is(target error) bool { return target == e.class }

type sentinel struct {
	text  string
	class *Class
}

func (s *sentinel) Error() string { return s.text }

// Is makes the sentinel match its class without unwrapping to it, so its
// chain, and errors.Unwrap, stay as they were.
func (s *sentinel) Is(target error) bool { return target == s.class }

// Context returns a classless sentinel naming the failed step (a hook, an
// overlay): the error beside it decides the class, or HostError if foreign.
func Context(text string) error { return errors.New(text) }

// The classes. Non-retryable ones need a changed request or an operator;
// retryable ones may pass on a later attempt.
var (
	// InvalidInput: the request, or a value in it, is malformed or out of
	// bounds.
	InvalidInput = &Class{"invalid input", false}
	// Refused: this host refuses what was asked, with nothing created: its
	// admission policy, a full state file system, an id its state dir
	// leaves no room for in a socket path.
	Refused = &Class{"refused by the host", false}
	// Conflict: what exists differs from what was asked (another spec,
	// another vGPU profile for the same instance).
	Conflict = &Class{"conflict", false}
	// Deleting: the instance is being deleted; nothing may bring it back.
	Deleting = &Class{"instance being deleted", false}
	// Exists: another spawn's instance is there and not running as asked;
	// it is reported and left alone (invariant 9).
	Exists = &Class{"instance exists", false}
	// ManualStopMissing: a stop came before its manual-stop marker
	// (invariant 6).
	ManualStopMissing = &Class{"manual-stop marker missing", false}
	// IdentityIncomplete: the process identity to act on lacks a part, so
	// nothing is signalled (invariant 3).
	IdentityIncomplete = &Class{"incomplete identity", false}
	// Unreadable: the instance's record cannot be read until an operator
	// repairs it.
	Unreadable = &Class{"record unreadable", false}
	// NoDriver: the instance holds a vGPU claim this agent has no driver
	// to serve.
	NoDriver = &Class{"no vGPU driver", false}
	// ClaimedTwice: two held claims name one device (invariant 10).
	ClaimedTwice = &Class{"device claimed twice", false}
	// Ambiguous: more than one process passes as the instance's QEMU.
	Ambiguous = &Class{"ambiguous process", false}
	// Misconfigured: the host, as configured, cannot do this (its /dev/kvm
	// group, its uid range, its cgroups, its wiring).
	Misconfigured = &Class{"host misconfigured", false}

	// Busy: another operation holds what this one needs.
	Busy = &Class{"busy", true}
	// StillAlive: the VM may still run, or whether it does cannot be told
	// ("can't tell" counts as alive, invariant 2).
	StillAlive = &Class{"still alive", true}
	// LaunchFailed: QEMU exited or did not answer in time during a launch.
	LaunchFailed = &Class{"launch failed", true}
	// ClaimHeld: the record still holds a vGPU claim (invariant 1).
	ClaimHeld = &Class{"claim held", true}
	// NoCapacity: no vGPU of the profile can be placed on the host now.
	NoCapacity = &Class{"no vGPU capacity", true}
	// NoHostCapacity: the host's capacity ledger has no room for the VM's
	// vCPUs, memory or hugepages now (or, with numa "strict", no NUMA node
	// has): a refusal, retryable, as room frees when VMs are deleted.
	NoHostCapacity = &Class{"no host capacity", true}
	// Draining: the host takes no new VMs (vmflow-hostagent drain); the
	// ones it runs stay. A refusal, retryable: undrain ends it. Placement
	// moves on to the next host.
	Draining = &Class{"host draining", true}
	// NoUID: every QEMU uid of the agent's range is taken.
	NoUID = &Class{"no free QEMU uid", true}
	// DeviceMissing: the claim's device is not there (yet, or since a
	// reboot) and could not be made again.
	DeviceMissing = &Class{"claimed device missing", true}
	// NotFound: what was looked for is not there now: a record, a process,
	// a running VM.
	NotFound = &Class{"not found", true}
	// Unavailable: a part the host drives does not answer as it should
	// now: the QMP monitor closed or broke protocol, the supervisor is
	// closing, records the answer depends on are unreadable, a device is
	// not in the shape its claim says.
	Unavailable = &Class{"unavailable", true}
	// Internal: the host's own code or data broke a rule it keeps (an
	// illegal state transition, a lock used after release, a malformed
	// argument between its packages): a bug or a hand edit. Retried, since
	// the next attempt may run after a fix.
	Internal = &Class{"internal", true}
)

// Classes lists every class in precedence order: ClassOf returns the first
// an error matches, so an error that wraps two sentinels (a refusal made of
// field errors, a hook's failure and its cause) gets the more specific one.
var Classes = []*Class{
	Refused, InvalidInput, Conflict, Deleting, Exists, ManualStopMissing, IdentityIncomplete,
	Unreadable, NoDriver, ClaimedTwice, Ambiguous, Busy, StillAlive, Misconfigured,
	NoUID, LaunchFailed, ClaimHeld, NoCapacity, NoHostCapacity, Draining, DeviceMissing,
	NotFound, Unavailable, Internal,
}

// ClassOf returns err's class, or nil for an error from outside the host's
// code.
func ClassOf(err error) *Class {
	if err == nil {
		return nil
	}
	for _, c := range Classes {
		if errors.Is(err, c) {
			return c
		}
	}
	return nil
}
