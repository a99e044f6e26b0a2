package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/internal/redistest"
)

// mcpPolicy is envoy/mcp-policy.yaml, which protects an MCP server's tools/call: the key in the
// call's _meta, the tool in the scope, _meta left out of the fingerprint, and JSON-RPC replays
// carrying the retry's own id. docs/agents.md shows it as it is.
func mcpPolicy(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(repoFile(t, "envoy/mcp-policy.yaml"))
	require.NoError(t, err)
	doc, err := os.ReadFile(repoFile(t, "docs/agents.md"))
	require.NoError(t, err)
	_, policy, _ := strings.Cut(string(data), "\nroutes:")
	require.Contains(t, string(doc), "routes:"+policy, "docs/agents.md shows the policy this test runs")
	return string(data)
}

// mailArgs are the arguments of the side-effecting tool.
type mailArgs struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
}

// mcpMailServer is the official MCP Go SDK serving one side-effecting tool over streamable
// HTTP, with JSON or SSE responses; sent counts its executions.
func mcpMailServer(t *testing.T, jsonResponses bool) (url string, sent *atomic.Int64) {
	t.Helper()
	sent = &atomic.Int64{}
	server := mcp.NewServer(&mcp.Implementation{Name: "mail", Version: "v1.0.0"}, nil)
	mcp.AddTool(server, &mcp.Tool{Name: "send_mail", Description: "sends one mail"},
		func(_ context.Context, _ *mcp.CallToolRequest, in mailArgs) (*mcp.CallToolResult, any, error) {
			n := sent.Add(1)
			return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: "sent mail " + strconv.FormatInt(n, 10) + " to " + in.To}}}, nil, nil
		})
	handler := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return server },
		&mcp.StreamableHTTPOptions{JSONResponse: jsonResponses})
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	return srv.URL, sent
}

// exchange is one tools/call as the client's HTTP transport saw it.
type exchange struct {
	requestID, responseID string
	replayed              string
	contentType           string
}

// recorder is the MCP client's HTTP transport: it records the JSON-RPC id of every tools/call
// request and of the response that answered it, without changing either.
type recorder struct {
	mu    sync.Mutex
	calls []exchange
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	var body []byte
	if req.Body != nil {
		body, _ = io.ReadAll(req.Body)
		req.Body = io.NopCloser(bytes.NewReader(body))
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	var msg struct {
		ID     json.RawMessage `json:"id"`
		Method string          `json:"method"`
	}
	if err != nil || json.Unmarshal(body, &msg) != nil || msg.Method != "tools/call" {
		return resp, err
	}
	out, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(out))
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, exchange{requestID: string(msg.ID), responseID: responseID(out), replayed: resp.Header.Get("x-idempotency-replayed"), contentType: resp.Header.Get("content-type")})
	return resp, nil
}

// responseID is the id of the JSON-RPC response in body: a JSON body, or the data of an event
// stream's event that carries a result.
func responseID(body []byte) string {
	var msg struct {
		ID     json.RawMessage `json:"id"`
		Result json.RawMessage `json:"result"`
	}
	if json.Unmarshal(body, &msg) == nil {
		return string(msg.ID)
	}
	for _, line := range strings.Split(string(body), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if ok && json.Unmarshal([]byte(data), &msg) == nil && msg.Result != nil {
			return string(msg.ID)
		}
	}
	return ""
}

// An agent calls a side-effecting tool of an MCP server, then calls it again with the same key
// in the call's _meta, as its retry would. The official MCP Go SDK is both the server behind
// Envoy and the retrying client, which gives the second call its own JSON-RPC id: the tool runs
// once, and the second call gets the first result with its own id.
func TestMCPToolCallRetryRunsOnce(t *testing.T) {
	stores := []struct {
		name string
		args func(t *testing.T) []string
	}{
		{"memory", func(*testing.T) []string { return nil }},
		{"redis", func(t *testing.T) []string { return redisArgs(redistest.Start(t, redistest.Options{})) }},
	}
	for _, store := range stores {
		for _, jsonResponses := range []bool{true, false} {
			name := store.name + "/sse"
			if jsonResponses {
				name = store.name + "/json"
			}
			t.Run(name, func(t *testing.T) {
				upURL, sent := mcpMailServer(t, jsonResponses)
				s := newStack(t, stackOptions{policy: mcpPolicy(t), args: store.args(t), upstream: upURL})
				rec := &recorder{}
				ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
				defer cancel()
				client := mcp.NewClient(&mcp.Implementation{Name: "agent", Version: "v1.0.0"}, nil)
				session, err := client.Connect(ctx, &mcp.StreamableClientTransport{
					Endpoint: s.url + "/mcp", HTTPClient: &http.Client{Transport: rec}, DisableStandaloneSSE: true, MaxRetries: -1,
				}, nil)
				require.NoError(t, err)
				defer session.Close()

				call := &mcp.CallToolParams{
					Name:      "send_mail",
					Arguments: mailArgs{To: "ops@example.com", Subject: "deploy done"},
					Meta:      mcp.Meta{"idempotencyKey": "mail-7f3a"},
				}
				var texts []string
				for range 2 {
					res, err := session.CallTool(ctx, call)
					require.NoError(t, err)
					require.False(t, res.IsError)
					require.Len(t, res.Content, 1)
					texts = append(texts, res.Content[0].(*mcp.TextContent).Text)
				}
				require.Equal(t, int64(1), sent.Load(), "the tool ran once")
				require.Equal(t, []string{"sent mail 1 to ops@example.com", "sent mail 1 to ops@example.com"}, texts)

				rec.mu.Lock()
				calls := rec.calls
				rec.mu.Unlock()
				require.Len(t, calls, 2)
				require.NotEqual(t, calls[0].requestID, calls[1].requestID, "the SDK gives the retry its own id")
				for i, c := range calls {
					require.Equal(t, c.requestID, c.responseID, "call %d: the reply carries the call's own id", i)
				}
				require.Equal(t, "false", calls[0].replayed)
				require.Equal(t, "true", calls[1].replayed)
				if !jsonResponses {
					require.Contains(t, calls[1].contentType, "text/event-stream", "the replay is the stored event stream")
				}

				// Another mail is another call: it runs.
				call.Meta = mcp.Meta{"idempotencyKey": "mail-7f3b"}
				_, err = session.CallTool(ctx, call)
				require.NoError(t, err)
				require.Equal(t, int64(2), sent.Load())
			})
		}
	}
}
