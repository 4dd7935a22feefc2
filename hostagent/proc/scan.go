package proc

import (
	"context"
	"os"
	"strconv"
)

// eachPID calls fn for every process /proc lists now, until fn fails or
// ctx ends (checked before each call); either error is returned as it is.
// A process that appears during the scan may be missed and one that exits
// during it may be passed: fn copes with both.
func eachPID(ctx context.Context, fn func(pid int) error) error {
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(pid); err != nil {
			return err
		}
	}
	return nil
}
