// Package service is what both vmflow binaries need to run as a managed
// service and nothing Temporal-specific, so host-agent packages may use it
// too: the build's version (stamped by `make build`), the
// vmflow_build_info gauge, the histogram bucket bounds every vmflow and SDK
// latency uses, the graceful-stop budget that fits the units'
// TimeoutStopSec, /healthz and /readyz, and systemd's sd_notify protocol
// (READY=1, STOPPING=1, WATCHDOG=1).
package service
