package envoyconf

// The demo JWTs of envoy/envoy.yaml, for tests and the compose demo: ES256 tokens from issuer
// https://issuer.example.com for audience payments, expiring in 2100, signed by a key that was
// thrown away after signing. The public half is the local JWKS of envoy.yaml's jwt_authn provider
// "demo", so Envoy accepts them on the transfers route. Two subjects, so that tests can show that
// two callers never share a record.
const (
	// DemoTokenDemoUser has subject demo-user.
	DemoTokenDemoUser = "eyJhbGciOiJFUzI1NiIsImtpZCI6ImRlbW8tMjAyNiIsInR5cCI6IkpXVCJ9.eyJpc3MiOiJodHRwczovL2lzc3Vlci5leGFtcGxlLmNvbSIsImF1ZCI6InBheW1lbnRzIiwic3ViIjoiZGVtby11c2VyIiwiZXhwIjo0MTAyNDQ0ODAwfQ.0g-5vCHax1enAaiMKKyCtiko9Urc9RXh-peqfJXzW7KV-rmmzORx3dxSVI_6DKB7cIRx7C_xrVTrhQ0W5PqHPA"
	// DemoTokenOtherUser has subject other-user.
	DemoTokenOtherUser = "eyJhbGciOiJFUzI1NiIsImtpZCI6ImRlbW8tMjAyNiIsInR5cCI6IkpXVCJ9.eyJpc3MiOiJodHRwczovL2lzc3Vlci5leGFtcGxlLmNvbSIsImF1ZCI6InBheW1lbnRzIiwic3ViIjoib3RoZXItdXNlciIsImV4cCI6NDEwMjQ0NDgwMH0.Frps7vp1EHW5dZh2qVbf_6-HHRuL6azO1k1BETK_yumFdcZyTGzE3fzf4Y3eRooT8YehLuhzoJlskw-rUTpNXQ"
)
