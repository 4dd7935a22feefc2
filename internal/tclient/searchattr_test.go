package tclient

import (
	"context"
	"errors"
	"maps"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/api/operatorservice/v1"
	"go.temporal.io/api/serviceerror"
	"google.golang.org/grpc"

	"vmflow/internal/contract"
)

// fakeOperator keeps search attributes in memory. Embedding the interface
// makes every method it does not override fail loudly (nil pointer) rather
// than pass silently.
type fakeOperator struct {
	operatorservice.OperatorServiceClient
	mu       sync.Mutex
	attrs    map[string]enumspb.IndexedValueType
	addErr   error
	listErr  error
	adds     int
	raceWith map[string]enumspb.IndexedValueType // created "by someone else" on Add
}

func (f *fakeOperator) ListSearchAttributes(_ context.Context, req *operatorservice.ListSearchAttributesRequest, _ ...grpc.CallOption) (*operatorservice.ListSearchAttributesResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.listErr != nil {
		return nil, f.listErr
	}
	return &operatorservice.ListSearchAttributesResponse{
		CustomAttributes: maps.Clone(f.attrs),
		SystemAttributes: map[string]enumspb.IndexedValueType{"WorkflowId": enumspb.INDEXED_VALUE_TYPE_KEYWORD},
	}, nil
}

func (f *fakeOperator) AddSearchAttributes(_ context.Context, req *operatorservice.AddSearchAttributesRequest, _ ...grpc.CallOption) (*operatorservice.AddSearchAttributesResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.adds++
	if f.raceWith != nil {
		maps.Copy(f.attrs, f.raceWith)
		return nil, serviceerror.NewAlreadyExists("already there")
	}
	if f.addErr != nil {
		return nil, f.addErr
	}
	maps.Copy(f.attrs, req.GetSearchAttributes())
	return &operatorservice.AddSearchAttributesResponse{}, nil
}

func TestEnsureSearchAttributes(t *testing.T) {
	ctx := context.Background()

	t.Run("creates missing, then idempotent", func(t *testing.T) {
		f := &fakeOperator{attrs: map[string]enumspb.IndexedValueType{contract.SAStage: enumspb.INDEXED_VALUE_TYPE_KEYWORD}}
		require.NoError(t, ensureSearchAttributes(ctx, f, "default", SearchAttributes()))
		assert.Equal(t, SearchAttributes(), f.attrs)
		assert.Equal(t, 1, f.adds)
		require.NoError(t, ensureSearchAttributes(ctx, f, "default", SearchAttributes()))
		assert.Equal(t, 1, f.adds, "nothing to add the second time")
	})

	t.Run("system attribute counts as present", func(t *testing.T) {
		f := &fakeOperator{attrs: map[string]enumspb.IndexedValueType{}}
		require.NoError(t, ensureSearchAttributes(ctx, f, "", map[string]enumspb.IndexedValueType{"WorkflowId": enumspb.INDEXED_VALUE_TYPE_KEYWORD}))
		assert.Zero(t, f.adds)
	})

	t.Run("created concurrently by someone else", func(t *testing.T) {
		f := &fakeOperator{attrs: map[string]enumspb.IndexedValueType{}, raceWith: SearchAttributes()}
		require.NoError(t, ensureSearchAttributes(ctx, f, "default", SearchAttributes()))
	})

	t.Run("wrong type", func(t *testing.T) {
		f := &fakeOperator{attrs: map[string]enumspb.IndexedValueType{contract.SAStage: enumspb.INDEXED_VALUE_TYPE_TEXT}}
		err := ensureSearchAttributes(ctx, f, "default", SearchAttributes())
		require.Error(t, err)
		assert.Contains(t, err.Error(), "VmStage is Text, vmflow needs Keyword")
		assert.Zero(t, f.adds)
	})

	t.Run("permission denied names the attributes and the fix", func(t *testing.T) {
		f := &fakeOperator{
			attrs:  map[string]enumspb.IndexedValueType{contract.SAInstanceID: enumspb.INDEXED_VALUE_TYPE_KEYWORD},
			addErr: serviceerror.NewPermissionDenied("Request unauthorized.", ""),
		}
		err := ensureSearchAttributes(ctx, f, "prod", SearchAttributes())
		require.Error(t, err)
		assert.ErrorIs(t, err, ErrSearchAttributePermission)
		msg := err.Error()
		assert.Contains(t, msg, "lacks the right to create search attributes VmHostId, VmNeedsAttention, VmStage in namespace prod")
		assert.Contains(t, msg, "run: temporal operator search-attribute create --namespace prod --name VmHostId --type Keyword"+
			" && temporal operator search-attribute create --namespace prod --name VmNeedsAttention --type Bool"+
			" && temporal operator search-attribute create --namespace prod --name VmStage --type Keyword: ")
		assert.Equal(t, 3, strings.Count(msg, "--type"), "one command per attribute (TestCreateCommandsRunAgainstDevServer runs them)")
		assert.NotContains(t, msg, "--name VmInstanceId", "only the missing ones")
		var denied *serviceerror.PermissionDenied
		assert.ErrorAs(t, err, &denied, "the server's error is kept")
	})

	t.Run("other errors are wrapped", func(t *testing.T) {
		f := &fakeOperator{attrs: map[string]enumspb.IndexedValueType{}, listErr: serviceerror.NewUnavailable("down")}
		err := ensureSearchAttributes(ctx, f, "default", SearchAttributes())
		var unavailable *serviceerror.Unavailable
		assert.ErrorAs(t, err, &unavailable)
		f = &fakeOperator{attrs: map[string]enumspb.IndexedValueType{}, addErr: errors.New("boom")}
		assert.ErrorContains(t, ensureSearchAttributes(ctx, f, "default", SearchAttributes()), "create search attributes")
	})

	t.Run("nil client", func(t *testing.T) {
		assert.Error(t, EnsureSearchAttributes(ctx, nil, "default", SearchAttributes()))
	})
}
