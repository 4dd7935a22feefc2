package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
)

// Open opens an existing state directory for reading. Unlike New it creates,
// tightens and removes nothing (New also finishes interrupted deletes), so an
// operator's command can read a host's records while the agent runs, and a
// mistyped --state-dir is an error instead of a new empty store. Readers use
// Get, IDs, Paths and ManualStop, which take no lock; the write methods still
// work on an opened store but are not what Open is for.
func Open(stateDir string) (*Store, error) {
	if stateDir == "" {
		return nil, errors.New("open store: empty state dir")
	}
	root, err := filepath.Abs(stateDir)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", stateDir, err)
	}
	s := &Store{root: root, instances: filepath.Join(root, instancesDir), locks: filepath.Join(root, locksDir),
		uids: filepath.Join(root, uidsDir)}
	fi, err := os.Stat(s.instances)
	if err != nil {
		return nil, fmt.Errorf("open store %s (is it the agent's --state-dir?): %w", root, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("open store %s: %s is not a directory", root, s.instances)
	}
	return s, nil
}

// IDs lists the instances that have a directory, sorted, whether or not
// their record can be read (List reads the records and skips a directory
// without one). Trash, temp files and other strangers are not instances.
func (s *Store) IDs() ([]string, error) {
	entries, err := os.ReadDir(s.instances)
	if err != nil {
		return nil, fmt.Errorf("list instances: %w", err)
	}
	var ids []string
	for _, e := range entries {
		if e.IsDir() && ValidateID(e.Name()) == nil {
			ids = append(ids, e.Name())
		}
	}
	slices.Sort(ids) // ReadDir sorts already; say so in the contract, not by accident
	return ids, nil
}
