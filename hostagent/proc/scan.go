package proc

import (
	"context"
	"os"
	"strconv"
)

// eachPID calls fn for every pid /proc lists until fn fails or ctx ends; fn
// copes with a process missed as it appears or passed as it exits.
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
