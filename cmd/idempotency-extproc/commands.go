package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// dispatch runs the command args name, or the server.
func dispatch(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case "serve":
			return serve(ctx, args[1:], getenv, stdout, stderr)
		case "key-hash":
			return keyHashCommand(args[1:], getenv, stdout, stderr)
		case "records":
			return recordsCommand(ctx, args[1:], stdout, stderr)
		case "check":
			return checkCommand(args[1:], getenv, os.Stdin, stdout, stderr)
		case "version", "-version", "--version":
			return versionCommand(args[1:], stdout)
		case "help", "-h", "-help", "--help":
			if len(args) > 1 && args[1] != "help" && !strings.HasPrefix(args[1], "-") {
				return dispatch(ctx, []string{args[1], "--help"}, getenv, stdout, stderr)
			}
			return writeUsage(stdout)
		}
		if !strings.HasPrefix(args[0], "-") {
			return fmt.Errorf("unknown command %q (idempotency-extproc help lists the commands)", args[0])
		}
	}
	return serve(ctx, args, getenv, stdout, stderr)
}

// serve runs the server until SIGTERM or SIGINT, which start its drain; -h among its flags
// prints the usage.
func serve(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	ctx, stop := drainOnSignal(ctx)
	defer stop()
	err := run(ctx, args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return writeUsage(stdout)
	}
	return err
}

// commands are the binary's commands and what each does, as help lists them.
var commands = [][2]string{
	{"serve", "run the processor: the command when none is given"},
	{"check", "check a policy and Envoy/Istio/Envoy Gateway files before deploying them"},
	{"key-hash", "print the key_hash of the record a request would get"},
	{"records", "show or purge one record through a running server's records API"},
	{"version", "print the version"},
	{"help", "print this help; help COMMAND prints a command's"},
}

// writeUsage writes the binary's usage: its commands, then the server's flags.
func writeUsage(w io.Writer) error {
	var b strings.Builder
	b.WriteString(`usage: idempotency-extproc [COMMAND] [flags]

An Envoy external processor (ext_proc) that gives any HTTP upstream Idempotency-Key semantics.

Commands:
`)
	for _, c := range commands {
		fmt.Fprintf(&b, "  %-10s %s\n", c[0], c[1])
	}
	b.WriteString(`
"idempotency-extproc COMMAND --help" lists a command's flags.

Flags of serve. Each may also be given by its environment variable and, but for -config, in the
policy file under its name with underscores (redis_url); flags beat the environment, which beats
the file:
`)
	fs, _ := serverFlags(allSettings)
	fs.SetOutput(&b)
	fs.PrintDefaults()
	_, err := io.WriteString(w, b.String())
	return err
}

const versionUsage = `usage: idempotency-extproc version

Prints the version: the one linked at build time (make build and the image link it), else the
module version go install recorded, else devel+ the VCS revision. The ready log line and
idempotency_build_info carry it too, with the revision.
`

// versionCommand prints the version, or its usage after -h.
func versionCommand(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("idempotency-extproc version", flag.ContinueOnError)
	if done, err := parseCommandFlags(fs, args, versionUsage, stdout); done || err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("version: unexpected arguments %q", fs.Args())
	}
	_, err := fmt.Fprintln(stdout, currentBuild().version)
	return err
}

// repeated is a flag that may be given several times.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ", ") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

const keyHashUsage = `usage: idempotency-extproc key-hash --config FILE (--route NAME | --path PATH) [--key KEY] [flags]

Prints the key_hash of the record a request would get, alone on one line: the name the records
API, the logs and Envoy's access log use for it, so that
  idempotency-extproc records get "$(idempotency-extproc key-hash ...)"
works. Give the request as the client and Envoy send it: its scope headers, the claims jwt_authn
verified, the mTLS peer, the path (path parameters, body-hash keys), and the body for a route that reads it
(a key in the body's key_json members, missing_key: body-hash). The policy file's
key_hash_secret_file (or --key-hash-secret-file) keys the hash as the server does. --verbose
says on stderr which route was chosen and where its scope values come from.

Flags:
`

// keyHashCommand prints the key_hash a request would get.
func keyHashCommand(args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idempotency-extproc key-hash", flag.ContinueOnError)
	configPath := fs.String("config", "", "the server's YAML policy `file` (env IDEMPOTENCY_CONFIG)")
	route := fs.String("route", "", "the policy route's `name`, as x-idempotency-route gives it; without it --path chooses the route")
	path := fs.String("path", "", "the request's `path`, with its query: chooses the route and gives its path parameters")
	key := fs.String("key", "", "the idempotency `key` as the client sends it in Idempotency-Key; none when the body or missing_key: body-hash gives it")
	method := fs.String("method", "POST", "the request's `method`, as the client sends it: the route's methods decide whether it is covered, and a body-hash key hashes it")
	secretFile := fs.String("key-hash-secret-file", "", "the server's key-hash secret `file` (env IDEMPOTENCY_KEY_HASH_SECRET_FILE), if it has one")
	peer := fs.String("peer-identity", "", "the mTLS peer's URI SAN, a `uri`, for peer_identity scope")
	body := fs.String("body", "", "the request's `body`, for match.json, key_json, json scope entries and missing_key: body-hash")
	verbose := fs.Bool("verbose", false, "say on stderr which route was chosen and where each of its scope values comes from")
	var headers, claims repeated
	fs.Var(&headers, "header", "a request `header` 'name: value', for header scope (repeatable)")
	fs.Var(&claims, "jwt-claim", "a verified `claim` name=value, for jwt_claim scope; a JSON value (number, list) is read as JSON (repeatable)")
	if done, err := parseCommandFlags(fs, args, keyHashUsage, stdout); done || err != nil {
		return err
	}
	switch {
	case fs.NArg() > 0:
		return fmt.Errorf("key-hash: unexpected arguments %q", fs.Args())
	case *route == "" && *path == "":
		return errors.New("key-hash: give --route (the policy route name) or --path (the request's path), or both")
	}
	cfg, err := keyHashConfig(*configPath, *secretFile, getenv)
	if err != nil {
		return err
	}
	req, err := keyRequest(extproc.KeyRequest{Route: *route, Method: *method, Path: *path, Key: *key, PeerIdentity: *peer, Body: []byte(*body)}, headers, claims)
	if err != nil {
		return err
	}
	r, hashed, err := extproc.KeyHash(cfg.policy, req, cfg.keyHash)
	if err != nil {
		return fmt.Errorf("key-hash: %w", err)
	}
	if *verbose {
		if err := explainKeyHash(stderr, cfg, r, req); err != nil {
			return err
		}
	}
	_, err = fmt.Fprintln(stdout, hashed)
	return err
}

// keyHashConfig is the server's configuration as key-hash needs it: the policy file and the
// key-hash secret, the other settings from the environment.
func keyHashConfig(configPath, secretFile string, getenv func(string) string) (*config, error) {
	serverArgs := []string{}
	if configPath != "" {
		serverArgs = append(serverArgs, "--config", configPath)
	}
	if secretFile != "" {
		serverArgs = append(serverArgs, "--key-hash-secret-file", secretFile)
	}
	cfg, err := loadConfig(serverArgs, getenv)
	if err != nil {
		return nil, fmt.Errorf("key-hash: %w", err)
	}
	return cfg, nil
}

// keyRequest is req with the --header and --jwt-claim values read into it.
func keyRequest(req extproc.KeyRequest, headers, claims []string) (extproc.KeyRequest, error) {
	for _, h := range headers {
		name, value, ok := strings.Cut(h, ":")
		if !ok {
			// Not echoed: a header written without its colon may be a credential.
			return req, fmt.Errorf("key-hash: a --header has no colon: write it as 'name: value'")
		}
		req.Headers = append(req.Headers, [2]string{strings.ToLower(strings.TrimSpace(name)), strings.TrimSpace(value)})
	}
	for _, c := range claims {
		name, value, ok := strings.Cut(c, "=")
		if !ok || name == "" {
			return req, fmt.Errorf("key-hash: --jwt-claim %q: write it as name=value", c)
		}
		if req.Claims == nil {
			req.Claims = map[string]any{}
		}
		var v any
		if json.Unmarshal([]byte(value), &v) != nil {
			v = value // not JSON: a string claim, as written
		}
		req.Claims[name] = v
	}
	return req, nil
}

// explainKeyHash writes the route a request got and, for each of its scope sources in the order
// they are hashed, its kind and name and whether the request gave it: never its value, which
// may be a credential.
func explainKeyHash(w io.Writer, cfg *config, r *policy.Route, req extproc.KeyRequest) error {
	var b strings.Builder
	fmt.Fprintf(&b, "route: %s\n", r.Name)
	if cfg.keyHashSecret != nil {
		b.WriteString("hash: HMAC-SHA256 under the key-hash secret\n")
	} else {
		b.WriteString("hash: SHA-256 (no key-hash secret)\n")
	}
	if len(r.Scope) == 0 {
		b.WriteString("scope: none (the key alone names the record)\n")
	}
	for _, src := range r.Scope {
		given := "not given"
		switch src.Kind {
		case policy.ScopeHeader:
			if slices.ContainsFunc(req.Headers, func(h [2]string) bool { return h[0] == src.Name }) {
				given = "given by --header"
			}
		case policy.ScopeJWTClaim:
			if _, ok := req.Claims[src.Name]; ok {
				given = "given by --jwt-claim"
			}
		case policy.ScopePeerIdentity:
			if req.PeerIdentity != "" {
				given = "given by --peer-identity"
			}
		case policy.ScopePathParam:
			given = "from --path" // KeyHash refuses a route whose path parameters it lacks
		case policy.ScopeJSON:
			given = "from --body" // KeyHash refuses a body it cannot read; a missing member is empty
		}
		fmt.Fprintf(&b, "scope: %s %s (%s)\n", src.Kind, src.Name, given)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// parseCommandFlags parses a command's flags. After -h it writes usage and the flags to stdout
// and reports done; a bad flag is an error that says where the flags are listed.
func parseCommandFlags(fs *flag.FlagSet, args []string, usage string, stdout io.Writer) (done bool, err error) {
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	err = fs.Parse(args)
	if errors.Is(err, flag.ErrHelp) {
		return true, writeCommandUsage(fs, usage, stdout)
	}
	if err != nil {
		return true, fmt.Errorf("%s: %w (%s --help lists the flags)", strings.TrimPrefix(fs.Name(), "idempotency-extproc "), err, fs.Name())
	}
	return false, nil
}

// writeCommandUsage writes a command's usage and its flags.
func writeCommandUsage(fs *flag.FlagSet, usage string, w io.Writer) error {
	var b strings.Builder
	b.WriteString(usage)
	fs.SetOutput(&b)
	fs.PrintDefaults()
	fs.SetOutput(io.Discard)
	_, err := io.WriteString(w, b.String())
	return err
}

const recordsUsage = `usage: idempotency-extproc records get|purge KEY_HASH --admin-url URL --token-file FILE
       idempotency-extproc records list [--route NAME] [--limit N] --admin-url URL --token-file FILE

Calls the records API of a running server (started with --admin-token-file):
  get     prints the record: its route, state, times, status and body size
  purge   deletes the record, whatever its state: the next request with its key runs
  list    prints up to --limit records, one a line: key_hash, route, state, status, body
          bytes, created and expires (the server walks the store a page at a time: SCAN on
          Redis, never KEYS)

KEY_HASH is the 64 hex digits of the logs' key_hash (or of idempotency-extproc key-hash).

Flags:
`

// recordsCommand calls the records API.
func recordsCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idempotency-extproc records", flag.ContinueOnError)
	adminURL := fs.String("admin-url", "http://localhost:9003", "the `url` of the server's admin listener")
	tokenFile := fs.String("token-file", "", "the `file` holding the server's admin token (its --admin-token-file)")
	route := fs.String("route", "", "list: only the records of the policy route of this `name`")
	limit := fs.Int("limit", defaultListLimit, "list: print at most this many records (a `count`)")
	op, keyHash, done, err := parseRecordsArgs(fs, args, stdout, stderr)
	if done || err != nil {
		return err
	}
	if op == "list" {
		if *limit < 1 {
			return fmt.Errorf("records list: --limit %d: give a count of 1 or more", *limit)
		}
	} else if !validKeyHash(keyHash) {
		return fmt.Errorf("records %s: %q is not a key_hash: 64 hex digits, as the logs print it", op, keyHash)
	}
	c, err := newRecordsClient(op, *adminURL, *tokenFile)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if op == "list" {
		return c.list(ctx, *route, *limit, stdout)
	}
	return c.getOrPurge(ctx, keyHash, stdout)
}

// parseRecordsArgs parses the records command's arguments: the operation, then the key_hash
// before or after the flags. After -h it writes the usage and reports done.
func parseRecordsArgs(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (op, keyHash string, done bool, err error) {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		if done, err := parseCommandFlags(fs, args, recordsUsage, stdout); done || err != nil {
			return "", "", done, err
		}
		_ = writeCommandUsage(fs, recordsUsage, stderr)
		return "", "", false, errors.New("records: say get, purge or list")
	}
	op = args[0]
	if op != "get" && op != "purge" && op != "list" {
		_ = writeCommandUsage(fs, recordsUsage, stderr)
		return "", "", false, fmt.Errorf("records: %q is neither get, purge nor list", op)
	}
	rest := args[1:]
	if len(rest) > 0 && !strings.HasPrefix(rest[0], "-") && op != "list" {
		keyHash, rest = rest[0], rest[1:]
	}
	if done, err := parseCommandFlags(fs, rest, recordsUsage, stdout); done || err != nil {
		return "", "", done, err
	}
	if keyHash == "" && fs.NArg() == 1 && op != "list" {
		keyHash = fs.Arg(0)
	} else if fs.NArg() > 0 {
		return "", "", false, fmt.Errorf("records: unexpected arguments %q", fs.Args())
	}
	return op, keyHash, false, nil
}

// newRecordsClient is the client of op for the admin listener at adminURL, with the token of
// tokenFile.
func newRecordsClient(op, adminURL, tokenFile string) (recordsClient, error) {
	if tokenFile == "" {
		return recordsClient{}, fmt.Errorf("records %s: --token-file is required (the file of the server's --admin-token-file)", op)
	}
	token, err := readSecretFile(tokenFile)
	if err != nil {
		return recordsClient{}, fmt.Errorf("records %s: --token-file: %w", op, err)
	}
	base, err := url.Parse(adminURL)
	if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return recordsClient{}, fmt.Errorf("records %s: --admin-url %q is not an http(s) URL such as http://localhost:9003", op, adminURL)
	}
	return recordsClient{base: base, token: token, op: op, tokenFile: tokenFile}, nil
}

// getOrPurge gets (prints) or purges the record of keyHash, as c.op says.
func (c recordsClient) getOrPurge(ctx context.Context, keyHash string, stdout io.Writer) error {
	method := http.MethodGet
	if c.op == "purge" {
		method = http.MethodDelete
	}
	status, body, err := c.call(ctx, method, c.base.JoinPath("/v1/records", keyHash).String())
	if err != nil {
		return err
	}
	switch status {
	case http.StatusOK:
		var v any
		if json.Unmarshal(body, &v) == nil {
			body, _ = json.MarshalIndent(v, "", "  ")
		}
		_, err = fmt.Fprintf(stdout, "%s\n", body)
		return err
	case http.StatusNoContent:
		_, err = fmt.Fprintf(stdout, "purged %s\n", keyHash)
		return err
	case http.StatusNotFound:
		return fmt.Errorf("records %s: no record %s (it expired, was purged, or never existed under this policy's key prefixes)", c.op, keyHash)
	}
	return c.unexpected(status, body)
}

// recordsClient calls the records API at base with token.
type recordsClient struct {
	base      *url.URL
	token     []byte
	op        string
	tokenFile string
}

// call makes one request and returns the status and body of a 200, 204 or a problem+json 404; a
// 401, or a 404 of a server without the records API, is an error that says what to do.
func (c recordsClient) call(ctx context.Context, method, url string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, nil)
	if err != nil {
		return 0, nil, fmt.Errorf("records %s: %w", c.op, err)
	}
	req.Header.Set("Authorization", "Bearer "+string(c.token))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, fmt.Errorf("records %s: cannot reach the admin listener at %s: %w", c.op, c.base.Redacted(), err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	switch {
	case resp.StatusCode == http.StatusUnauthorized:
		return 0, nil, fmt.Errorf("records %s: the server refused the token (401): %s must hold the token of the server's --admin-token-file", c.op, c.tokenFile)
	case resp.StatusCode == http.StatusNotFound && resp.Header.Get("Content-Type") != "application/problem+json":
		return 0, nil, fmt.Errorf("records %s: %s has no records API (404): start the server with --admin-token-file", c.op, c.base.Redacted())
	}
	return resp.StatusCode, body, nil
}

func (c recordsClient) unexpected(status int, body []byte) error {
	return fmt.Errorf("records %s: the server answered %d %s: %s", c.op, status, http.StatusText(status), strings.TrimSpace(string(body)))
}

// list prints up to limit records of route (every route when empty), one a line, following the
// API's cursor from page to page.
func (c recordsClient) list(ctx context.Context, route string, limit int, stdout io.Writer) error {
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY_HASH\tROUTE\tSTATE\tSTATUS\tBODY_BYTES\tCREATED_AT\tEXPIRES_AT")
	printed, cursor := 0, ""
	for {
		q := url.Values{"limit": {strconv.Itoa(min(limit-printed, maxListLimit))}}
		if route != "" {
			q.Set("route", route)
		}
		if cursor != "" {
			q.Set("cursor", cursor)
		}
		u := c.base.JoinPath("/v1/records")
		u.RawQuery = q.Encode()
		status, body, err := c.call(ctx, http.MethodGet, u.String())
		if err != nil {
			return err
		}
		if status != http.StatusOK {
			return c.unexpected(status, body)
		}
		var page recordsPage
		if err := json.Unmarshal(body, &page); err != nil {
			return fmt.Errorf("records list: the server's answer is not a page of records: %w", err)
		}
		for _, r := range page.Records {
			if printed == limit {
				break
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\n", r.KeyHash, orDash(r.Route), r.State, statusOrDash(r.Status), r.BodyBytes, orDash(deref(r.CreatedAt)), orDash(deref(r.ExpiresAt)))
			printed++
		}
		if page.Cursor == "" || printed == limit {
			return tw.Flush()
		}
		cursor = page.Cursor
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func statusOrDash(n int) string {
	if n == 0 {
		return "-"
	}
	return strconv.Itoa(n)
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// validKeyHash reports whether s is 64 lower-case hex digits.
func validKeyHash(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}
