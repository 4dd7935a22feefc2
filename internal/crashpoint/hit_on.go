//go:build vmflow_crashpoints

package crashpoint

import (
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Enabled: this build kills at an armed point.
const Enabled = true

// armed is the point named by EnvVar ("" when none), at hit number at.
var (
	armed string
	at    int64 = 1
	hits  atomic.Int64
)

func init() { arm(os.Getenv(EnvVar)) }

// arm parses spec ("name" or "name@N"); a malformed one is reported on
// stderr and arms nothing, so a typo shows instead of passing silently.
func arm(spec string) {
	armed, at = "", 1
	hits.Store(0)
	if spec == "" {
		return
	}
	name, n, err := Parse(spec)
	if err != nil {
		fmt.Fprintf(os.Stderr, "crashpoint: %s: %v; nothing armed\n", EnvVar, err)
		return
	}
	armed, at = name, n
}

// HitStop is Hit of the stop-ladder step's point (StopStep).
func HitStop(step string) { Hit(StopStep(step)) }

// Hit kills the process with SIGKILL if name is the armed point and this
// is its armed hit; otherwise it returns at once.
func Hit(name string) {
	if armed == "" || name != armed {
		return
	}
	if hits.Add(1) != at {
		return
	}
	// One write, unbuffered: the test reads it from the log to know the
	// point was reached.
	_, _ = os.Stderr.WriteString("crashpoint " + name + ": SIGKILL\n")
	_ = unix.Kill(os.Getpid(), unix.SIGKILL)
	// SIGKILL to oneself is delivered before kill(2) returns to user space
	// on Linux, but never let this goroutine go on if it were not.
	for {
		time.Sleep(time.Hour)
	}
}
