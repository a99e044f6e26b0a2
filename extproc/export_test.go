package extproc

import (
	"context"
	"slices"

	"github.com/rs/zerolog"
	"google.golang.org/protobuf/proto"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// StoredKey returns the store key of a request to path carrying key and the given header pairs.
func StoredKey(p *policy.Policy, path string, key string, pairs ...string) string {
	var h headers
	for i := 0; i+1 < len(pairs); i += 2 {
		h = append(h, &corev3.HeaderValue{Key: pairs[i], RawValue: []byte(pairs[i+1])})
	}
	r, params := p.Match(string(splitPath([]byte(path))))
	k, _ := newDigest(nil).storeKey(r, requestInfo{headers: h, params: params}, nil, key)
	return k
}

// MaxUnknownRoutes is how many unknown route names a server remembers.
const MaxUnknownRoutes = maxUnknownRoutes

// UnknownRoutesRemembered returns how many unknown route names s remembers.
func UnknownRoutesRemembered(s *Server) int {
	s.unknownMu.Lock()
	defer s.unknownMu.Unlock()
	return len(s.unknownRoutes)
}

// SetCompletionLimits lowers how many completions s retries at once and the body bytes they keep.
func SetCompletionLimits(s *Server, count, bodyBytes int) {
	s.completions.mu.Lock()
	defer s.completions.mu.Unlock()
	s.completions.maxCount, s.completions.maxBodyBytes = count, bodyBytes
}

// EncodeSettledAnswer encodes the answer that settles a stored first execution on the default
// route, as gRPC would, with the request's dynamic metadata or without it.
func EncodeSettledAnswer(withMetadata bool) ([]byte, error) {
	resp := continues[kindResponseBody]
	if withMetadata {
		resp = withMetadataOf(resp)
	}
	return proto.Marshal(resp)
}

var benchTemplates = &metadataTemplates{namespace: "idempotency", route: "default"}

func withMetadataOf(resp *extprocv3.ProcessingResponse) *extprocv3.ProcessingResponse {
	return withMetadata(resp, false, benchTemplates.encode(Executed, "", "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"))
}

// LogRequestLines writes n request lines of a stored first execution with log.
func LogRequestLines(log *zerolog.Logger, n int) {
	s := &Server{log: *log}
	r := &route{Route: &policy.Route{Name: "default"}}
	st := newStream(s, context.Background(), nil)
	st.req.route, st.req.id, st.req.info.method = r, "0f6b6a4e-6c1e-4a3c-9a55-2f0c8a7f1d21", []byte("POST")
	st.call.keyHash, st.call.fate, st.call.resp.Status = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", leaseRecorded, 201
	st.outcome = Executed
	for range n {
		st.logRequest()
	}
}

// ProblemAnswer is what the built-in problems of one code answer.
type ProblemAnswer struct {
	Status     int
	RetryAfter bool
	Outcome    Outcome
}

// ProblemCodes returns the code of every problem the processor answers, each once, in the order
// of problems. docs/outcomes.md's table of problem codes has one row for each, and a policy's
// problems entries may restyle each (policy.ProblemCodes).
func ProblemCodes() []string {
	var codes []string
	for _, p := range problems {
		if !slices.Contains(codes, p.code) {
			codes = append(codes, p.code)
		}
	}
	return codes
}

// ProblemAnswers returns what the built-in problems answer, by code, and the codes whose problems
// answer differently from one another, which one row of a table could not say.
func ProblemAnswers() (answers map[string]ProblemAnswer, disagreeing []string) {
	answers = map[string]ProblemAnswer{}
	for _, p := range problems {
		a := ProblemAnswer{Status: p.status, RetryAfter: p.retryAfter, Outcome: p.outcome}
		if prev, ok := answers[p.code]; ok && prev != a {
			disagreeing = append(disagreeing, p.code)
		}
		answers[p.code] = a
	}
	return answers, disagreeing
}

// HeldKeys returns how many keys s holds (hold.go).
func HeldKeys(s *Server) int { return s.holds.len() }

// FirstMessagesAwaited returns how many streams of s wait for their first message.
func FirstMessagesAwaited(s *Server) int { return s.firstMessages.waiting() }
