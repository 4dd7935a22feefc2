package proc

import "context"

// WithBeforePidfd runs fn in Open right before pidfd_open (test only).
func WithBeforePidfd(fn func()) Option { return func(o *options) { o.beforePidfd = fn } }

// TablesRead is how many fd tables of pid the scan read.
func (s *FDScan) TablesRead(pid int) int { return s.tables[pid] }

// ScanFDsEveryTask reads every task's table, shared or not: the baseline
// the benchmarks compare ScanFDs with.
func ScanFDsEveryTask(ctx context.Context) (*FDScan, error) { return scanFDs(ctx, true) }

// StatFromRead is ReadStat's answer to one read of the stat file.
var StatFromRead = statFromRead
