package tclient

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	enumspb "go.temporal.io/api/enums/v1"
	"go.temporal.io/api/operatorservice/v1"
	"go.temporal.io/api/serviceerror"
	"go.temporal.io/sdk/client"
	"google.golang.org/grpc/codes"

	"vmflow/internal/contract"
)

// SearchAttributes returns a fresh map of vmflow's search attributes and
// their types; workflows.SearchAttributes must agree (a test there checks).
func SearchAttributes() map[string]enumspb.IndexedValueType {
	return map[string]enumspb.IndexedValueType{
		contract.SAInstanceID:     enumspb.INDEXED_VALUE_TYPE_KEYWORD,
		contract.SAHostID:         enumspb.INDEXED_VALUE_TYPE_KEYWORD,
		contract.SAStage:          enumspb.INDEXED_VALUE_TYPE_KEYWORD,
		contract.SANeedsAttention: enumspb.INDEXED_VALUE_TYPE_BOOL,
	}
}

// ErrSearchAttributePermission is matched (errors.Is) by the error
// EnsureSearchAttributes returns when the caller may not create attributes.
var ErrSearchAttributePermission = errors.New("permission denied creating search attributes")

// EnsureSearchAttributes creates the attributes of attrs missing in namespace;
// idempotent, also against a concurrent creator. One with another type is an
// error: the server could not index vmflow's values.
func EnsureSearchAttributes(ctx context.Context, c client.Client, namespace string, attrs map[string]enumspb.IndexedValueType) error {
	if c == nil {
		return errors.New("ensure search attributes: nil client")
	}
	return ensureSearchAttributes(ctx, c.OperatorService(), namespace, attrs)
}

func ensureSearchAttributes(ctx context.Context, op operatorservice.OperatorServiceClient, namespace string, attrs map[string]enumspb.IndexedValueType) error {
	if namespace == "" {
		namespace = client.DefaultNamespace
	}
	missing, err := missingSearchAttributes(ctx, op, namespace, attrs)
	if err != nil {
		return err
	}
	if len(missing) == 0 {
		return nil
	}
	_, err = op.AddSearchAttributes(ctx, &operatorservice.AddSearchAttributesRequest{
		Namespace:        namespace,
		SearchAttributes: missing,
	})
	var exists *serviceerror.AlreadyExists
	switch {
	case err == nil:
	case errors.As(err, &exists):
		// Someone else created them between our list and add; the re-check
		// below still verifies the types.
	case isPermissionDenied(err):
		return fmt.Errorf("%w: this client lacks the right to create search attributes %s in namespace %s: ask an admin to run: %s: %w",
			ErrSearchAttributePermission, strings.Join(slices.Sorted(maps.Keys(missing)), ", "), namespace, createCommands(namespace, missing), err)
	default:
		return fmt.Errorf("create search attributes %s in namespace %s: %w",
			strings.Join(slices.Sorted(maps.Keys(missing)), ", "), namespace, err)
	}
	still, err := missingSearchAttributes(ctx, op, namespace, attrs)
	if err != nil {
		return err
	}
	if len(still) > 0 {
		return fmt.Errorf("search attributes %s still missing in namespace %s after creating them",
			strings.Join(slices.Sorted(maps.Keys(still)), ", "), namespace)
	}
	return nil
}

// missingSearchAttributes lists the namespace's attributes and returns the
// wanted ones that are absent; a present one of another type is an error.
func missingSearchAttributes(ctx context.Context, op operatorservice.OperatorServiceClient, namespace string, attrs map[string]enumspb.IndexedValueType) (map[string]enumspb.IndexedValueType, error) {
	resp, err := op.ListSearchAttributes(ctx, &operatorservice.ListSearchAttributesRequest{Namespace: namespace})
	if err != nil {
		if isPermissionDenied(err) {
			return nil, fmt.Errorf("%w: this client may not list search attributes in namespace %s: ask an admin to run: %s: %w",
				ErrSearchAttributePermission, namespace, createCommands(namespace, attrs), err)
		}
		return nil, fmt.Errorf("list search attributes in namespace %s: %w", namespace, err)
	}
	missing := map[string]enumspb.IndexedValueType{}
	var wrong []string
	for _, name := range slices.Sorted(maps.Keys(attrs)) {
		want := attrs[name]
		have, ok := resp.GetCustomAttributes()[name]
		if !ok {
			have, ok = resp.GetSystemAttributes()[name]
		}
		switch {
		case !ok:
			missing[name] = want
		case have != want:
			wrong = append(wrong, fmt.Sprintf("%s is %s, vmflow needs %s", name, IndexedTypeName(have), IndexedTypeName(want)))
		}
	}
	if len(wrong) > 0 {
		return nil, fmt.Errorf("search attributes in namespace %s have the wrong type: %s", namespace, strings.Join(wrong, "; "))
	}
	return missing, nil
}

func isPermissionDenied(err error) bool {
	var denied *serviceerror.PermissionDenied
	if errors.As(err, &denied) {
		return true
	}
	var svc serviceerror.ServiceError
	return errors.As(err, &svc) && svc.Status().Code() == codes.PermissionDenied
}

// createCommands is the admin's command to create attrs, one per attribute:
// CLI v1.5.1 pairs several --name with --type by index, creating only the first.
func createCommands(namespace string, attrs map[string]enumspb.IndexedValueType) string {
	var cmds []string
	for _, name := range slices.Sorted(maps.Keys(attrs)) {
		cmds = append(cmds, fmt.Sprintf("temporal operator search-attribute create --namespace %s --name %s --type %s",
			namespace, name, IndexedTypeName(attrs[name])))
	}
	return strings.Join(cmds, " && ")
}

// IndexedTypeName is the CLI's spelling of a type (Keyword, Bool, ...), not the
// enum's INDEXED_VALUE_TYPE_KEYWORD.
func IndexedTypeName(t enumspb.IndexedValueType) string {
	switch t {
	case enumspb.INDEXED_VALUE_TYPE_TEXT:
		return "Text"
	case enumspb.INDEXED_VALUE_TYPE_KEYWORD:
		return "Keyword"
	case enumspb.INDEXED_VALUE_TYPE_INT:
		return "Int"
	case enumspb.INDEXED_VALUE_TYPE_DOUBLE:
		return "Double"
	case enumspb.INDEXED_VALUE_TYPE_BOOL:
		return "Bool"
	case enumspb.INDEXED_VALUE_TYPE_DATETIME:
		return "Datetime"
	case enumspb.INDEXED_VALUE_TYPE_KEYWORD_LIST:
		return "KeywordList"
	default:
		return t.String()
	}
}
