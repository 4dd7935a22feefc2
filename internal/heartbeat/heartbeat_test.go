package heartbeat

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// A step that ends within the interval beats not at all (each beat that
// reaches the server is a billed action); a longer one beats every
// interval until stopped, and never after.
func TestFirstBeatAfterOneInterval(t *testing.T) {
	var n atomic.Int32
	stop := every0(time.Hour, func() { n.Add(1) }, nil)
	stop()
	assert.Zero(t, n.Load(), "a step shorter than the interval sent a heartbeat")

	stop = every0(10*time.Millisecond, func() { n.Add(1) }, nil)
	assert.Eventually(t, func() bool { return n.Load() >= 3 }, 10*time.Second, time.Millisecond)
	stop()
	stop() // idempotent
	after := n.Load()
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, after, n.Load(), "a beat after stop")
}

// The activity's end (its context done) ends the beats too.
func TestBeatsEndWithTheActivity(t *testing.T) {
	done := make(chan struct{})
	var n atomic.Int32
	stop := every0(time.Millisecond, func() { n.Add(1) }, done)
	close(done)
	stop() // returns: the goroutine ended on done
	after := n.Load()
	time.Sleep(20 * time.Millisecond)
	assert.Equal(t, after, n.Load())
}
