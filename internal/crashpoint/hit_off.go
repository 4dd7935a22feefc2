//go:build !vmflow_crashpoints

package crashpoint

// Enabled: this build has no crash points; Hit does nothing and
// VMFLOW_CRASHPOINT is never read.
const Enabled = false

// Hit does nothing: crash points are compiled in only under BuildTag.
func Hit(string) {}

// HitStop does nothing, as Hit (and names no point: the production binary
// holds no point names).
func HitStop(string) {}
