package proc

import (
	"errors"
	"fmt"
	"os"
	"strconv"
)

// State is the liveness of a whole thread group, as seen in /proc.
type State string

const (
	// StateRunning: the leader is not a zombie.
	StateRunning State = "running"
	// StateZombieLeader: the leader has exited (state Z) but other tasks of
	// its group still run. Alive: since Linux 6.4 vhost workers, and on KVM
	// the kvm-nx-lpage-re task, live in QEMU's thread group and may still hold
	// VFIO devices and guest memory.
	StateZombieLeader State = "zombie-leader"
	// StateExited: no task of the group runs. The leader may still be listed
	// as a zombie until its parent reaps it.
	StateExited State = "exited"
	// StateUnknown: /proc could not be read. Treated as alive, never as gone.
	StateUnknown State = "unknown"
)

// Alive reports whether the state must be treated as a live thread group.
// "Can't tell" counts as alive (ARCHITECTURE invariant 2).
func (s State) Alive() bool { return s != StateExited }

// Status is a snapshot of one process's thread group.
type Status struct {
	Identity
	State State `json:"state"`
	Tasks int   `json:"tasks"`
	Alive bool  `json:"alive"`
	// Err says why the state is unknown; empty otherwise.
	Err string `json:"error,omitempty"`
}

func taskDir(pid int) string { return procRoot + "/" + strconv.Itoa(pid) + "/task" }

// countTasks counts the entries of /proc/<pid>/task: the tasks of the group
// the kernel still lists, the zombie leader included.
func countTasks(pid int) (int, error) {
	f, err := os.Open(taskDir(pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	return len(names), err
}

// Inspect reports the liveness of id's thread group; a pid held by another
// process (start time or boot) means id's is gone: StateExited.
func Inspect(id Identity) Status {
	state, tasks, err := inspect(id)
	s := Status{Identity: id, State: state, Tasks: tasks, Alive: state.Alive()}
	if err != nil {
		s.Err = err.Error()
	}
	return s
}

// InspectPID reports the liveness of whatever process has pid now, filling
// in its identity. ErrNotFound when no process has it.
func InspectPID(pid int) (Status, error) {
	id, err := ReadIdentity(pid)
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			return Status{Identity: Identity{PID: pid}, State: StateExited}, err
		}
		return Status{Identity: Identity{PID: pid}, State: StateUnknown, Alive: true, Err: err.Error()}, nil
	}
	return Inspect(id), nil
}

func inspect(id Identity) (State, int, error) {
	if err := Verify(id); err != nil {
		if errors.Is(err, ErrNotFound) || errors.Is(err, ErrIdentityMismatch) {
			return StateExited, 0, nil
		}
		// An incomplete identity says nothing about the process: unknown,
		// so alive (invariant 2).
		return StateUnknown, 0, err
	}
	// Read the leader's state before counting tasks. Once the leader is a
	// zombie, a count of one is final: only live tasks create tasks, and
	// there are none. Counting first could miss a thread the leader created
	// just before it exited.
	st, err := ReadStat(id.PID)
	switch {
	case errors.Is(err, ErrNotFound):
		return StateExited, 0, nil
	case err != nil:
		return StateUnknown, 0, err
	case st.StartTime != id.StartTime:
		return StateExited, 0, nil
	}
	n, err := countTasks(id.PID)
	switch {
	case gone(err):
		return StateExited, 0, nil // reaped since the stat read
	case err != nil:
		return StateUnknown, 0, fmt.Errorf("list tasks of pid %d: %w", id.PID, err)
	}
	switch st.State {
	case 'Z':
		// The leader's state is all /proc/<pid>/stat shows; the group lives
		// on while any other task is listed.
		if n > 1 {
			return StateZombieLeader, n, nil
		}
		return StateExited, 0, nil
	case 'X':
		return StateExited, 0, nil
	default:
		return StateRunning, n, nil
	}
}
