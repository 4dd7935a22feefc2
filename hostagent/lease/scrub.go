package lease

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"

	"go.uber.org/zap"

	"vmflow/hostagent/gpu"
	"vmflow/hostagent/store"
	"vmflow/internal/errdefs"
	vmflowv1 "vmflow/proto/vmflow/v1"
)

// ErrScrubFailed: the operator's --gpu-scrub failed on a released GPU;
// it is quarantined (or, with no quarantine to record it in, the release
// fails and is retried: the GPU must not reach another tenant unscrubbed).
var ErrScrubFailed = errdefs.Unavailable.New("gpu: scrub between tenants failed")

// scrubOutput bounds what a scrub's output adds to an error and a log line.
const scrubOutput = 2 << 10

// scrubbed runs --gpu-scrub on the GPU l leased, after its release gave
// the card back to its host driver and before the release is recorded: a
// kill in between runs it again at the retry, so the command must be
// idempotent (RUNBOOK says so). A failure quarantines every GPU of the
// group at once; the release still completes, as the card is out of
// placement until an operator clears it.
func (w *Whole) scrubbed(ctx context.Context, id string, l *vmflowv1.Lease) error {
	if w.scrub == "" {
		return nil
	}
	addrs := store.PassthroughDevices(l)
	cmd := exec.CommandContext(ctx, w.scrub, addrs...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", "VMFLOW_INSTANCE_ID=" + id}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &limited{b: &out, n: scrubOutput}, &limited{b: &out, n: scrubOutput}
	err := cmd.Run()
	if err == nil {
		w.log.Info("GPU scrubbed between tenants", zap.String("instance_id", id), zap.Strings("device_ids", addrs))
		return nil
	}
	if ctx.Err() != nil {
		return fmt.Errorf("scrub of %s: %w", strings.Join(addrs, " "), ctx.Err())
	}
	cause := fmt.Errorf("%s %s: %w: %w (output: %q)", w.scrub, strings.Join(addrs, " "), ErrScrubFailed, err, out.String())
	if w.quar == nil {
		return cause
	}
	if qerr := strikeIfFault(ctx, w.quar, w.log, id, cause, store.PassthroughGPUs(l), leaseCards(l)); qerr != nil {
		return fmt.Errorf("%w; quarantining it: %w", cause, qerr)
	}
	return nil
}

// quarantineOnReset is the Return option that quarantines gpus (the cards
// cards names, nil when not known) at once when a reset fails and lets the
// return go on (the card is out of placement); none without a quarantine,
// so the return fails and is retried instead.
func (w *Whole) quarantineOnReset(ctx context.Context, id string, gpus, cards []string) []gpu.ReturnOption {
	if w.quar == nil {
		return nil
	}
	return []gpu.ReturnOption{gpu.QuarantineOnResetFailure(func(addr string, cause error) error {
		return strikeIfFault(ctx, w.quar, w.log, id, cause, gpus, cards)
	})}
}

// limited keeps the first n bytes written to it and drops the rest, so a
// chatty scrub cannot grow the agent's memory.
type limited struct {
	b *bytes.Buffer
	n int
}

func (l *limited) Write(p []byte) (int, error) {
	if room := l.n - l.b.Len(); room > 0 {
		l.b.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}
