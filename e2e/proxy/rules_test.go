package proxy_test

import (
	"net/http"
	"testing"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func regex(r string) *matcherv3.RegexMatcher { return &matcherv3.RegexMatcher{Regex: r} }

// mutation_rules decide each entry of a CONTINUE answer's header mutation
// (MutationRules::Checker::isAllowed, in its order of precedence); disallowed entries are ignored
// and counted, or fail the request with disallow_is_error.
func TestMutationRules(t *testing.T) {
	set := []*corev3.HeaderValueOption{
		setRaw("x-plain", "1", false),
		setRaw("x-envoy-flag", "1", false),
		setRaw("host", "other.example", false),
		setRaw(":path", "/rewritten", false),
		setRaw("x-secret", "1", false),
	}
	mutate := on("request_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		return st.Send(answer(req, &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}))
	})
	for _, tc := range []struct {
		name      string
		rules     *mutationrulesv3.HeaderMutationRules
		wantSet   []string // of x-plain, x-envoy-flag, x-secret
		wantPath  string
		rejected  int64
		wantFails bool
	}{
		{name: "defaults", wantSet: []string{"x-plain", "x-secret"}, wantPath: "/rewritten", rejected: 2},
		{name: "allow_envoy and allow_all_routing",
			rules:   &mutationrulesv3.HeaderMutationRules{AllowEnvoy: wrapperspb.Bool(true), AllowAllRouting: wrapperspb.Bool(true)},
			wantSet: []string{"x-plain", "x-envoy-flag", "x-secret"}, wantPath: "/rewritten"},
		{name: "disallow_system", rules: &mutationrulesv3.HeaderMutationRules{DisallowSystem: wrapperspb.Bool(true)},
			wantSet: []string{"x-plain", "x-secret"}, wantPath: "/orig", rejected: 3},
		{name: "disallow_all with allow_expression",
			rules:   &mutationrulesv3.HeaderMutationRules{DisallowAll: wrapperspb.Bool(true), AllowExpression: regex("x-pla.*")},
			wantSet: []string{"x-plain"}, wantPath: "/orig", rejected: 4},
		{name: "disallow_expression beats allow_expression",
			rules:   &mutationrulesv3.HeaderMutationRules{AllowExpression: regex("x-.*"), DisallowExpression: regex("x-secret")},
			wantSet: []string{"x-plain", "x-envoy-flag"}, wantPath: "/rewritten", rejected: 2},
		{name: "disallow_is_error", rules: &mutationrulesv3.HeaderMutationRules{DisallowIsError: wrapperspb.Bool(true)},
			wantFails: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := bufferedFilter()
			f.MutationRules = tc.rules
			e := newEnv(t, f, mutate)
			resp, _ := e.do(t, http.MethodPost, "/orig", []byte("x"))
			e.proc.next(t)
			if tc.wantFails {
				// The first disallowed entry fails the answer: status_on_error, before the upstream.
				require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
				require.Equal(t, "Invalid_attempt_to_modify_x-envoy-flag", e.record(t).CodeDetails)
				require.Zero(t, e.up.Total())
				return
			}
			require.Equal(t, http.StatusOK, resp.StatusCode)
			r := e.up.Requests()[0]
			for _, name := range []string{"x-plain", "x-envoy-flag", "x-secret"} {
				want := ""
				for _, w := range tc.wantSet {
					if w == name {
						want = "1"
					}
				}
				require.Equal(t, want, r.Header.Get(name), name)
			}
			require.Equal(t, tc.wantPath, r.Path)
			require.Equal(t, tc.rejected, e.proxy.Stats().RejectedMutations)
		})
	}
}

// With disallow_is_error a disallowed mutation in the response_headers answer fails the request
// after the upstream ran (MutationUtils::applyHeaderMutations fails it; Filter::handleErrorResponse
// sends status_on_error).
func TestDisallowIsErrorAfterTheUpstream(t *testing.T) {
	f := bufferedFilter()
	f.MutationRules = &mutationrulesv3.HeaderMutationRules{DisallowIsError: wrapperspb.Bool(true)}
	h := on("response_headers", func(st extprocv3.ExternalProcessor_ProcessServer, req *extprocv3.ProcessingRequest) error {
		return st.Send(answer(req, &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
			SetHeaders: []*corev3.HeaderValueOption{setRaw("x-envoy-replayed", "true", false)},
		}}))
	})
	e := newEnv(t, f, h)
	resp, _ := e.do(t, http.MethodPost, "/x", []byte("x"))
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
	require.Equal(t, 1, e.up.Total(), "the upstream ran")
	e.proc.next(t)
}

// ImmediateResponse headers follow the filter's mutation_rules too (ext_proc.cc
// Filter::sendImmediateResponse uses config().mutationChecker()); a failing entry is only logged.
func TestImmediateResponseUnderMutationRules(t *testing.T) {
	m := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
		setRaw("content-type", "application/json", false), setRaw("x-replayed", "true", false),
	}}
	for _, tc := range []struct {
		name       string
		rules      *mutationrulesv3.HeaderMutationRules
		wantCT     string
		wantMarker string
		errs       int64
	}{
		{"defaults", nil, "application/json", "true", 0},
		{"disallow_all", &mutationrulesv3.HeaderMutationRules{DisallowAll: wrapperspb.Bool(true)}, "text/plain", "", 0},
		{"disallow_expression with disallow_is_error",
			&mutationrulesv3.HeaderMutationRules{DisallowExpression: regex("x-replayed"), DisallowIsError: wrapperspb.Bool(true)},
			"application/json", "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := bufferedFilter()
			f.MutationRules = tc.rules
			e := newEnv(t, f, on("request_headers", sendOnce(immediate(typev3.StatusCode_Created, "{}", m, ""))))
			resp, _ := e.do(t, http.MethodGet, "/x", nil)
			require.Equal(t, http.StatusCreated, resp.StatusCode, "the reply goes out anyway")
			require.Equal(t, tc.wantCT, resp.Header.Get("Content-Type"))
			require.Equal(t, tc.wantMarker, resp.Header.Get("X-Replayed"))
			require.Equal(t, tc.errs, e.proxy.Stats().ImmediateMutationErrors)
			e.proc.next(t)
		})
	}
}

// forward_rules filter every header map sent to the processor, both directions
// (MutationUtils::headerCanBeForwarded): a disallowed name is never sent; with an allow list only
// matches are. The upstream and the client still get every header.
func TestForwardRules(t *testing.T) {
	exact := func(s string) *matcherv3.StringMatcher {
		return &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: s}}
	}
	prefix := func(s string) *matcherv3.StringMatcher {
		return &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Prefix{Prefix: s}}
	}
	for _, tc := range []struct {
		name    string
		rules   *filterextproc.HeaderForwardingRules
		seen    []string
		notSeen []string
	}{
		{name: "disallowed authorization",
			rules: &filterextproc.HeaderForwardingRules{DisallowedHeaders: &matcherv3.ListStringMatcher{Patterns: []*matcherv3.StringMatcher{exact("authorization")}}},
			seen:  []string{":path", "idempotency-key", "content-type"}, notSeen: []string{"authorization"}},
		{name: "allow list",
			rules: &filterextproc.HeaderForwardingRules{AllowedHeaders: &matcherv3.ListStringMatcher{Patterns: []*matcherv3.StringMatcher{prefix(":"), exact("idempotency-key")}}},
			seen:  []string{":path", ":method", "idempotency-key", ":status"}, notSeen: []string{"authorization", "content-type", "x-request-id"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := bufferedFilter()
			f.ForwardRules = tc.rules
			e := newEnv(t, f, nil)
			resp, _ := e.do(t, http.MethodPost, "/x", []byte("x"), "Authorization", "Bearer t", "Idempotency-Key", "k", "Content-Type", "text/plain")
			require.Equal(t, http.StatusOK, resp.StatusCode)
			log := e.proc.next(t)
			names := map[string]bool{}
			for _, m := range log.msgs {
				hm := m.GetRequestHeaders().GetHeaders()
				if m.GetResponseHeaders() != nil {
					hm = m.GetResponseHeaders().GetHeaders()
				}
				for _, h := range hm.GetHeaders() {
					names[h.GetKey()] = true
				}
			}
			for _, n := range tc.seen {
				require.True(t, names[n], n)
			}
			for _, n := range tc.notSeen {
				require.False(t, names[n], n)
			}
			require.Equal(t, "Bearer t", e.up.Requests()[0].Header.Get("Authorization"), "forwarding rules do not touch the request")
		})
	}
}
