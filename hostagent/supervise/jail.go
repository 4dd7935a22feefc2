package supervise

import (
	"path/filepath"

	"vmflow/hostagent/store"
	"vmflow/hostagent/vmm"
)

// jail is the jail of a launch in the instance directory p names, nil
// when QEMUs are not jailed.
func (s *Supervisor) jail(p store.Paths) *vmm.Jail {
	if s.cfg.JailSetup == "" {
		return nil
	}
	return &vmm.Jail{Setup: s.cfg.JailSetup, Dir: filepath.Join(p.Dir, "root"), DevRoot: s.cfg.DevRoot}
}

// vmmPaths maps the store's instance files to what QEMU uses.
func vmmPaths(p store.Paths) vmm.Paths {
	return vmm.Paths{QMPSocket: p.Socket, PIDFile: p.PID, Log: p.Log}
}
