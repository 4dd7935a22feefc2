// Package contract holds the facts both sides of the Temporal line must
// agree on: the workflow side (workflows/, the worker, the platform client)
// and the host agent's packages (hostagent/...), which may not import
// go.temporal.io and so cannot import workflows/. Each value is defined here
// once and imported by both, instead of copies kept in step by comments.
//
// It imports nothing outside the standard library, so any package can.
package contract

import (
	"fmt"
	"time"
)

// DefaultTaskQueue is where the workflows run: the worker's --task-queue
// and the agent's --workflow-task-queue (where its reconcile Schedule
// starts workflows).
const DefaultTaskQueue = "vmflow"

// HostTaskQueuePrefix starts the task queue of one host's agent:
// vmflow-host-<host_id>.
const HostTaskQueuePrefix = DefaultTaskQueue + "-host-"

// IDPattern is the shape of every instance and host id, checked (CheckID)
// by the workflows before a workflow starts and by the agent's store before
// any path is built from an id. Messages quote it.
const IDPattern = `^[a-z0-9][a-z0-9-]{0,62}$`

// MaxIDLen is the longest id: one leading character plus up to 62 more, so
// an id is a valid DNS label and a short path component.
const MaxIDLen = 63

// CheckID returns nil for an id matching IDPattern, checked by hand (no regexp
// on hot paths or in workflows; FuzzCheckID keeps them equal): one plain path
// component, never "", "..", "a/b".
func CheckID(id string) error {
	if id == "" {
		return fmt.Errorf("empty (must match %s)", IDPattern)
	}
	if len(id) > MaxIDLen {
		return fmt.Errorf("%d bytes long, at most %d allowed (must match %s)", len(id), MaxIDLen, IDPattern)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '-' && i > 0:
		default:
			return fmt.Errorf("%s has %q at byte %d (must match %s)", QuoteID(id), c, i, IDPattern)
		}
	}
	return nil
}

// ValidID reports whether id matches IDPattern.
func ValidID(id string) bool { return CheckID(id) == nil }

// QuoteID quotes an id for a message, shortened so a hostile or mistaken
// megabyte-long id does not flood the logs.
func QuoteID(id string) string {
	const show = 72
	if len(id) > show {
		return fmt.Sprintf("%q...", id[:show])
	}
	return fmt.Sprintf("%q", id)
}

// DefaultStateDir is the agent's --state-dir: instance records, QMP
// sockets, guest logs, the vGPU ledger.
const DefaultStateDir = "/var/lib/vmflow"

// Stop ladder defaults. The agent runs the ladder with them (its
// --graceful-timeout and --group-exit-cap flags, vmm's StopConfig); the
// workflows size the StopVM and WaitVMExit activity timeouts from them.
const (
	// DefaultGracefulTimeout is the wait after system_powerdown before
	// quit when a delete asks for none.
	DefaultGracefulTimeout = 10 * time.Second
	// DefaultGroupExitCap bounds the wait for the whole thread group after
	// SIGKILL (VFIO teardown can take seconds).
	DefaultGroupExitCap = 30 * time.Second
)

// MaxGracefulTimeout caps a delete's graceful_timeout_seconds: the field is
// a uint32 from outside, and 2^32 s (136 years) would park the stop ladder
// before quit/SIGKILL for good, its vGPU never released. The platform
// client refuses more; the agent caps what reaches it anyway (refusing
// there would fail the delete after the manual-stop marker).
const MaxGracefulTimeout = time.Hour

// Search attributes that make stuck work findable in the Web UI
// (ARCHITECTURE.md "Messages"): the workflows write them (typed keys in
// workflows/names.go), both binaries and the dev server create them
// (tclient.SearchAttributes, which must give the same types: a test in
// workflows compares the two).
const (
	SAInstanceID     = "VmInstanceId"     // Keyword
	SAHostID         = "VmHostId"         // Keyword
	SAStage          = "VmStage"          // Keyword
	SANeedsAttention = "VmNeedsAttention" // Bool
)

// contextKey types the workflow context values below.
type contextKey string

// StageKey is the workflow context value under which a host activity call
// carries its stage (a workflows.Stage* value): the workflows set it on
// each call's context, and tracing (platform) puts it on the call's spans.
// Workflow code cannot reach a span itself.
const StageKey contextKey = "vmflow-stage"
