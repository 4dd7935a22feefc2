package supervise

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"go.uber.org/zap"

	"vmflow/hostagent/store"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// ReattachReport says what Start found.
type ReattachReport struct {
	// Records is how many instance directories holding a record were seen,
	// readable or not.
	Records int `json:"records"`
	// Attached: live QEMUs with a matching identity, now watched (same pid,
	// not restarted). Adopted ones are counted here too.
	Attached int `json:"attached"`
	// Adopted: QEMUs the record did not name yet (a launch marker left by an
	// agent killed between fork and recording the pid), found by the
	// uid and guest name (see resolveLaunchLocked) and recorded.
	Adopted int `json:"adopted"`
	// Gone: records whose QEMU had ended (or whose pid a stranger now holds,
	// never signalled, or that were recorded in an earlier boot): identity
	// cleared, Running moved to Exited, stale socket removed. Creating stays
	// Creating with the pid cleared (the state machine has no Creating ->
	// Exited; a retried launch starts it).
	Gone int `json:"gone"`
	// RestartsScheduled: restarts the restart policy scheduled (VMs that
	// died while the agent was down, and restarts pending at its death).
	RestartsScheduled int `json:"restarts_scheduled"`
	// Failed: records that were read but could not be handled (a lock
	// held too long, a write failing); each is logged with its instance_id
	// and listed in Failures. The others were handled.
	Failed   int       `json:"failed"`
	Failures []Failure `json:"failures,omitempty"`
	// Unreadable: records that could not be read, quarantined: their
	// instances were left untouched (nothing signalled, released, restarted
	// or removed) and need an operator.
	Unreadable []Quarantined `json:"unreadable,omitempty"`
	// Duration of the whole Start.
	Duration time.Duration `json:"duration"`
}

// Quarantined is an instance whose record could not be read.
type Quarantined struct {
	ID   string `json:"instance_id"`
	Path string `json:"path"`
	Err  string `json:"error"`
}

// Failure is an instance whose re-attach failed.
type Failure struct {
	ID  string `json:"instance_id"`
	Err string `json:"error"`
}

// PerRecord is the mean time per record.
func (r ReattachReport) PerRecord() time.Duration {
	if r.Records == 0 {
		return 0
	}
	return r.Duration / time.Duration(r.Records)
}

// errUnreadable tells Start's loop that the record could not be read.
type errUnreadable struct{ err error }

func (e *errUnreadable) Error() string { return e.err.Error() }
func (e *errUnreadable) Unwrap() error { return e.err }

// Start takes ownership of what outlived the previous agent: re-attaches live
// matching QEMUs without signalling, adopts unrecorded ones (invariant 11),
// records the gone, then applies the restart policy. No instance stops the
// others (invariant 12): the error means "cannot list". Call once, first.
func (s *Supervisor) Start(ctx context.Context) (ReattachReport, error) {
	start := time.Now()
	var rep ReattachReport
	s.migrate(ctx)
	ids, err := s.instanceIDs()
	if err != nil {
		return rep, fmt.Errorf("start: %w", err)
	}
	for _, id := range ids {
		// Each instance gets its own bound, so one whose lock is held (or
		// whose QEMU hangs a read) cannot use up the time of the rest.
		ictx, cancel := context.WithTimeout(ctx, s.cfg.LockTimeout)
		err := s.reattach(ictx, id, &rep)
		cancel()
		var unreadable *errUnreadable
		switch {
		case err == nil:
			rep.Records++
		case errors.Is(err, store.ErrNotFound):
			// A directory without a record: a create that crashed before
			// its first write. Not an instance yet.
		case errors.As(err, &unreadable):
			rep.Records++
			path := ""
			if p, perr := s.st.Paths(id); perr == nil {
				path = p.Record
			}
			rep.Unreadable = append(rep.Unreadable, Quarantined{ID: id, Path: path, Err: unreadable.err.Error()})
			s.log.Error("record unreadable; instance quarantined: not re-attached, signalled, restarted or released",
				zap.String("instance_id", id), zap.String("path", path), zap.Error(unreadable.err))
		default:
			rep.Records++
			rep.Failed++
			rep.Failures = append(rep.Failures, Failure{ID: id, Err: err.Error()})
			retry := !errors.Is(err, ErrUnrecordedAmbiguous)
			s.log.Error("re-attach failed; the other instances go on", zap.String("instance_id", id), zap.Error(err),
				zap.Bool("retried_in_background", retry))
			if retry {
				s.reattachLater(id)
			}
		}
	}
	rep.Duration = time.Since(start)
	s.log.Info("re-attach done", zap.Int("records", rep.Records), zap.Int("attached", rep.Attached),
		zap.Int("adopted", rep.Adopted), zap.Int("gone", rep.Gone), zap.Int("restarts_scheduled", rep.RestartsScheduled),
		zap.Int("failed", rep.Failed), zap.Int("unreadable", len(rep.Unreadable)), zap.Duration("took", rep.Duration))
	return rep, nil
}

// migrate rewrites records still in an old shape, once, before anything reads
// them; best effort, since every read converts anyway.
func (s *Supervisor) migrate(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.LockTimeout)
	defer cancel()
	done, err := s.st.Migrate(ctx)
	if len(done) > 0 {
		s.log.Info("records migrated to the current shape", zap.Strings("instance_ids", done))
	}
	if err != nil {
		s.log.Warn("record migration incomplete; those records are converted on every read instead", zap.Error(err))
	}
}

// Backoff of a re-attach retried in the background.
const (
	reattachRetryInitial = 500 * time.Millisecond
	reattachRetryMax     = 30 * time.Second
)

// reattachLater retries a re-attach Start could not settle in its bound, with
// backoff, so the other instances are served meanwhile.
func (s *Supervisor) reattachLater(id string) {
	s.goBackground(func() {
		log := s.log.With(zap.String("instance_id", id))
		wait := reattachRetryInitial
		t := time.NewTimer(wait)
		defer t.Stop()
		for attempt := 2; ; attempt++ {
			select {
			case <-s.ctx.Done():
				return
			case <-t.C:
			}
			ctx, cancel := context.WithTimeout(s.ctx, s.cfg.LockTimeout)
			var rep ReattachReport
			err := s.reattach(ctx, id, &rep)
			cancel()
			var unreadable *errUnreadable
			switch {
			case err == nil:
				log.Info("re-attach done in the background", zap.Int("attempt", attempt), zap.Int("adopted", rep.Adopted),
					zap.Int("attached", rep.Attached), zap.Int("gone", rep.Gone), zap.Int("restarts_scheduled", rep.RestartsScheduled))
				return
			case errors.Is(err, store.ErrNotFound), errors.Is(err, ErrClosed), s.ctx.Err() != nil:
				return
			case errors.As(err, &unreadable), errors.Is(err, ErrUnrecordedAmbiguous):
				log.Error("re-attach failed; not retried, needs an operator", zap.Int("attempt", attempt), zap.Error(err))
				return
			}
			wait = min(2*wait, reattachRetryMax)
			log.Warn("re-attach failed; retrying in the background", zap.Int("attempt", attempt), zap.Duration("next_in", wait), zap.Error(err))
			t.Reset(wait)
		}
	})
}

// instanceIDs lists instance directories by id, readable or not (store.List
// skips the unreadable, which Start must see to quarantine).
func (s *Supervisor) instanceIDs() ([]string, error) {
	p, err := s.st.Paths("x")
	if err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(filepath.Dir(p.Dir))
	if err != nil {
		return nil, fmt.Errorf("list instances: %w", err)
	}
	var ids []string
	for _, e := range ents {
		if e.IsDir() && store.ValidateID(e.Name()) == nil {
			ids = append(ids, e.Name())
		}
	}
	return ids, nil // ReadDir sorts by name
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
	l, err := s.st.Lock(ctx, id)
	if err != nil {
		return fmt.Errorf("re-attach: %w", err)
	}
	defer unlock(l, in.log)
	rec, err := l.Get() // under the lock
	if errors.Is(err, store.ErrNotFound) {
		return err
	}
	if err != nil {
		return &errUnreadable{err}
	}
	rec, adopted, err := s.resolveLaunchLocked(ctx, l, in, rec, false)
	if err != nil {
		return fmt.Errorf("re-attach instance %s: %w", id, err)
	}
	if adopted {
		rep.Adopted++
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
		if rec, err = l.Apply(store.LostProcess(s.cfg.Now())); err != nil {
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
