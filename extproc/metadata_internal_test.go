package extproc

import (
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
)

// A request's key_hash goes where the template's key_hash is, whatever the namespace and route
// names hold: a namespace of 64 '#' once took it, and the access log lost every field.
func TestMetadataKeyHashWhateverTheNames(t *testing.T) {
	keyHash := strings.Repeat("a", 64)
	for _, names := range [][2]string{
		{"idempotency", "default"},
		{strings.Repeat("#", 64), "default"},
		{"idempotency", strings.Repeat("#", 64)},
		{strings.Repeat("$", 64), strings.Repeat("#", 70)},
	} {
		tpl := &metadataTemplates{namespace: names[0], route: names[1]}
		for range 2 { // built, then from the cache
			var resp extprocv3.ProcessingResponse
			require.NoError(t, proto.Unmarshal(tpl.encode(Executed, "", keyHash), &resp))
			f := resp.GetDynamicMetadata().GetFields()
			require.Contains(t, f, names[0], "the namespace the policy names")
			fields := f[names[0]].GetStructValue().GetFields()
			require.Equal(t, keyHash, fields["key_hash"].GetStringValue())
			require.Equal(t, names[1], fields["route"].GetStringValue())
			require.Equal(t, "executed", fields["outcome"].GetStringValue())
		}
		var resp extprocv3.ProcessingResponse
		require.NoError(t, proto.Unmarshal(tpl.encode(Replayed, "", ""), &resp))
		require.NotContains(t, resp.GetDynamicMetadata().GetFields()[names[0]].GetStructValue().GetFields(), "key_hash")
	}
}
