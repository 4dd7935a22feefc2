package lease

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"go.uber.org/zap"

	"vmflow/internal/fsx"
)

// The ledger of devices seen unclaimed, and since when, survives agent
// restarts so the grace period is not restarted by one.
func (c *Claims) loadLedger() (map[string]time.Time, error) { return loadLedger(c.ledger, c.log) }

func (c *Claims) saveLedger(m map[string]time.Time) error { return saveLedger(c.ledger, m) }

// loadLedger reads the ledger at path (vGPUs' or whole GPUs').
func loadLedger(path string, log *zap.Logger) (map[string]time.Time, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return map[string]time.Time{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reconcile ledger: %w", err)
	}
	m := map[string]time.Time{}
	if err := json.Unmarshal(b, &m); err != nil {
		// A torn ledger only delays orphan removal by one grace period.
		log.Warn("reconcile ledger unreadable, starting over", zap.String("path", path), zap.Error(err))
		return map[string]time.Time{}, nil
	}
	return m, nil
}

func saveLedger(path string, m map[string]time.Time) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	// Durable like a record: a power cut must not restart the grace period
	// of every orphan, nor leave an empty ledger.
	if err := fsx.WriteFile(path, b, nil); err != nil {
		return fmt.Errorf("reconcile ledger: %w", err)
	}
	return nil
}
