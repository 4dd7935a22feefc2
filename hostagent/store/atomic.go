package store

import (
	"path/filepath"

	"vmflow/internal/crashpoint"
	"vmflow/internal/fsx"
)

// writeFileAtomic replaces dir/name with data through fsx.WriteFile: a crash
// or a power cut at any instant leaves the old file or the new one
// (ARCHITECTURE invariant 7). afterTemp, when set, runs between the temp
// file's fsync and the rename; tests use it to kill a writer at exactly that
// point, as the crash points do.
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
