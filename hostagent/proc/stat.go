// Package proc answers the question every other part of vmflow depends on:
// is this VM process, and every task in its thread group, really gone?
//
// It identifies a process by pid, start time and boot id (so a reused pid is a
// stranger), reports liveness of the whole thread group (a zombie leader with
// live tasks is alive), waits for the group to empty through a pidfd (falling
// back to /proc polling where pidfds are unavailable), starts and reaps child
// processes, and finds which processes hold a file open.
//
// It never imports Temporal: it is plain host code, testable with real processes.
package proc

import (
	"bytes"
	"fmt"
	"strconv"

	"vmflow/internal/errdefs"
)

// Stat is the part of /proc/<pid>/stat that vmflow uses.
type Stat struct {
	PID       int
	Comm      string
	State     byte   // field 3: R, S, D, Z, T, t, X, I, ...
	PPID      int    // field 4
	StartTime uint64 // field 22: clock ticks after boot
}

// ErrMalformedStat is returned for /proc/<pid>/stat content that does not parse.
var ErrMalformedStat = errdefs.Unavailable.New("malformed /proc stat")

// ParseStat parses /proc/<pid>/stat, reading the fields after the last ')' as
// the comm may hold spaces and parentheses.
func ParseStat(data []byte) (Stat, error) {
	open := bytes.IndexByte(data, '(')
	closing := bytes.LastIndexByte(data, ')')
	if open < 0 || closing < open {
		return Stat{}, fmt.Errorf("%w: no (comm)", ErrMalformedStat)
	}
	pid, err := strconv.Atoi(string(bytes.TrimSpace(data[:open])))
	if err != nil || pid <= 0 {
		return Stat{}, fmt.Errorf("%w: bad pid %q", ErrMalformedStat, bytes.TrimSpace(data[:open]))
	}
	st := Stat{PID: pid, Comm: string(data[open+1 : closing])}

	// rest holds fields 3.. separated by single spaces.
	rest := bytes.Fields(data[closing+1:])
	const (
		idxState     = 0  // field 3
		idxPPID      = 1  // field 4
		idxStartTime = 19 // field 22
	)
	if len(rest) <= idxStartTime {
		return Stat{}, fmt.Errorf("%w: %d fields after comm, need %d", ErrMalformedStat, len(rest), idxStartTime+1)
	}
	if len(rest[idxState]) != 1 {
		return Stat{}, fmt.Errorf("%w: bad state %q", ErrMalformedStat, rest[idxState])
	}
	st.State = rest[idxState][0]
	if st.PPID, err = strconv.Atoi(string(rest[idxPPID])); err != nil {
		return Stat{}, fmt.Errorf("%w: bad ppid %q", ErrMalformedStat, rest[idxPPID])
	}
	if st.StartTime, err = strconv.ParseUint(string(rest[idxStartTime]), 10, 64); err != nil {
		return Stat{}, fmt.Errorf("%w: bad start time %q", ErrMalformedStat, rest[idxStartTime])
	}
	return st, nil
}
