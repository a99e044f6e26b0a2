package extproc_test

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A request whose outcome is unknown and recorded as such (unknown_outcome: record) ran, but no
// response of it was seen or kept: its log line says so, as for one never recorded.
func TestUnknownOutcomeRecordLogsNoResponseSeen(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {unknown_outcome: record}"})
	s := h.open()
	s.send(requestHeaders(post("/v1/payments", "k", `{}`)))
	s.send(requestBody([]byte(`{}`)))
	h.executed["k"]++
	s.end()
	h.waitIdle(t)
	require.Contains(t, h.logs.String(), `"outcome":"executed"`)
	require.Contains(t, h.logs.String(), `"response_seen":false`)
}
