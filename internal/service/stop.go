package service

import "time"

// StopTimeout is how long a binary lets running activities and workflow
// tasks finish after SIGTERM before it cancels them (the SDK's
// worker.Options.WorkerStopTimeout, each binary's --stop-timeout default).
// It is a few seconds under the units' TimeoutStopSec (30 s in
// deploy/vmflow-*.service; deploy's tests hold them together), so the
// binary cancels what is left, closes its client and exits before systemd
// sends SIGKILL.
const StopTimeout = 25 * time.Second

// TraceFlushTimeout bounds the last send of spans when a binary with
// tracing on exits, after the stop timeout: the two stay under the units'
// TimeoutStopSec.
const TraceFlushTimeout = 3 * time.Second
