package workflows

import (
	"testing"

	"github.com/stretchr/testify/assert"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/sdk/temporal"

	"vmflow/internal/tclient"
)

// TestSearchAttributesAreCreatedAsWritten: the binaries and the dev server
// create tclient.SearchAttributes; the workflows write these typed keys. A
// key the server does not have, or has with another type, fails every
// upsert of it.
func TestSearchAttributesAreCreatedAsWritten(t *testing.T) {
	written := map[string]enumspb.IndexedValueType{}
	for _, k := range []temporal.SearchAttributeKey{SAInstanceID, SAHostID, SAStage, SANeedsAttention} {
		written[k.GetName()] = k.GetValueType()
	}
	assert.Equal(t, tclient.SearchAttributes(), written)
}
