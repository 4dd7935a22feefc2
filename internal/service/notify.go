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

// Watchdog sends WATCHDOG=1 every half of WATCHDOG_USEC (systemd's
// WatchdogSec, set for this process) until ctx ends. Without a watchdog it
// returns at once. Half the interval is systemd's own advice: one ping may
// come late without the service being killed.
func Watchdog(ctx context.Context, log *zap.Logger) error {
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
		notify(log, daemon.SdNotifyWatchdog)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
