package supervise

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// ReattachReport says what Start found.
type ReattachReport struct {
	// Records is how many instance records were read.
	Records int `json:"records"`
	// Attached: live QEMUs with a matching identity, now watched (same pid,
	// not restarted).
	Attached int `json:"attached"`
	// Gone: records whose QEMU had ended (or whose pid a stranger now holds,
	// never signalled): identity cleared, Running moved to Exited, stale
	// socket removed. Creating stays Creating with the pid cleared (the
	// state machine has no Creating -> Exited; a retried launch starts it).
	Gone int `json:"gone"`
	// RestartsScheduled: restarts the restart policy scheduled (VMs that
	// died while the agent was down, and restarts pending at its death).
	RestartsScheduled int `json:"restarts_scheduled"`
	// Failed: records that could not be handled (see the returned error).
	Failed int `json:"failed"`
	// Duration of the whole Start.
	Duration time.Duration `json:"duration"`
}

// PerRecord is the mean time per record.
func (r ReattachReport) PerRecord() time.Duration {
	if r.Records == 0 {
		return 0
	}
	return r.Duration / time.Duration(r.Records)
}

// Start loads every instance record and takes ownership of what outlived
// the previous agent: a record naming a live QEMU with a matching identity
// (pid, start time, boot id) is re-attached: a pidfd watches its exit, QMP
// is connected on demand, nothing is signalled. A record whose QEMU is gone
// or whose pid another process now holds is recorded as gone and its stale
// socket removed; a mismatched pid is never signalled. Then the restart
// policy runs for what has exited. Work never waits on the network.
//
// One record's failure does not stop the others: the report counts every
// record and the error joins the failures. Call Start once, before serving.
func (s *Supervisor) Start(ctx context.Context) (ReattachReport, error) {
	start := time.Now()
	var rep ReattachReport
	recs, listErr := s.st.List()
	var errs []error
	if listErr != nil {
		errs = append(errs, listErr)
	}
	for _, rec := range recs {
		rep.Records++
		if err := s.reattach(ctx, rec.GetId(), &rep); err != nil {
			rep.Failed++
			errs = append(errs, err)
		}
	}
	rep.Duration = time.Since(start)
	s.log.Info("re-attach done", zap.Int("records", rep.Records), zap.Int("attached", rep.Attached),
		zap.Int("gone", rep.Gone), zap.Int("restarts_scheduled", rep.RestartsScheduled),
		zap.Int("failed", rep.Failed), zap.Duration("took", rep.Duration))
	if err := errors.Join(errs...); err != nil {
		return rep, fmt.Errorf("start: %w", err)
	}
	return rep, nil
}

func (s *Supervisor) reattach(ctx context.Context, id string, rep *ReattachReport) error {
	in, err := s.instance(id)
	if err != nil {
		return err
	}
	if err := in.acquire(ctx); err != nil {
		return fmt.Errorf("re-attach: %w", err)
	}
	defer in.release()
	l, err := s.lock(ctx, id)
	if err != nil {
		return fmt.Errorf("re-attach: %w", err)
	}
	defer unlock(l, in.log)
	rec, err := l.Get() // again, under the lock
	if err != nil {
		return fmt.Errorf("re-attach: %w", err)
	}
	if p := rec.GetProcess(); p != nil {
		pid := store.IdentityOf(p)
		if in.current(pid) != nil {
			return nil // already watched (Start called twice)
		}
		_, alive, err := s.liveVMLocked(ctx, l, in, pid)
		if err != nil {
			return fmt.Errorf("re-attach instance %s: %w", id, err)
		}
		if alive {
			rep.Attached++
			in.log.Info("re-attached", zap.Int("pid", pid.PID), zap.String("state", store.StateName(rec.GetState())))
			return nil
		}
		rep.Gone++
		in.log.Info("vm gone while the agent was down", zap.Int("pid", pid.PID), zap.String("state", store.StateName(rec.GetState())))
		if rec, err = l.Get(); err != nil {
			return fmt.Errorf("re-attach: %w", err)
		}
	} else if rec.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_RUNNING {
		rep.Gone++
		if rec, err = l.Update(func(r *vmflowv1.InstanceRecord) error {
			r.State = vmflowv1.InstanceState_INSTANCE_STATE_EXITED
			r.LastExit, r.LastExitStatus, r.LastExitCode = s.ts(), "unknown (no process recorded)", -1
			return nil
		}); err != nil {
			return fmt.Errorf("re-attach instance %s: %w", id, err)
		}
		cleanupFiles(ctx, vmmPaths(l.Paths()), 0)
	}
	if rec.GetState() == vmflowv1.InstanceState_INSTANCE_STATE_EXITED {
		// Also resumes a restart that was pending when the agent died:
		// the backoff counts from the recorded exit.
		if s.applyPolicyLocked(l, in, rec, time.Time{}) {
			rep.RestartsScheduled++
		}
	}
	return nil
}
