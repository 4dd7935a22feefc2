package supervise

import (
	"time"

	"go.uber.org/zap/zapcore"

	"vmflow/hostagent/vmm"
)

// Segment is one step of a launch and how long it took.
type Segment struct {
	Name string        `json:"name"`
	Took time.Duration `json:"took"`
}

// Timeline is where a launch's time went: its segments in order, each from
// its start to the next one's (the last to the launch's end), so together
// they are the whole Launch call. The names are the launch's stages
// (launchStages), the steps of vmm.Launch inside the fork (vmm.LaunchStep*)
// and segLock before the first stage.
type Timeline []Segment

// segLock is the time before the first stage: the instance's turn, the
// record's lock and read, and what an earlier launch left resolved.
const segLock = "lock and read"

// Of is the time of the segments named name (0: none).
func (t Timeline) Of(name string) time.Duration {
	var d time.Duration
	for _, s := range t {
		if s.Name == name {
			d += s.Took
		}
	}
	return d
}

// ForkToRunning is the time from the fork until QMP said running
// (vmflow_launch_duration_seconds): the segments from vmm's clone up to
// the stage that records it running. 0 when the launch did not get there.
func (t Timeline) ForkToRunning() time.Duration {
	var d time.Duration
	in := false
	for _, s := range t {
		switch s.Name {
		case vmm.LaunchStepClone:
			in = true
		case stageQMPReady:
			if in {
				return d
			}
		}
		if in {
			d += s.Took
		}
	}
	return 0
}

// MarshalLogObject writes the timeline as segment: milliseconds, in order.
func (t Timeline) MarshalLogObject(enc zapcore.ObjectEncoder) error {
	for _, s := range t {
		enc.AddFloat64(s.Name, float64(s.Took.Microseconds())/1000)
	}
	return nil
}

// clock collects a launch's marks; nil collects nothing (a restart).
type clock struct {
	marks []mark
}

type mark struct {
	name string
	at   time.Time
}

func newClock(start time.Time, first string) *clock {
	return &clock{marks: []mark{{first, start}}}
}

// mark says segment name begins now.
func (c *clock) mark(name string) {
	if c != nil {
		c.marks = append(c.marks, mark{name, time.Now()})
	}
}

// timeline is the marks as segments, the last ending at end.
func (c *clock) timeline(end time.Time) Timeline {
	if c == nil {
		return nil
	}
	t := make(Timeline, len(c.marks))
	for i, m := range c.marks {
		next := end
		if i+1 < len(c.marks) {
			next = c.marks[i+1].at
		}
		t[i] = Segment{Name: m.name, Took: next.Sub(m.at)}
	}
	return t
}
