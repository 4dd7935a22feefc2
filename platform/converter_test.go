package platform

import (
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	commonpb "go.temporal.io/api/common/v1"
	historypb "go.temporal.io/api/history/v1"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// cliPayload is what `temporal workflow start --input '<json>'` sends.
func cliPayload(json string) *commonpb.Payload {
	return &commonpb.Payload{
		Metadata: map[string][]byte{converter.MetadataEncoding: []byte(converter.MetadataEncodingJSON)},
		Data:     []byte(json),
	}
}

func TestDecodeSnakeCaseFromCLI(t *testing.T) {
	dc := DataConverter()
	var req *vmflowv1.SpawnRequest
	err := dc.FromPayload(cliPayload(`{"instance_id":"vm1","host_id":"h1","vcpus":1,"memory_mib":128,"machine":"none"}`), &req)
	require.NoError(t, err)
	require.NotNil(t, req)
	assert.Equal(t, "vm1", req.GetInstanceId())
	assert.Equal(t, "h1", req.GetHostId())
	assert.Equal(t, uint32(1), req.GetVcpus())
	assert.Equal(t, uint32(128), req.GetMemoryMib())
	assert.Equal(t, "none", req.GetMachine())

	// Into a message passed as *T rather than **T.
	var del vmflowv1.DeleteRequest
	require.NoError(t, dc.FromPayload(cliPayload(`{"instance_id":"vm1","graceful_timeout_seconds":3}`), &del))
	assert.Equal(t, "vm1", del.GetInstanceId())
	assert.Equal(t, uint32(3), del.GetGracefulTimeoutSeconds())
}

func TestDecodeRejectsCamelCase(t *testing.T) {
	dc := DataConverter()
	var req *vmflowv1.SpawnRequest
	err := dc.FromPayload(cliPayload(`{"instanceId":"vm1","host_id":"h1","memoryMib":1}`), &req)
	require.Error(t, err)
	assert.ErrorIs(t, err, converter.ErrUnableToDecode)
	assert.Contains(t, err.Error(), `"instanceId"`)
	assert.Contains(t, err.Error(), `use "instance_id"`)
	assert.Contains(t, err.Error(), `"memoryMib"`, "every offending key is named, not just the first")
	assert.Contains(t, err.Error(), "vmflow.v1.SpawnRequest")
	assert.Nil(t, req, "a rejected payload leaves the target untouched")

	var ke *UnknownKeyError
	require.ErrorAs(t, err, &ke)
	assert.Equal(t, "instanceId", ke.Key)
	assert.Equal(t, "instance_id", ke.ProtoName)
}

func TestDecodeRejectsUnknownKey(t *testing.T) {
	dc := DataConverter()
	var req *vmflowv1.SpawnRequest
	err := dc.FromPayload(cliPayload(`{"instance_id":"vm1","vcpu":2}`), &req)
	require.Error(t, err)
	assert.Contains(t, err.Error(), `unknown key "vcpu"`)
}

func TestDecodeNested(t *testing.T) {
	dc := DataConverter()

	t.Run("nested message accepted", func(t *testing.T) {
		var rec *vmflowv1.InstanceRecord
		err := dc.FromPayload(cliPayload(`{"id":"vm1","spec":{"vcpus":2,"memory_mib":64},
			"gpu_claim":{"profile":"p","claimed_at":"2025-01-02T03:04:05Z"},
			"state":"INSTANCE_STATE_RUNNING","created_at":"2025-01-02T03:04:05Z"}`), &rec)
		require.NoError(t, err)
		assert.Equal(t, uint32(64), rec.GetSpec().GetMemoryMib())
		assert.Equal(t, vmflowv1.InstanceState_INSTANCE_STATE_RUNNING, rec.GetState())
		assert.Equal(t, int64(1735787045), rec.GetGpuClaim().GetClaimedAt().GetSeconds())
	})

	t.Run("camelCase inside a nested message", func(t *testing.T) {
		var rec *vmflowv1.InstanceRecord
		err := dc.FromPayload(cliPayload(`{"id":"vm1","spec":{"memoryMib":64},"gpu_claim":{"typeId":"x","bogus":1}}`), &rec)
		require.Error(t, err)
		assert.Contains(t, err.Error(), `"spec.memoryMib" is camelCase: use "memory_mib"`)
		assert.Contains(t, err.Error(), `"gpu_claim.typeId" is camelCase: use "type_id"`)
		assert.Contains(t, err.Error(), `unknown key "gpu_claim.bogus"`)
	})

	t.Run("repeated messages", func(t *testing.T) {
		var h *historypb.History
		err := dc.FromPayload(cliPayload(`{"events":[{"event_id":"1"},{"eventId":"2"}]}`), &h)
		require.Error(t, err)
		assert.Contains(t, err.Error(), `"events[1].eventId" is camelCase: use "event_id"`)
		assert.NotContains(t, err.Error(), "events[0]")

		require.NoError(t, dc.FromPayload(cliPayload(`{"events":[{"event_id":"1"},{"event_id":"2"}]}`), &h))
		assert.Len(t, h.GetEvents(), 2)
	})

	t.Run("map of messages", func(t *testing.T) {
		var sa *commonpb.SearchAttributes
		err := dc.FromPayload(cliPayload(`{"indexed_fields":{"A":{"data":"eyJ9"},"B":{"Data":"eyJ9"}}}`), &sa)
		require.Error(t, err)
		assert.Contains(t, err.Error(), `unknown key "indexed_fields[\"B\"].Data"`)
	})

	t.Run("wrong value types are reported by protojson", func(t *testing.T) {
		var req *vmflowv1.SpawnRequest
		err := dc.FromPayload(cliPayload(`{"vcpus":"many"}`), &req)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "vcpus")
		err = dc.FromPayload(cliPayload(`[1,2]`), &req)
		require.Error(t, err)
		err = dc.FromPayload(cliPayload(`{"instance_id":"a"`), &req)
		require.Error(t, err)
	})
}

func TestRoundTripProto(t *testing.T) {
	dc := DataConverter()
	in := &vmflowv1.InstanceRecord{
		Id:        "vm1",
		Spec:      &vmflowv1.VMSpec{Vcpus: 2, MemoryMib: 256, VgpuProfile: "A16-2Q"},
		State:     vmflowv1.InstanceState_INSTANCE_STATE_RELEASE_FAILED,
		GpuClaim:  &vmflowv1.GpuClaim{Uuid: "u", ReleaseAttempts: 3},
		CreatedAt: timestamppb.New(time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)),
	}
	p, err := dc.ToPayload(in)
	require.NoError(t, err)
	assert.Equal(t, converter.MetadataEncodingJSON, string(p.GetMetadata()[converter.MetadataEncoding]))
	assert.Len(t, p.GetMetadata(), 1, "encoding only: the CLI renders such payloads as JSON")
	assert.Contains(t, string(p.GetData()), `"memory_mib":256`)
	assert.Contains(t, string(p.GetData()), `"gpu_claim":`)
	assert.NotContains(t, string(p.GetData()), "memoryMib")
	assert.NotContains(t, string(p.GetData()), " ", "compact, stable bytes")
	for range 20 {
		again, err := dc.ToPayload(in)
		require.NoError(t, err)
		require.Equal(t, string(p.GetData()), string(again.GetData()))
	}

	var out *vmflowv1.InstanceRecord
	require.NoError(t, dc.FromPayload(p, &out))
	assert.True(t, proto.Equal(in, out), "got %v", out)

	// Through FromPayloads/ToPayloads, as the SDK calls it for arguments.
	ps, err := dc.ToPayloads(&vmflowv1.SpawnResult{Pid: 42}, "x", 7)
	require.NoError(t, err)
	var (
		res *vmflowv1.SpawnResult
		s   string
		n   int
	)
	require.NoError(t, dc.FromPayloads(ps, &res, &s, &n))
	assert.Equal(t, int32(42), res.GetPid())
	assert.Equal(t, "x", s)
	assert.Equal(t, 7, n)

	// A message passed by value encodes the same way.
	pv, err := dc.ToPayload(vmflowv1.RetrySignal{Reason: "r"})
	require.NoError(t, err)
	assert.JSONEq(t, `{"reason":"r"}`, string(pv.GetData()))

	// Decoding into a reused pointer does not keep old fields.
	reuse := &vmflowv1.SpawnRequest{InstanceId: "old", Vcpus: 9}
	require.NoError(t, dc.FromPayload(cliPayload(`{"host_id":"h"}`), &reuse))
	assert.Empty(t, reuse.GetInstanceId())
	assert.Zero(t, reuse.GetVcpus())
}

func TestNil(t *testing.T) {
	dc := DataConverter()
	p, err := dc.ToPayload(nil)
	require.NoError(t, err)
	assert.Equal(t, converter.MetadataEncodingNil, string(p.GetMetadata()[converter.MetadataEncoding]))

	var typedNil *vmflowv1.SpawnRequest
	p, err = dc.ToPayload(typedNil)
	require.NoError(t, err)
	out := &vmflowv1.SpawnRequest{InstanceId: "x"}
	require.NoError(t, dc.FromPayload(p, &out))
	assert.Nil(t, out)

	// JSON null from the CLI (--input null) decodes to a nil message.
	out = &vmflowv1.SpawnRequest{InstanceId: "x"}
	require.NoError(t, dc.FromPayload(cliPayload("null"), &out))
	assert.Nil(t, out)

	// An empty object is a valid, empty message.
	require.NoError(t, dc.FromPayload(cliPayload("{}"), &out))
	require.NotNil(t, out)
	assert.Empty(t, out.GetInstanceId())

	// A nil target is an error, never a panic.
	assert.Error(t, dc.FromPayload(cliPayload(`{}`), (*vmflowv1.SpawnRequest)(nil)))
	assert.Error(t, dc.FromPayload(cliPayload(`{}`), nil))
}

func TestNonProtoValues(t *testing.T) {
	dc := DataConverter()
	type plain struct {
		Name  string `json:"name"`
		Count int    `json:"count"`
	}
	for _, tc := range []struct {
		name string
		in   any
		out  func() any
	}{
		{"string", "hello", func() any { return new(string) }},
		{"int", 42, func() any { return new(int) }},
		{"struct", plain{Name: "a", Count: 2}, func() any { return new(plain) }},
		{"map", map[string]int{"a": 1}, func() any { return new(map[string]int) }},
		{"bytes", []byte{1, 2}, func() any { return new([]byte) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := dc.ToPayload(tc.in)
			require.NoError(t, err)
			out := tc.out()
			require.NoError(t, dc.FromPayload(p, out))
			assert.Equal(t, tc.in, derefAny(out))
		})
	}

	// A plain string from the CLI, e.g. a signal's --input '"reason"'.
	var s string
	require.NoError(t, dc.FromPayload(cliPayload(`"reason"`), &s))
	assert.Equal(t, "reason", s)
	assert.Equal(t, `"reason"`, dc.ToString(cliPayload(`"reason"`)))
}

// derefAny returns what the pointer p points to.
func derefAny(p any) any { return reflect.ValueOf(p).Elem().Interface() }

func TestBinaryProtoStillDecodes(t *testing.T) {
	// A client on the SDK's defaults might send binary protobuf; there is no
	// spelling to get wrong in it, so it is accepted.
	p, err := converter.NewProtoPayloadConverter().ToPayload(&vmflowv1.RetrySignal{Reason: "r"})
	require.NoError(t, err)
	var out *vmflowv1.RetrySignal
	require.NoError(t, DataConverter().FromPayload(p, &out))
	assert.Equal(t, "r", out.GetReason())
}

func TestKeyErrorJoined(t *testing.T) {
	err := checkKeys((&vmflowv1.SpawnRequest{}).ProtoReflect().Descriptor(), []byte(`{"b":1,"a":2}`))
	require.Error(t, err)
	var ke *UnknownKeyError
	require.True(t, errors.As(err, &ke))
	assert.Equal(t, "a", ke.Key, "keys are reported sorted, so the message is stable")
}

// sdkDefault is what a client on the SDK's default converter sends: the Go
// SDK encodes a proto message as json/protobuf with lowerCamel names and a
// messageType (Java, Python and .NET do the same by default).
func sdkDefault(t *testing.T, v any) *commonpb.Payload {
	t.Helper()
	p, err := converter.GetDefaultDataConverter().ToPayload(v)
	require.NoError(t, err)
	require.Equal(t, converter.MetadataEncodingProtoJSON, string(p.GetMetadata()[converter.MetadataEncoding]))
	return p
}

// protoJSONPayload is a json/protobuf payload as another SDK might write it.
func protoJSONPayload(json, messageType string) *commonpb.Payload {
	md := map[string][]byte{converter.MetadataEncoding: []byte(converter.MetadataEncodingProtoJSON)}
	if messageType != "" {
		md[converter.MetadataMessageType] = []byte(messageType)
	}
	return &commonpb.Payload{Metadata: md, Data: []byte(json)}
}

func TestDecodeSDKDefaultConverter(t *testing.T) {
	dc := DataConverter()
	for _, in := range []proto.Message{
		&vmflowv1.SpawnRequest{InstanceId: "vm1", HostId: "h1", Vcpus: 2, MemoryMib: 128, Machine: "none",
			VgpuProfile: "GRID A100-4C", RestartPolicy: "on-failure", RestartMaxAttempts: 3, RestartStableAfterSeconds: 60},
		&vmflowv1.DeleteRequest{InstanceId: "vm1", HostId: "h1", GracefulTimeoutSeconds: 5, OnlyIfCreatedByWorkflowId: "spawn/vm1"},
		&vmflowv1.RetrySignal{Reason: "GPU reset by hand"},
		&vmflowv1.AbandonSignal{Reason: "host h1 scrapped"},
		&vmflowv1.ReconcileVGPURequest{HostId: "h1"},
	} {
		p := sdkDefault(t, in)
		assert.NotRegexp(t, `"[a-z]+_[a-z_]+":`, string(p.GetData()), "the SDK writes lowerCamel keys")
		// As the SDK hands a workflow argument over: **T.
		pp := reflect.New(reflect.TypeOf(in))
		require.NoError(t, dc.FromPayload(p, pp.Interface()), "%T", in)
		assert.True(t, proto.Equal(in, pp.Elem().Interface().(proto.Message)), "%T: got %v", in, pp.Elem().Interface())
		// And as *T.
		out := in.ProtoReflect().New().Interface()
		require.NoError(t, dc.FromPayload(p, out))
		assert.True(t, proto.Equal(in, out), "%T: got %v", in, out)
	}
}

func TestDecodeProtoJSONProtoNames(t *testing.T) {
	// ProtoJSON parsers accept the proto name as well as lowerCamel (Python's
	// preserving_proto_field_name, a hand-written payload), mixed too.
	var req *vmflowv1.SpawnRequest
	err := DataConverter().FromPayload(protoJSONPayload(`{"instance_id":"vm1","hostId":"h1","memory_mib":64}`, "vmflow.v1.SpawnRequest"), &req)
	require.NoError(t, err)
	assert.Equal(t, "vm1", req.GetInstanceId())
	assert.Equal(t, "h1", req.GetHostId())
	assert.EqualValues(t, 64, req.GetMemoryMib())
}

func TestDecodeProtoJSONRefuses(t *testing.T) {
	dc := DataConverter()
	for _, tc := range []struct {
		name string
		p    *commonpb.Payload
		want string
	}{
		{"unknown field", protoJSONPayload(`{"instanceId":"vm1","vcpu":2}`, "vmflow.v1.SpawnRequest"), `unknown field "vcpu"`},
		{"another message type", protoJSONPayload(`{"instanceId":"vm1"}`, "vmflow.v1.DeleteRequest"), "payload holds vmflow.v1.DeleteRequest, vmflow.v1.SpawnRequest expected"},
		{"wrong value type", protoJSONPayload(`{"vcpus":"two"}`, ""), "vmflow.v1.SpawnRequest"},
		{"not JSON", protoJSONPayload(`{`, ""), "vmflow.v1.SpawnRequest"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var req *vmflowv1.SpawnRequest
			err := dc.FromPayload(tc.p, &req)
			require.Error(t, err)
			assert.ErrorIs(t, err, converter.ErrUnableToDecode)
			assert.Contains(t, err.Error(), tc.want)
			assert.Nil(t, req, "a refused payload leaves the target untouched")
		})
	}
	// json/protobuf is for proto messages only.
	var s string
	err := dc.FromPayload(protoJSONPayload(`"x"`, ""), &s)
	assert.ErrorIs(t, err, converter.ErrUnableToDecode)
	// A JSON null is a nil message, as the SDK's converter reads it.
	req := &vmflowv1.SpawnRequest{InstanceId: "old"}
	require.NoError(t, dc.FromPayload(protoJSONPayload(`null`, ""), &req))
	assert.Nil(t, req)
}

func TestEncodesOnlyPlainJSON(t *testing.T) {
	// Results and query answers stay json/plain snake_case (the Web UI and
	// the CLI show them as JSON), and a client on the SDK's default
	// converter reads them into the generated structs: every field of the
	// messages the workflows return is a string, a 32-bit number or a bool,
	// which encoding/json decodes from protojson's output.
	for _, out := range []proto.Message{
		&vmflowv1.SpawnResult{Pid: 42, QmpSocket: "/run/q.sock", VgpuUuid: "u", VgpuDeviceId: "d", InstanceUuid: "i"},
		&vmflowv1.DeleteResult{AlreadyAbsent: true, Abandoned: true, AbandonReason: "r", NotOwned: true, CreatedBy: "spawn/vm1"},
		&vmflowv1.WorkflowStatus{Stage: "release-failed", Attempt: 3, LastError: "EBUSY", NextRetryTime: "2030-01-01T00:00:00Z", MetadataRetained: true, NeedsAttention: true},
		&vmflowv1.ReconcileVGPUResult{ClaimsReleased: 1, OrphansRemoved: 2, Skipped: 3, Failed: 4, RetriedDeletes: []string{"delete/vm1"}, UnreadableRecords: 5},
	} {
		p, err := DataConverter().ToPayload(out)
		require.NoError(t, err)
		assert.Equal(t, converter.MetadataEncodingJSON, string(p.GetMetadata()[converter.MetadataEncoding]), "%T", out)
		assert.NotRegexp(t, `"[a-z]+[A-Z]`, string(p.GetData()), "%T: snake_case keys only", out)
		got := out.ProtoReflect().New().Interface()
		require.NoError(t, converter.GetDefaultDataConverter().FromPayload(p, got), "%T", out)
		assert.True(t, proto.Equal(out, got), "%T: the SDK's default converter read %v", out, got)
	}
}
