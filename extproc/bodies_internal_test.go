package extproc

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// Every problem the processor answers with is one JSON object followed by a newline, as every
// body the service writes ends; a replay sends the stored body byte for byte, with or without
// a newline of its own.
func TestBodiesEndWithANewline(t *testing.T) {
	p, err := policy.Parse([]byte("{}"))
	require.NoError(t, err)
	for _, pr := range problems {
		t.Run(pr.code, func(t *testing.T) {
			resp, err := problemResponse(pr, p.Default)
			require.NoError(t, err)
			body := resp.GetImmediateResponse().GetBody()
			require.Equal(t, byte('\n'), body[len(body)-1], "%q", body)
			require.NotEqual(t, byte('\n'), body[len(body)-2], "one newline: %q", body)
			var v map[string]any
			require.NoError(t, json.Unmarshal(body, &v))
			require.Equal(t, pr.code, v["code"])
		})
	}
	for _, stored := range []string{"", "no newline", "{\"id\":1}\n", "two\n\n"} {
		rec := &cache.Record{State: cache.Completed, Response: cache.Response{Status: 201, Body: []byte(stored)}}
		require.Equal(t, []byte(stored), replayResponse(rec, p.Default, "").GetImmediateResponse().GetBody(), "replayed as stored")
	}
}
