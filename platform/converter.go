package platform

import (
	"bytes"
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"strings"

	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// DataConverter is every vmflow client's and worker's converter: proto messages
// as json/plain with snake_case proto names, decoded strictly (unknown keys
// and camelCase are errors naming the key); it also decodes what the official
// SDKs' defaults send, and encodes only json/plain. Non-protos: the SDK default.
func DataConverter() converter.DataConverter {
	return dataConverter
}

var dataConverter = converter.NewCompositeDataConverter(
	converter.NewNilPayloadConverter(),
	converter.NewByteSlicePayloadConverter(),
	// One converter owns json/plain: the composite converter picks the decoder
	// by the payload's encoding, so a second json/plain converter would replace
	// this one for decoding. It encodes every value that gets this far, so the
	// converters below only ever decode. Strict, as the SDK's default drops a
	// misspelled key silently (measured, SDK v1.51.0) and protojson alone
	// accepts the camelCase json_name too.
	NewStrictJSONPayloadConverter(),
	// What the Go, Java, Python and .NET SDKs send for a proto message (the
	// TypeScript SDK sends snake_case json/plain).
	NewProtoJSONDecoder(),
	// Binary protobuf has no spelling ambiguity, so accepting it costs
	// nothing and lets a client that sends binary protos still talk to us.
	converter.NewProtoPayloadConverter(),
)

// ProtoJSONDecoder is the payload converter for json/protobuf, the encoding
// the official SDKs' default converters give a proto message. It decodes
// with protojson (proto names and lowerCamel names both accepted, as the
// ProtoJSON spec says a parser must; unknown fields are errors) and never
// encodes: ToPayload declines every value, so vmflow's own payloads stay
// json/plain.
type ProtoJSONDecoder struct {
	unmarshal protojson.UnmarshalOptions
}

var _ converter.PayloadConverter = (*ProtoJSONDecoder)(nil)

// NewProtoJSONDecoder returns the json/protobuf decoder DataConverter uses,
// for callers that compose their own DataConverter.
func NewProtoJSONDecoder() *ProtoJSONDecoder {
	// DiscardUnknown false: a field this build does not know is a caller
	// error (a typo, or a newer contract than the worker), never dropped.
	return &ProtoJSONDecoder{unmarshal: protojson.UnmarshalOptions{DiscardUnknown: false}}
}

// Encoding is json/protobuf.
func (c *ProtoJSONDecoder) Encoding() string { return converter.MetadataEncodingProtoJSON }

// ToString returns the JSON text.
func (c *ProtoJSONDecoder) ToString(p *commonpb.Payload) string { return string(p.GetData()) }

// ToPayload declines (nil, nil): vmflow encodes proto messages as json/plain.
func (c *ProtoJSONDecoder) ToPayload(any) (*commonpb.Payload, error) { return nil, nil }

// FromPayload decodes a json/protobuf payload into *T or **T; a messageType in
// the metadata must name the target's type, so a DeleteRequest sent to
// SpawnInstance is refused even when its fields fit.
func (c *ProtoJSONDecoder) FromPayload(payload *commonpb.Payload, valuePtr any) error {
	target, set, ok := messageTarget(valuePtr)
	if !ok {
		return fmt.Errorf("%w: %s payload into %T: only a proto message decodes from it",
			converter.ErrUnableToDecode, converter.MetadataEncodingProtoJSON, valuePtr)
	}
	name := target.ProtoReflect().Descriptor().FullName()
	if mt, has := payload.GetMetadata()[converter.MetadataMessageType]; has && string(mt) != string(name) {
		return fmt.Errorf("%w: payload holds %s, %s expected", converter.ErrUnableToDecode, mt, name)
	}
	data := payload.GetData()
	if bytes.Equal(bytes.TrimSpace(data), []byte("null")) {
		set(nil)
		return nil
	}
	if err := c.unmarshal.Unmarshal(data, target); err != nil {
		return fmt.Errorf("%w: %s: %w", converter.ErrUnableToDecode, name, err)
	}
	set(target)
	return nil
}

// StrictJSONPayloadConverter encodes proto messages as snake_case JSON under
// the json/plain encoding and decodes them strictly; any other value goes to
// the SDK's JSONPayloadConverter.
type StrictJSONPayloadConverter struct {
	plain     *converter.JSONPayloadConverter
	marshal   protojson.MarshalOptions
	unmarshal protojson.UnmarshalOptions
}

var _ converter.PayloadConverter = (*StrictJSONPayloadConverter)(nil)

// NewStrictJSONPayloadConverter returns the payload converter DataConverter
// is built on, for callers that compose their own DataConverter.
func NewStrictJSONPayloadConverter() *StrictJSONPayloadConverter {
	return &StrictJSONPayloadConverter{
		plain:   converter.NewJSONPayloadConverter(),
		marshal: protojson.MarshalOptions{UseProtoNames: true},
		// DiscardUnknown stays false: unknown fields are an error. The key
		// pre-scan (checkKeys) runs first so the error names the key in our
		// words and camelCase is caught too.
		unmarshal: protojson.UnmarshalOptions{},
	}
}

// Encoding is json/plain: what the CLI sends for --input and what the UI
// renders as JSON.
func (c *StrictJSONPayloadConverter) Encoding() string { return converter.MetadataEncodingJSON }

// ToString returns the JSON text.
func (c *StrictJSONPayloadConverter) ToString(p *commonpb.Payload) string { return string(p.GetData()) }

// ToPayload encodes a proto message as snake_case JSON, anything else as
// encoding/json. No messageType metadata: the target type decides, and with
// it the temporal CLI (v1.5.1) prints base64, not JSON.
func (c *StrictJSONPayloadConverter) ToPayload(value any) (*commonpb.Payload, error) {
	msg, ok := asMessage(value)
	if !ok {
		return c.plain.ToPayload(value)
	}
	data, err := c.marshal.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", converter.ErrUnableToEncode, err)
	}
	// protojson inserts random whitespace on purpose (so nobody relies on
	// its bytes); compact it so the same message always gives the same
	// payload: recorded histories and their diffs stay stable.
	var compact bytes.Buffer
	if err := json.Compact(&compact, data); err != nil {
		return nil, fmt.Errorf("%w: %w", converter.ErrUnableToEncode, err)
	}
	data = compact.Bytes()
	return &commonpb.Payload{
		Metadata: map[string][]byte{converter.MetadataEncoding: []byte(converter.MetadataEncodingJSON)},
		Data:     data,
	}, nil
}

// asMessage returns value as a proto message when it or a pointer to it is one
// (a generated struct passed by pointer or by value).
func asMessage(value any) (proto.Message, bool) {
	if m, ok := value.(proto.Message); ok {
		return m, true
	}
	v := reflect.ValueOf(value)
	if !v.IsValid() || v.Kind() != reflect.Struct {
		return nil, false
	}
	p := reflect.New(v.Type())
	m, ok := p.Interface().(proto.Message)
	if !ok {
		return nil, false
	}
	// A generated struct passed by value (the SDK's own proto converter
	// accepts that too): encode a copy through a pointer. The copy is only
	// read, so sharing its internal state with the original is harmless.
	p.Elem().Set(v)
	return m, true
}

// FromPayload decodes into a proto message strictly (*T in place, or **T
// allocated here, the SDK's shape for a *T argument), else with encoding/json.
func (c *StrictJSONPayloadConverter) FromPayload(payload *commonpb.Payload, valuePtr any) error {
	target, set, ok := messageTarget(valuePtr)
	if !ok {
		return c.plain.FromPayload(payload, valuePtr)
	}
	data := payload.GetData()
	if bytes.Equal(bytes.TrimSpace(data), []byte("null")) {
		set(nil)
		return nil
	}
	if err := checkKeys(target.ProtoReflect().Descriptor(), data); err != nil {
		return fmt.Errorf("%w: %s: %w", converter.ErrUnableToDecode, target.ProtoReflect().Descriptor().FullName(), err)
	}
	if err := c.unmarshal.Unmarshal(data, target); err != nil {
		return fmt.Errorf("%w: %s: %w", converter.ErrUnableToDecode, target.ProtoReflect().Descriptor().FullName(), err)
	}
	set(target)
	return nil
}

// messageTarget finds the proto message behind valuePtr and set, which stores
// the decoded one (nil for null); ok is false for no proto message type.
func messageTarget(valuePtr any) (target proto.Message, set func(proto.Message), ok bool) {
	if valuePtr == nil {
		return nil, nil, false
	}
	if m, isMsg := valuePtr.(proto.Message); isMsg {
		v := reflect.ValueOf(valuePtr)
		if v.Kind() == reflect.Pointer && v.IsNil() {
			// Nowhere to write: let the plain converter report it.
			return nil, nil, false
		}
		return m, func(decoded proto.Message) {
			if decoded == nil {
				proto.Reset(m)
			}
			// Otherwise m was decoded in place.
		}, true
	}
	v := reflect.ValueOf(valuePtr)
	if v.Kind() != reflect.Pointer || v.IsNil() {
		return nil, nil, false
	}
	elem := v.Elem()
	if elem.Kind() != reflect.Pointer || !elem.CanSet() {
		return nil, nil, false
	}
	// elem is a *T; a fresh T is decoded into so a reused pointer never keeps
	// fields from an earlier value.
	fresh := reflect.New(elem.Type().Elem())
	m, isMsg := fresh.Interface().(proto.Message)
	if !isMsg {
		return nil, nil, false
	}
	return m, func(decoded proto.Message) {
		if decoded == nil {
			elem.Set(reflect.Zero(elem.Type()))
			return
		}
		elem.Set(fresh)
	}, true
}

// UnknownKeyError is a JSON key that the target message does not have under its
// proto name. Path is where it was found ("" at the top, "spec" or
// "claims[0]" inside), Key the key as written, and ProtoName the field's
// proto name when Key is that field's camelCase json_name.
type UnknownKeyError struct {
	Path      string
	Key       string
	ProtoName string
}

func (e *UnknownKeyError) Error() string {
	where := e.Key
	if e.Path != "" {
		where = e.Path + "." + e.Key
	}
	if e.ProtoName != "" {
		return fmt.Sprintf("key %q is camelCase: use %q (vmflow payloads use proto field names)", where, e.ProtoName)
	}
	return fmt.Sprintf("unknown key %q", where)
}

// checkKeys reports every key of the JSON that is not a proto field name,
// sorted, so one `temporal workflow start` shows every typo; bad values are
// protojson's to report.
func checkKeys(md protoreflect.MessageDescriptor, data []byte) error {
	var errs []error
	walkMessage(md, json.RawMessage(data), "", &errs, 0)
	if len(errs) == 0 {
		return nil
	}
	return keyErrors(errs)
}

// keyErrors joins UnknownKeyErrors on one line (errors.Join would use newlines,
// which read badly in a workflow failure and in a JSON log line).
type keyErrors []error

func (e keyErrors) Error() string {
	parts := make([]string, len(e))
	for i, err := range e {
		parts[i] = err.Error()
	}
	return strings.Join(parts, "; ")
}

func (e keyErrors) Unwrap() []error { return e }

// maxDepth bounds the walk the way protojson bounds its own recursion, so a
// hostile, deeply nested payload costs nothing here and protojson rejects it.
const maxDepth = 100

func walkMessage(md protoreflect.MessageDescriptor, raw json.RawMessage, path string, errs *[]error, depth int) {
	if depth > maxDepth || isWellKnown(md) {
		// Well-known types have their own JSON forms (Timestamp is a string,
		// Struct and Any carry arbitrary keys): protojson checks them.
		return
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil || obj == nil {
		return // not an object (or null): protojson reports the mismatch
	}
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	fields := md.Fields()
	for _, k := range keys {
		fd := fields.ByName(protoreflect.Name(k))
		if fd == nil {
			ke := &UnknownKeyError{Path: path, Key: k}
			if byJSON := fields.ByJSONName(k); byJSON != nil {
				ke.ProtoName = string(byJSON.Name())
			}
			*errs = append(*errs, ke)
			continue
		}
		walkField(fd, obj[k], join(path, k), errs, depth+1)
	}
}

func walkField(fd protoreflect.FieldDescriptor, raw json.RawMessage, path string, errs *[]error, depth int) {
	switch {
	case fd.IsMap():
		vd := fd.MapValue()
		if vd.Message() == nil {
			return
		}
		var m map[string]json.RawMessage
		if json.Unmarshal(raw, &m) != nil {
			return
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			walkMessage(vd.Message(), m[k], fmt.Sprintf("%s[%q]", path, k), errs, depth)
		}
	case fd.Message() == nil:
		return
	case fd.IsList():
		var list []json.RawMessage
		if json.Unmarshal(raw, &list) != nil {
			return
		}
		for i, item := range list {
			walkMessage(fd.Message(), item, fmt.Sprintf("%s[%d]", path, i), errs, depth)
		}
	default:
		walkMessage(fd.Message(), raw, path, errs, depth)
	}
}

func isWellKnown(md protoreflect.MessageDescriptor) bool {
	return strings.HasPrefix(string(md.FullName()), "google.protobuf.")
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}
