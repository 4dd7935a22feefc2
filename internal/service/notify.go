package service

import (
	"context"
	"fmt"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"go.uber.org/zap"
)

// NotifyReady tells systemd (Type=notify) that start-up is done. Outside
// systemd (no NOTIFY_SOCKET) it does nothing.
func NotifyReady(log *zap.Logger) { notify(log, daemon.SdNotifyReady) }

// NotifyStopping tells systemd that the service is shutting down on
// purpose, so the stop is not mistaken for a hang.
func NotifyStopping(log *zap.Logger) { notify(log, daemon.SdNotifyStopping) }

func notify(log *zap.Logger, state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		// Not fatal: the unit then times out its start and restarts the
		// agent, which is loud enough; the log says why.
		log.Error("sd_notify", zap.String("state", state), zap.Error(err))
	}
}

// Watchdog pings systemd's watchdog every half WATCHDOG_USEC (systemd's advice)
// while alive answers within a quarter, so a wedged service is restarted, not
// one whose goroutines merely tick. Returns at once without a watchdog.
func Watchdog(ctx context.Context, log *zap.Logger, alive func(context.Context) error) error {
	every, err := daemon.SdWatchdogEnabled(false)
	if err != nil {
		return fmt.Errorf("watchdog: %w", err)
	}
	if every <= 0 {
		return nil
	}
	t := time.NewTicker(every / 2)
	defer t.Stop()
	log.Info("systemd watchdog on", zap.Duration("watchdog_sec", every), zap.Duration("ping_every", every/2))
	for {
		if err := probe(ctx, every/4, alive); err != nil {
			log.Error("watchdog: not pinging systemd, the service does not answer", zap.Error(err))
		} else {
			notify(log, daemon.SdNotifyWatchdog)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// probe runs alive bounded by timeout; one that never returns is left behind,
// as systemd is about to kill the process.
func probe(ctx context.Context, timeout time.Duration, alive func(context.Context) error) error {
	if alive == nil {
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- alive(pctx) }()
	select {
	case err := <-done:
		return err
	case <-pctx.Done():
		return fmt.Errorf("no answer within %s: %w", timeout, pctx.Err())
	}
}
