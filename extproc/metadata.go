package extproc

import (
	"bytes"
	"fmt"
	"sync"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
)

// The outcome in Envoy's access log: the answer that settles a request carries dynamic metadata
// under the policy's metadata_namespace, {outcome, route, replayed, key_hash, release_reason},
// which Envoy merges into the request's (Filter::setDynamicMetadata in ext_proc.cc) for
// %DYNAMIC_METADATA(idempotency:outcome)%.
//
// Building that Struct and encoding it for every request cost more than the rest of a replay. So
// it is encoded once per route, outcome and release reason, as the bytes of
// ProcessingResponse.dynamic_metadata (field 8) with a placeholder where the key_hash goes, and
// each request copies those bytes and writes its key_hash in. The bytes travel as the response's
// unknown fields, which the protobuf encoder writes out as they are: on the wire they are field
// 8, and Envoy (and any decoder) reads them as dynamic_metadata.

// keyHashPlaceholders stand for a key_hash in an encoded template: 64 bytes, as a hex SHA-256.
// The template is encoded with each, and the key_hash goes where the two encodings differ: a
// namespace or route name that holds one of them does not move it.
var keyHashPlaceholders = [2][]byte{bytes.Repeat([]byte{'#'}, 64), bytes.Repeat([]byte{'$'}, 64)}

// metadataKey names one template of a route.
type metadataKey struct {
	outcome       Outcome
	releaseReason string
	keyHash       bool
}

// metadataTemplate is one encoded template and where its key_hash goes (-1: it has none).
type metadataTemplate struct {
	raw []byte
	at  int
}

// metadataTemplates are a route's encoded templates, built on first use: a route meets only a
// few of the outcome and reason combinations.
type metadataTemplates struct {
	namespace, route string
	m                sync.Map // metadataKey → *metadataTemplate
}

// encode returns the dynamic_metadata field for outcome, release reason and key_hash ("" for
// none), as bytes for a response's unknown fields.
func (t *metadataTemplates) encode(o Outcome, releaseReason, keyHash string) []byte {
	k := metadataKey{o, releaseReason, len(keyHash) == len(keyHashPlaceholders[0])}
	v, ok := t.m.Load(k)
	if !ok {
		var raw [2][]byte
		for i, placeholder := range keyHashPlaceholders {
			f := map[string]*structpb.Value{
				"outcome":  structpb.NewStringValue(string(o)),
				"route":    structpb.NewStringValue(t.route),
				"replayed": structpb.NewBoolValue(o == Replayed),
			}
			if k.keyHash {
				f["key_hash"] = structpb.NewStringValue(string(placeholder))
			}
			if releaseReason != "" {
				f["release_reason"] = structpb.NewStringValue(releaseReason)
			}
			md := &structpb.Struct{Fields: map[string]*structpb.Value{t.namespace: structpb.NewStructValue(&structpb.Struct{Fields: f})}}
			var err error
			raw[i], err = proto.MarshalOptions{Deterministic: true}.Marshal(&extprocv3.ProcessingResponse{DynamicMetadata: md})
			if err != nil {
				panic(fmt.Sprintf("extproc: encoding dynamic metadata: %v", err)) // a Struct of strings and bools always encodes
			}
		}
		tpl := &metadataTemplate{raw: raw[0], at: -1}
		if k.keyHash {
			for i := range raw[0] {
				if raw[0][i] != raw[1][i] {
					tpl.at = i
					break
				}
			}
		}
		v, _ = t.m.LoadOrStore(k, tpl)
	}
	tpl := v.(*metadataTemplate)
	out := bytes.Clone(tpl.raw)
	if tpl.at >= 0 {
		copy(out[tpl.at:], keyHash)
	}
	return out
}

// withMetadata returns resp carrying md: resp itself when it was built for this answer alone
// (own), else a new message that shares resp's parts, since a shared answer is never changed.
func withMetadata(resp *extprocv3.ProcessingResponse, own bool, md []byte) *extprocv3.ProcessingResponse {
	if !own {
		resp = &extprocv3.ProcessingResponse{Response: resp.Response, ModeOverride: resp.ModeOverride}
	}
	resp.ProtoReflect().SetUnknown(protoreflect.RawFields(md))
	return resp
}
