package store

import (
	"fmt"

	"vmflow/internal/contract"
)

// MaxIDLen is the longest instance id (contract.MaxIDLen).
const MaxIDLen = contract.MaxIDLen

// ValidateID reports whether id is a valid instance id (contract.CheckID),
// wrapping ErrInvalidID. Every path the store builds goes through it first,
// so an id such as "..", "a/b" or "" can never name a file outside the
// state directory.
func ValidateID(id string) error {
	if err := contract.CheckID(id); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidID, err)
	}
	return nil
}

// quoteID is contract.QuoteID.
var quoteID = contract.QuoteID
