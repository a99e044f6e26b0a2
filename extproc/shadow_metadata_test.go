package extproc_test

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A shadow-mode duplicate, which enforcement would have answered with the replay at its body's
// end, goes on untouched, and the first answer that lets it go on (the body's, under BUFFERED)
// carries its outcome, passthrough, to Envoy's access log.
func TestShadowPassAtTheBodyCarriesItsOutcome(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: "defaults: {mode: shadow}"})
	h.do(post("/v1/payments", "k", `{}`), created)
	h.waitIdle(t)
	s := h.open()
	require.NotNil(t, s.send(requestHeaders(post("/v1/payments", "k", `{}`))).GetRequestHeaders())
	resp := s.send(requestBody([]byte(`{}`)))
	require.NotNil(t, resp.GetRequestBody(), "the request goes on")
	md := resp.GetDynamicMetadata().GetFields()["idempotency"].GetStructValue().AsMap()
	require.Equal(t, "passthrough", md["outcome"])
	s.end()
	h.waitIdle(t)
	require.Equal(t, 1.0, h.counter("idempotency_shadow_total", "route", "default", "would", "replayed"))
}
