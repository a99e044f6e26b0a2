package extproc_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// An MCP endpoint: every method on one path; tools/call is protected, keyed by the call's _meta
// (or its arguments), scoped by the tool, and fingerprinted without _meta and id. Other methods
// fall through to the route after it. /api reads a key from plain JSON bodies.
const mcpRoutes = `
routes:
  - name: mcp-tool-calls
    match:
      path_prefix: /mcp
      json: {/method: tools/call}
    key_json: [/params/arguments/_idempotency_key, /params/_meta/idempotencyKey]
    scope:
      - header: x-agent
      - json: /params/name
    fingerprint_ignore_json: [/params/_meta]
    json_rpc: true
  - name: mcp
    match: {path_prefix: /mcp}
  - name: api
    match: {path_prefix: /api}
    key_json: [/request_id]
    fingerprint_ignore_json: [/sent_at]
`

// toolCall is an MCP tools/call request as an SDK writes it.
func toolCall(id, key, tool, args string) request {
	body := `{"jsonrpc":"2.0","id":` + id + `,"method":"tools/call","params":{"name":"` + tool + `","_meta":{"idempotencyKey":"` + key + `"},"arguments":` + args + `}}`
	return request{method: "POST", path: "/mcp", headers: []string{"content-type", "application/json", "x-agent", "agent-1"}, body: []byte(body)}
}

var toolResult = upstream{
	status:  200,
	headers: []string{"content-type", "application/json"},
	body:    []byte(`{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"sent"}]}}`),
}

// rpcError is a JSON-RPC error response's members.
type rpcError struct {
	JSONRPC string          `json:"jsonrpc"`
	ID      json.RawMessage `json:"id"`
	Error   struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
		Data    struct {
			Code   string `json:"code"`
			Status int    `json:"status"`
		} `json:"data"`
	} `json:"error"`
}

func readRPCError(t *testing.T, res result) rpcError {
	t.Helper()
	require.Equal(t, 200, res.status, "a JSON-RPC error travels in HTTP 200: %s", res.body)
	var e rpcError
	require.NoError(t, json.Unmarshal(res.body, &e), "%s", res.body)
	require.Equal(t, "2.0", e.JSONRPC)
	require.Equal(t, -32000, e.Error.Code)
	return e
}

// An agent's retry of a tool call, with a new JSON-RPC id, its members in another order and
// another _meta, runs once and is answered with the stored result carrying the retry's own id.
func TestToolCallRetryReplaysWithItsOwnID(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	first := h.do(toolCall("1", "k-1", "send_mail", `{"to":"a@example.com","amount":9007199254740993}`), toolResult)
	require.True(t, first.executed)
	require.Equal(t, []string{"false"}, first.header("x-idempotency-replayed"))

	retry := toolCall(`"retry-2"`, "k-1", "send_mail", `{"amount":9007199254740993, "to":"a@example.com"}`)
	retry.body = []byte(strings.Replace(string(retry.body), `"_meta":{`, `"_meta":{"progressToken":7,`, 1))
	second := h.do(retry, toolResult)
	require.False(t, second.executed, "the retry must not run the tool again")
	require.Equal(t, 200, second.status)
	require.Equal(t, []string{"true"}, second.header("x-idempotency-replayed"))
	require.JSONEq(t, `{"jsonrpc":"2.0","id":"retry-2","result":{"content":[{"type":"text","text":"sent"}]}}`, string(second.body))
	h.waitIdle(t)
	require.Equal(t, 1.0, h.counter("idempotency_requests_total", "route", "mcp-tool-calls", "outcome", "replayed"))

	// The same key for another tool is another record: the tool is in the scope.
	other := h.do(toolCall("3", "k-1", "charge_card", `{"to":"a@example.com","amount":9007199254740993}`), toolResult)
	require.True(t, other.executed)
}

// Bodies that differ only in an integer beyond 2^53 (one double for both) are two requests: 422,
// not a replay. So is a changed argument.
func TestToolCallChangedArgumentIsAMismatch(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	require.True(t, h.do(toolCall("1", "k-1", "charge_card", `{"amount":9007199254740993}`), toolResult).executed)
	for _, args := range []string{`{"amount":9007199254740992}`, `{"amount":9007199254740993,"memo":"x"}`} {
		res := h.do(toolCall("2", "k-1", "charge_card", args), toolResult)
		require.False(t, res.executed)
		e := readRPCError(t, res)
		require.Equal(t, "2", string(e.ID), "the error carries the request's id")
		require.Equal(t, "idempotency-key-reused", e.Error.Data.Code)
		require.Equal(t, 422, e.Error.Data.Status)
		require.Equal(t, "Unprocessable Content", e.Error.Message)
	}
	h.waitIdle(t)
	require.Equal(t, 2.0, h.counter("idempotency_requests_total", "route", "mcp-tool-calls", "outcome", "mismatch"))
}

// A request that match.json does not take falls through to the next route on the path.
func TestMatchJSONFallsThrough(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	initialize := request{method: "POST", path: "/mcp", headers: []string{"content-type", "application/json"},
		body: []byte(`{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"_meta":{"idempotencyKey":"k"}}}`)}
	for range 2 {
		res := h.do(initialize, toolResult)
		require.True(t, res.executed, "not the tool route's, and without a header key the next route does not cover it")
		require.Empty(t, res.header("x-idempotency-replayed"))
	}
	h.waitIdle(t)
	require.Equal(t, 2.0, h.counter("idempotency_requests_total", "route", "mcp", "outcome", "passthrough"))
	require.Zero(t, h.counter("idempotency_requests_total", "route", "mcp-tool-calls", "outcome", "passthrough"))

	// With a header key the next route covers it, by its own settings.
	initialize.headers = append(initialize.headers, "idempotency-key", "h-1")
	require.True(t, h.do(initialize, toolResult).executed)
	res := h.do(initialize, toolResult)
	require.False(t, res.executed)
	require.Equal(t, []string{"true"}, res.header("x-idempotency-replayed"))
	require.Equal(t, toolResult.body, res.body, "the next route is no json_rpc route: the replay is byte for byte")
}

// A JSON-RPC batch is not covered, and is counted.
func TestJSONRPCBatchPassesUncovered(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	call := toolCall("1", "k-1", "send_mail", `{}`)
	batch := call
	batch.body = []byte("[" + string(call.body) + "]")
	// The batch is not a tools/call object: the tool route does not match it...
	require.True(t, h.do(batch, toolResult).executed)
	// ...unless Envoy names the route outright.
	batch.named = "mcp-tool-calls"
	for range 2 {
		res := h.do(batch, toolResult)
		require.True(t, res.executed)
		require.Empty(t, res.header("x-idempotency-replayed"))
	}
	h.waitIdle(t)
	require.Equal(t, 2.0, h.counter("idempotency_not_covered_total", "route", "mcp-tool-calls", "reason", "json-rpc-batch"))
	require.Equal(t, 2.0, h.counter("idempotency_requests_total", "route", "mcp-tool-calls", "outcome", "passthrough"))
	// Only a json_rpc route has the series.
	families, err := h.registry.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == "idempotency_not_covered_total" {
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "route" {
						require.Equal(t, "mcp-tool-calls", l.GetValue(), "a route without json_rpc has no json-rpc-batch series")
					}
				}
			}
		}
	}
}

// A body key and a different header key on one request are refused; the same key in both is one
// key.
func TestBodyKeyAndHeaderKey(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	conflict := post("/api/orders", "header-key", `{"request_id":"body-key","sku":"a"}`)
	res := h.do(conflict, created)
	require.False(t, res.executed)
	require.Equal(t, 400, res.status)
	require.Contains(t, string(res.body), `"code":"idempotency-key-conflict"`)

	rpc := toolCall("5", "body-key", "send_mail", `{}`)
	rpc.headers = append(rpc.headers, "idempotency-key", "header-key")
	e := readRPCError(t, h.do(rpc, toolResult))
	require.Equal(t, "idempotency-key-conflict", e.Error.Data.Code)
	require.Equal(t, "5", string(e.ID))

	same := post("/api/orders", "k-2", `{"request_id":"k-2","sku":"a","sent_at":1}`)
	require.True(t, h.do(same, created).executed)
	bodyOnly := post("/api/orders", "", `{"sku":"a", "request_id":"k-2", "sent_at":2}`)
	res = h.do(bodyOnly, created)
	require.False(t, res.executed, "the body key is the header key: one record, and sent_at does not count")
	require.Equal(t, created.body, res.body)
}

// A route that reads the body's members refuses a body that is not JSON, or nests too deep, with
// a clear 400; a route without a key passes it through.
func TestMalformedJSONBody(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	deep := `{"request_id":"k","x":` + strings.Repeat("[", 10000) + strings.Repeat("]", 10000) + `}`
	for _, body := range []string{`request_id=k`, `{"request_id":"k"`, deep} {
		res := h.do(post("/api/orders", "", body), created)
		require.False(t, res.executed)
		require.Equal(t, 400, res.status)
		require.Contains(t, string(res.body), `"code":"invalid-json-body"`)
	}
	h.waitIdle(t)
	require.Equal(t, 3.0, h.counter("idempotency_requests_total", "route", "api", "outcome", "invalid"))
}

// In every request body mode, a tool call is claimed at its body's end and its retry replayed
// with the retry's id, and a request that match.json does not take goes on untouched, its body
// (sent back in FULL_DUPLEX_STREAMED) whole.
func TestToolCallsInEveryBodyMode(t *testing.T) {
	shapes := []struct {
		name string
		sh   shape
	}{
		{"buffered", shape{reqMode: modeBuffered, respMode: modeBuffered}},
		{"streamed, chunks", shape{reqMode: modeStreamed, respMode: modeStreamed, chunks: []int{5, 40}, respChunks: []int{9}}},
		{"streamed, body sent before the header answer", shape{reqMode: modeStreamed, respMode: modeBuffered, chunks: []int{30}, bodyBeforeAnswer: true}},
		{"full duplex, chunks", shape{reqMode: modeDuplex, respMode: modeDuplex, chunks: []int{7, 33}, respChunks: []int{2, 2}}},
	}
	for _, tc := range shapes {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: mcpRoutes})
			first := h.run(toolCall("1", "k-1", "send_mail", `{"to":"a@example.com"}`), tc.sh, toolResult)
			require.True(t, first.ran)
			require.Equal(t, []string{"false"}, first.header(replayed))
			retry := h.run(toolCall("2", "k-1", "send_mail", `{"to":"a@example.com"}`), tc.sh, toolResult)
			require.False(t, retry.ran, "a retry never runs")
			require.JSONEq(t, `{"jsonrpc":"2.0","id":2,"result":{"content":[{"type":"text","text":"sent"}]}}`, string(retry.body))

			list := request{method: "POST", path: "/mcp", body: []byte(`{"jsonrpc":"2.0","id":3,"method":"tools/list"}`)}
			for range 2 {
				res := h.run(list, tc.sh, toolResult)
				require.True(t, res.ran, "not a tool call: it runs, every time")
				require.Empty(t, res.header(replayed))
			}
		})
	}
}

// key-hash computes a tool call's record name as the stream stored it: the route chosen by the
// body, the tool's name from it in the scope.
func TestKeyHashOfAToolCall(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	call := toolCall("1", "k-1", "send_mail", `{"to":"a@example.com"}`)
	require.True(t, h.do(call, toolResult).executed)
	h.waitIdle(t)
	find := func(body []byte) (string, bool) {
		r, hashed, err := extproc.KeyHash(h.policy, extproc.KeyRequest{Path: "/mcp", Key: "k-1", Headers: [][2]string{{"x-agent", "agent-1"}}, Body: body}, nil)
		require.NoError(t, err)
		l, rec, err := h.store.Acquire(t.Context(), r.KeyPrefix+hashed, cache.Claim{LockTTL: time.Second, TTL: time.Second})
		require.NoError(t, err)
		if l.Held() {
			require.NoError(t, h.store.Release(t.Context(), l))
		}
		return r.Name, rec != nil && rec.State == cache.Completed
	}
	route, found := find(call.body)
	require.Equal(t, "mcp-tool-calls", route)
	require.True(t, found, "the record the stream stored")
	route, found = find([]byte(strings.Replace(string(call.body), "send_mail", "charge_card", 1)))
	require.Equal(t, "mcp-tool-calls", route)
	require.False(t, found, "another tool is another scope")
	_, _, err := extproc.KeyHash(h.policy, extproc.KeyRequest{Path: "/mcp", Route: "mcp-tool-calls", Key: "k-1", Body: []byte("{")}, nil)
	require.ErrorContains(t, err, "invalid-json-body")
}

// A route match.json chooses at the body's end scopes by the caller's JWT even when the route
// the headers pointed at does not: Alice and Bob sending the same key and body each run once.
func TestBodyChosenRouteKeepsJWTScope(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `
defaults: {scope: [{jwt_claim: sub}]}
routes:
  - name: mcp-tool-calls
    match: {path_prefix: /mcp, json: {/method: tools/call}}
    key_json: [/params/_meta/idempotencyKey]
    scope: [{header: x-agent}, {json: /params/name}]
    json_rpc: true
  - name: mcp
    match: {path_prefix: /mcp}
`})
	body := []byte(`{"jsonrpc":"2.0","id":1,"method":"resources/read","params":{"uri":"file:///secret"}}`)
	as := func(sub string) request {
		r := request{method: "POST", path: "/mcp", headers: []string{"content-type", "application/json", "idempotency-key", "k-1"}, body: body}
		return withJWT(r, payloadOf(t, `{"sub":"`+sub+`"}`))
	}
	alice := upstream{status: 200, headers: []string{"content-type", "application/json"}, body: []byte(`{"jsonrpc":"2.0","id":1,"result":"alice's secret"}`)}
	require.True(t, h.do(as("alice"), alice).executed)
	res := h.do(as("bob"), upstream{status: 200, body: []byte(`bob's`)})
	require.True(t, res.executed, "Bob was answered from Alice's record: %s", res.body)
	require.Equal(t, "bob's", string(res.body))
	require.False(t, h.do(as("alice"), alice).executed, "Alice's retry replays")
}

// Under missing_key: body-hash, a JSON-RPC retry carries a new id and is still the same request:
// the key hashes the canonical body without /id and the fingerprint_ignore_json members.
func TestBodyHashKeyOfAJSONRPCRetry(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `
routes:
  - name: rpc
    match: {path_prefix: /rpc}
    missing_key: body-hash
    fingerprint_ignore_json: [/params/trace]
    json_rpc: true
`})
	call := func(id, amount, trace string) request {
		return request{method: "POST", path: "/rpc", headers: []string{"content-type", "application/json"},
			body: []byte(`{"jsonrpc":"2.0","id":` + id + `,"method":"charge","params":{"amount":` + amount + `,"trace":"` + trace + `"}}`)}
	}
	require.True(t, h.do(call("1", "5", "a"), toolResult).executed)
	res := h.do(call("2", "5", "b"), toolResult)
	require.False(t, res.executed, "a retry with a new id and trace ran again")
	require.Equal(t, []string{"true"}, res.header(replayed))
	require.Contains(t, string(res.body), `"id":2`)
	require.True(t, h.do(call("3", "6", "a"), toolResult).executed, "another amount is another request")
}

// A body whose match.json members hold belongs to that route, even when its key is invalid or it
// nests too deep to read: it is refused there, never handed to the next route uncovered.
func TestMatchJSONRouteRefusesItsUnreadableBody(t *testing.T) {
	deep := toolCall("1", "k", "send_mail", `{"x":`+strings.Repeat("[", 70)+strings.Repeat("]", 70)+`}`)
	for _, tc := range []struct {
		name string
		req  request
		code string
	}{
		{"key too long", toolCall("1", strings.Repeat("x", 1000), "send_mail", `{}`), "invalid-idempotency-key"},
		{"key with a control character", toolCall("1", `a\u0001b`, "send_mail", `{}`), "invalid-idempotency-key"},
		{"nested deeper than 64 levels", deep, "invalid-json-body"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, harnessOptions{policy: mcpRoutes})
			for range 2 {
				res := h.do(tc.req, toolResult)
				require.False(t, res.executed, "passed to the next route: %s", res.body)
				e := readRPCError(t, res)
				require.Equal(t, tc.code, e.Error.Data.Code)
				require.JSONEq(t, `1`, string(e.ID))
			}
			h.waitIdle(t)
			require.Equal(t, 2.0, h.counter("idempotency_requests_total", "route", "mcp-tool-calls", "outcome", "invalid"))
		})
	}
}

// A stored result may nest deeper than a request body may: its replay carries the retry's id;
// one the id rewrite cannot read is answered response-not-replayable, never with the first id.
func TestToolCallReplayOfADeepResult(t *testing.T) {
	nested := func(n int) upstream {
		return upstream{status: 200, headers: []string{"content-type", "application/json"},
			body: []byte(`{"jsonrpc":"2.0","result":{"structuredContent":` + strings.Repeat("[", n) + strings.Repeat("]", n) + `},"id":1}`)}
	}
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	deep := nested(70)
	require.True(t, h.do(toolCall("1", "k-70", "send_mail", `{}`), deep).executed)
	res := h.do(toolCall("2", "k-70", "send_mail", `{}`), deep)
	require.False(t, res.executed)
	require.Equal(t, strings.Replace(string(deep.body), `"id":1`, `"id":2`, 1), string(res.body))

	unreadable := nested(20000) // beyond the JSON decoder's own nesting limit
	require.True(t, h.do(toolCall("1", "k-20000", "send_mail", `{}`), unreadable).executed)
	res = h.do(toolCall("3", "k-20000", "send_mail", `{}`), unreadable)
	require.False(t, res.executed)
	e := readRPCError(t, res)
	require.Equal(t, "response-not-replayable", e.Error.Data.Code)
	require.JSONEq(t, `3`, string(e.ID))
}

// A replay carries the retry's id as the client wrote it, and rewrites only JSON-RPC responses:
// a stored JSON body with an "id" member of its own is replayed byte for byte.
func TestToolCallReplayIDText(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: mcpRoutes})
	require.True(t, h.do(toolCall("1", "k", "send_mail", `{}`), toolResult).executed)
	for _, id := range []string{`1.0`, `"\u0031"`, `1E2`, `-0`, `12345678901234567890123`, `"call-2"`, `null`} {
		res := h.do(toolCall(id, "k", "send_mail", `{}`), toolResult)
		require.False(t, res.executed, id)
		require.Equal(t, strings.Replace(string(toolResult.body), `"id":1`, `"id":`+id, 1), string(res.body), id)
	}
	// A refusal carries it as written too.
	res := h.do(toolCall(`1.50`, "k", "send_mail", `{"other":1}`), toolResult)
	require.Equal(t, `1.50`, string(readRPCError(t, res).ID))

	order := upstream{status: 200, headers: []string{"content-type", "application/json"}, body: []byte(`{"id":"order-77","status":"sent"}`)}
	require.True(t, h.do(toolCall("1", "k-order", "send_mail", `{}`), order).executed)
	res = h.do(toolCall("2", "k-order", "send_mail", `{}`), order)
	require.False(t, res.executed)
	require.Equal(t, string(order.body), string(res.body), "not a JSON-RPC response: not rewritten")
}

// The shipped MCP policy replays a tool call without the first call's MCP session id.
func TestMCPPolicyReplayCarriesNoSessionID(t *testing.T) {
	p, err := os.ReadFile(filepath.Join("..", "envoy", "mcp-policy.yaml"))
	require.NoError(t, err)
	h := newHarness(t, harnessOptions{policy: string(p)})
	call := func(id string) request {
		r := toolCall(id, "k", "send_mail", `{}`)
		r.headers = append(r.headers, "authorization", "Bearer a")
		return r
	}
	first := toolResult
	first.headers = append([]string{"mcp-session-id", "session-1"}, first.headers...)
	res := h.do(call("1"), first)
	require.True(t, res.executed)
	require.Equal(t, []string{"session-1"}, res.header("mcp-session-id"), "the first call's own response keeps it")
	res = h.do(call("2"), first)
	require.False(t, res.executed)
	require.Empty(t, res.header("mcp-session-id"))
	require.Contains(t, string(res.body), `"id":2`)
}

// A body the processor holds (STREAMED) while match.json decides its route is bounded by the
// route it takes: the tool route's small max_request_bytes refuses a large tool call, never a
// large message the next route takes.
func TestMatchJSONBodyBoundedByTheRouteItTakes(t *testing.T) {
	h := newHarness(t, harnessOptions{policy: `
routes:
  - name: tools
    match: {path_prefix: /mcp, json: {/method: tools/call}}
    key_json: [/params/_meta/idempotencyKey]
    json_rpc: true
    max_request_bytes: 256
  - name: mcp
    match: {path_prefix: /mcp}
    enabled: false
`})
	for _, sh := range []shape{
		{reqMode: modeStreamed, respMode: modeBuffered, chunks: []int{200, 200}},
		{reqMode: modeDuplex, respMode: modeDuplex, chunks: []int{200, 200}, respChunks: []int{9}},
	} {
		boundedByChosenRoute(t, h, sh)
	}
}

func boundedByChosenRoute(t *testing.T, h *harness, sh shape) {
	t.Helper()
	pad := strings.Repeat("c", 500)
	list := request{method: "POST", path: "/mcp", headers: []string{"content-type", "application/json"},
		body: []byte(`{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"cursor":"` + pad + `"}}`)}
	res := h.run(list, sh, toolResult)
	require.True(t, res.ran, "the disabled route takes it, whatever the tool route's bound: %d %s", res.status, res.body)

	big := toolCall("2", "k", "send_mail", `{"body":"`+pad+`"}`)
	res = h.run(big, sh, toolResult)
	require.False(t, res.ran)
	e := readRPCError(t, res.result)
	require.Equal(t, "request-too-large", e.Error.Data.Code)
	require.JSONEq(t, `2`, string(e.ID))

	small := toolCall("3", "k-"+sh.reqMode.String(), "send_mail", `{}`)
	require.True(t, h.run(small, sh, toolResult).ran)
}
