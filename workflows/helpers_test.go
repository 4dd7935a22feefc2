package workflows

import (
	"testing"

	"go.temporal.io/sdk/converter"
)

func converterFor(*testing.T) converter.DataConverter { return converter.GetDefaultDataConverter() }
