package store

import (
	"path/filepath"

	"vmflow/internal/crashpoint"
	"vmflow/internal/fsx"
)

// writeFileAtomic replaces dir/name with data so a crash leaves the old file
// or the new (invariant 7); afterTemp, if set, runs between the temp file's
// fsync and the rename, for tests to kill a writer there.
func writeFileAtomic(dir, name string, data []byte, afterTemp func(tmp string)) error {
	return fsx.WriteFile(filepath.Join(dir, name), data, &fsx.Hooks{
		Synced: func(tmp string) {
			if afterTemp != nil {
				afterTemp(tmp)
			}
			crashpoint.Hit(crashpoint.StoreWriteTemp)
		},
		Renamed: func() { crashpoint.Hit(crashpoint.StoreWriteRenamed) },
	})
}
