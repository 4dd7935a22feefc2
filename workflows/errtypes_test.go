package workflows

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"

	"vmflow/internal/errdefs"
)

// TestErrorTypesOneToOne: every class has a Type of its own, and the two
// retry policies refuse exactly the non-retryable classes' types.
func TestErrorTypesOneToOne(t *testing.T) {
	seen := map[string]*errdefs.Class{}
	for _, c := range errdefs.Classes {
		typ := ErrorType(c)
		assert.NotEqual(t, ErrTypeHost, typ, "class %q has no Type", c)
		if other, dup := seen[typ]; dup {
			t.Errorf("classes %q and %q share the Type %s", other, c, typ)
		}
		seen[typ] = c
	}
	assert.Len(t, errorTypes, len(errdefs.Classes), "a row for a class not in errdefs.Classes")
	assert.Equal(t, ErrTypeHost, ErrorType(nil))

	for _, p := range []struct {
		name   string
		policy []string
	}{{"retryFew", retryFew.NonRetryableErrorTypes}, {"retryForever", retryForever.NonRetryableErrorTypes}} {
		for typ, c := range seen {
			assert.Equal(t, !c.Retryable(), slices.Contains(p.policy, typ), "%s refuses %s", p.name, typ)
		}
	}
}
