package store

import (
	"fmt"

	"vmflow/internal/contract"
)

// MaxIDLen is the longest instance id: one leading character plus up to 62
// more, so an id is a valid DNS label and a short path component.
const MaxIDLen = 63

// ValidateID reports whether id is a valid instance id: one matching
// contract.IDPattern, checked by hand here (no regexp on the hot path; the
// fuzz test keeps both in step). Every path the store
// builds goes through it first, so an id such as "..", "a/b" or "" can never
// name a file outside the state directory.
func ValidateID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: empty (must match %s)", ErrInvalidID, contract.IDPattern)
	}
	if len(id) > MaxIDLen {
		return fmt.Errorf("%w: %d bytes long, at most %d allowed (must match %s)",
			ErrInvalidID, len(id), MaxIDLen, contract.IDPattern)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '-' && i > 0:
		default:
			return fmt.Errorf("%w: %s has %q at byte %d (must match %s)",
				ErrInvalidID, quoteID(id), c, i, contract.IDPattern)
		}
	}
	return nil
}

// quoteID quotes an id for an error message, shortened so a hostile or
// mistaken megabyte-long id does not flood the logs.
func quoteID(id string) string {
	const show = 72
	if len(id) > show {
		return fmt.Sprintf("%q...", id[:show])
	}
	return fmt.Sprintf("%q", id)
}
