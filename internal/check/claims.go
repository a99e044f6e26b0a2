package check

import (
	"fmt"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// stringClaims are the claims jwt_authn passes on only as strings: jwt_verify_lib refuses a
// token whose iss, sub or jti is not a string, or whose aud is neither a string nor a list of
// strings (Jwt::parseFromString in jwt_verify_lib's src/jwt.cc), so the request never reaches
// ext_proc.
var stringClaims = map[string]bool{"iss": true, "sub": true, "jti": true, "aud": true}

// numericClaimFindings warns of each claim an enabled route scopes by that a token may carry as
// a number. jwt_authn passes the verified payload on as a protobuf Struct, whose numbers are
// doubles, and a number of magnitude 2^53 or more, or a fraction, may stand for several callers'
// values: the processor refuses such a request (400 scope-claim-ambiguous). Nothing in the
// configuration says which type an issuer writes, so every claim but the ones Envoy holds to
// strings is named.
func numericClaimFindings(d Deployment, p *policy.Policy) []Finding {
	var out []Finding
	for _, r := range enabledRoutes(p) {
		for _, src := range r.Scope {
			if src.Kind != policy.ScopeJWTClaim || stringClaims[src.Name] {
				continue
			}
			out = append(out, Finding{File: d.File, Resource: d.Resource, Field: d.FilterPath + ".metadata_options.forwarding_namespaces.untyped", Kind: kindNumericClaim,
				Problem: fmt.Sprintf("forwards the verified JWT payload, whose numbers reach the processor as doubles, and route %q scopes by jwt_claim %q, which a token may carry as a number: a caller whose %q is a number of 2^53 or more, or a fraction, gets 400 scope-claim-ambiguous, since that double may stand for several callers' values", r.Name, src.Name, src.Name),
				Fix:     fmt.Sprintf("scope by a claim Envoy accepts only as a string (sub, iss, jti), or have the issuer write %q as a string; a claim that is always a string or a whole number below 2^53 needs nothing", src.Name)})
		}
	}
	return out
}
