package supervise

import "vmflow/internal/errdefs"

// Sentinel errors callers branch on with errors.Is. Where the store has
// one for the same fact, supervise wraps the store's rather than minting
// its own: store.ErrBusy (another operation on the instance is in progress:
// a second Stop while one runs, or the caller's context ended while
// waiting for a Launch, Stop or restart to finish; retryable),
// store.ErrDeleting (Launch of a record in Deleting or ReleaseFailed) and
// store.ErrManualStopMissing (Stop without the manual-stop marker: the
// restart policy could bring the VM back; write it first with
// store.MarkManualStop).
var (
	// ErrManualStop: Launch refused because the instance's manual-stop
	// marker is on disk (a delete has begun; invariant 6). Not retryable.
	ErrManualStop = errdefs.Deleting.New("manual-stop marker present")
	// ErrNotRunning: the instance has no live VM (for QMP on demand).
	ErrNotRunning = errdefs.NotFound.New("instance has no running VM")
	// ErrClosed: the supervisor was closed.
	ErrClosed = errdefs.Unavailable.New("supervisor closed")
	// ErrNoSpec: a launch needs a QEMU spec the record alone cannot give
	// (a vGPU device path); set Config.PrepareLaunch.
	ErrNoSpec = errdefs.Misconfigured.New("no launch spec for the instance")
	// ErrStillRunning: TearDown refused because a QEMU of the instance may
	// still live (its recorded process, one a launch marker could not rule
	// out, or a socket that still accepts connections). Retryable: stop it
	// first, or wait.
	ErrStillRunning = errdefs.StillAlive.New("a QEMU of the instance may still be running")
	// ErrNotRunningAsAsked: Existing found the instance in another shape
	// than running: the error's text says what is there (exited, paused,
	// QMP did not answer, launch in progress, no process, ...). Nothing was
	// touched. Not retryable for a spawn that did not create the instance.
	ErrNotRunningAsAsked = errdefs.Exists.New("instance is not running as asked")
)
