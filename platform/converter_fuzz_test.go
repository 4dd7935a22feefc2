package platform

import (
	"encoding/json"
	"testing"

	commonpb "go.temporal.io/api/common/v1"
	"go.temporal.io/sdk/converter"
	"google.golang.org/protobuf/proto"

	vmflowv1 "vmflow/proto/vmflow/v1"
)

// FuzzFromPayload: workflow inputs and signal payloads come from outside
// (the CLI's --input, the platform API, a replayed history). Decoding any
// bytes with either encoding into any vmflow input type must not panic; a
// payload that decodes (json/plain or json/protobuf) was valid JSON, and its
// decoded message survives an encode/decode round trip unchanged (nothing
// half-decoded).
func FuzzFromPayload(f *testing.F) {
	for _, s := range []string{
		`{"instance_id":"vm1","host_id":"h1","vcpus":1,"memory_mib":128,"machine":"none"}`,
		`{"instance_id":"vm1","graceful_timeout_seconds":3}`,
		`{"reason":"GPU reset"}`,
		`{"instanceId":"vm1"}`,
		`{"instance_id":"vm1","unknown":{"deep":[1,2,{"x":null}]}}`,
		`{"vcpus":-1}`, `{"vcpus":1e99}`, `{"graceful_timeout_seconds":"3s"}`,
		`null`, `[]`, `""`, `{`, ``, `{"instance_id":"\u0000"}`,
	} {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	dc := DataConverter()
	f.Fuzz(func(t *testing.T, data []byte, protoJSON bool) {
		enc := converter.MetadataEncodingJSON
		if protoJSON {
			enc = converter.MetadataEncodingProtoJSON
		}
		p := &commonpb.Payload{Metadata: map[string][]byte{converter.MetadataEncoding: []byte(enc)}, Data: data}
		for _, target := range []func() proto.Message{
			func() proto.Message { return &vmflowv1.SpawnRequest{} },
			func() proto.Message { return &vmflowv1.DeleteRequest{} },
			func() proto.Message { return &vmflowv1.RetrySignal{} },
			func() proto.Message { return &vmflowv1.AbandonSignal{} },
			func() proto.Message { return &vmflowv1.ReconcileVGPURequest{} },
		} {
			msg := target()
			if err := dc.FromPayload(p, msg); err != nil {
				continue
			}
			if !json.Valid(data) {
				t.Fatalf("%T decoded from invalid JSON %q", msg, data)
			}
			back, err := dc.ToPayload(msg)
			if err != nil {
				t.Fatalf("%T: re-encode %v: %v", msg, msg, err)
			}
			again := target()
			if err := dc.FromPayload(back, again); err != nil {
				t.Fatalf("%T: decode of our own encoding %q: %v", msg, back.GetData(), err)
			}
			if !proto.Equal(msg, again) {
				t.Fatalf("%T: round trip changed %v into %v", msg, msg, again)
			}
		}
	})
}
