package store

import (
	"fmt"

	"vmflow/internal/contract"
)

// MaxIDLen is the longest instance id (contract.MaxIDLen).
const MaxIDLen = contract.MaxIDLen

// ValidateID reports whether id is a valid instance id, wrapping ErrInvalidID;
// every path the store builds checks it first, so no id escapes the state dir.
func ValidateID(id string) error {
	if err := contract.CheckID(id); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidID, err)
	}
	return nil
}

// quoteID is contract.QuoteID.
var quoteID = contract.QuoteID
