// Package heartbeat records an activity's progress while it runs longer
// than a beat, and costs nothing when it does not.
//
// Every heartbeat that reaches the Temporal server is a billed action (and
// the SDK sends an activity's first one at once, throttling only the rest),
// so a host activity that ends within a beat, as a launch, a stop of a VM
// that obeys and a release do, heartbeats not at all: the first beat is
// sent one interval after the start. The activities' heartbeat timeouts
// (10 s and more) leave room for it.
package heartbeat

import (
	"context"
	"sync"
	"time"

	"go.temporal.io/sdk/activity"
)

// Interval is the host activities' beat: inside their heartbeat timeouts
// (10 s: the SDK then sends at most one beat per 8 s, 0.8 of the timeout,
// so the server sees one at 4 s, 12 s, 20 s...), long enough that a quick
// step sends none: a launch, a release, the stop of a VM that obeys its
// power button or sits out a 1-3 s graceful timeout.
const Interval = 4 * time.Second

// Every records detail() as ctx's activity heartbeat every interval from
// one interval after the call until the returned stop is called, so a long
// wait shows in the Web UI's pending-activity card.
func Every(ctx context.Context, every time.Duration, detail func() string) (stop func()) {
	return every0(every, func() { activity.RecordHeartbeat(ctx, detail()) }, ctx.Done())
}

// every0 calls beat every interval, the first one interval in, until stop
// or done.
func every0(every time.Duration, beat func(), done <-chan struct{}) (stop func()) {
	stopped := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stopped:
				return
			case <-done:
				return
			case <-t.C:
				beat()
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(stopped) }); wg.Wait() }
}
