package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
)

// Open opens an existing state directory to read while the agent runs: unlike
// New it creates, tightens and removes nothing, and a mistyped --state-dir is
// an error. Its readers (Get, IDs, Paths, ManualStop) take no lock.
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

// IDs lists, sorted, the instances with a directory, readable records or not;
// trash and temp files are not instances.
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
