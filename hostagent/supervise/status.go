package supervise

import (
	"context"
	"fmt"
	"time"

	"vmflow/hostagent/proc"
	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// Alive answers when the supervisor is not wedged (its lock is free within
// ctx) and the instances can be listed; the systemd watchdog pings on it.
func (s *Supervisor) Alive(ctx context.Context) error {
	done := make(chan error, 1)
	go func() {
		s.mu.Lock()
		closed := s.closed
		s.mu.Unlock()
		if closed {
			done <- ErrClosed
			return
		}
		_, err := s.st.IDs()
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("supervisor: %w", err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("supervisor does not answer: %w", ctx.Err())
	}
}

// Status is what the supervisor knows about one instance.
type Status struct {
	ID    string                 `json:"instance_id"`
	State vmflowv1.InstanceState `json:"state"`
	// Process is the recorded QEMU; zero when none runs.
	Process proc.Identity `json:"process"`
	// Liveness of the recorded QEMU's thread group now; zero without one.
	Liveness proc.Status `json:"liveness"`
	// Watched: this supervisor watches the VM's exit (launched or re-attached).
	Watched bool `json:"watched"`
	// Child: this process is QEMU's parent (it launched it) and reaps it.
	Child bool `json:"child"`
	// StopStep is how far the stop ladder got.
	StopStep     vmm.StopStep `json:"stop_step"`
	ManualStop   bool         `json:"manual_stop"`
	RestartCount uint32       `json:"restart_count"`
	// NextRestart is when a pending restart fires; zero when none is pending.
	NextRestart    time.Time `json:"next_restart"`
	LastExitStatus string    `json:"last_exit_status"`
	LastExitCode   int32     `json:"last_exit_code"`
	LastError      string    `json:"last_error"`
}

// Status joins instance id's record (read without the lock: rename makes it
// consistent) with what this process watches and the group's liveness now.
func (s *Supervisor) Status(id string) (Status, error) {
	rec, err := s.st.Get(id)
	if err != nil {
		return Status{}, fmt.Errorf("status: %w", err)
	}
	marked, err := s.st.ManualStop(id)
	if err != nil {
		return Status{}, fmt.Errorf("status of instance %s: %w", id, err)
	}
	st := Status{
		ID: id, State: rec.GetState(), StopStep: stepFromProto(rec.GetStopStep()),
		ManualStop: marked, RestartCount: rec.GetRestartCount(),
		LastExitStatus: rec.GetLastExitStatus(), LastExitCode: rec.GetLastExitCode(), LastError: rec.GetLastError(),
	}
	if p := rec.GetProcess(); p != nil {
		st.Process = store.IdentityOf(p)
		st.Liveness = proc.Inspect(st.Process)
	}
	if in := s.lookup(id); in != nil {
		in.mu.Lock()
		if in.vm != nil && in.vm.Identity() == st.Process {
			st.Watched = true
			st.Child = in.vm.Child() != nil
		}
		st.NextRestart = in.nextRestart
		in.mu.Unlock()
	}
	return st, nil
}

// QMPStatus asks the instance's QEMU for its run state, connecting on demand;
// ErrNotRunning when no VM is watched for it.
func (s *Supervisor) QMPStatus(ctx context.Context, id string) (vmm.StatusInfo, error) {
	in := s.lookup(id)
	if in == nil {
		return vmm.StatusInfo{}, fmt.Errorf("instance %s: %w", id, ErrNotRunning)
	}
	in.mu.Lock()
	vm := in.vm
	in.mu.Unlock()
	if vm == nil {
		return vmm.StatusInfo{}, fmt.Errorf("instance %s: %w", id, ErrNotRunning)
	}
	st, err := vm.Status(ctx)
	if err != nil {
		return vmm.StatusInfo{}, fmt.Errorf("qmp status of instance %s: %w", id, err)
	}
	return st, nil
}
