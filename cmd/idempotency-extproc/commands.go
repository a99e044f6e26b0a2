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
	"strings"
	"time"

	"github.com/idempotency-extproc/idempotency-extproc/extproc"
)

// dispatch runs the subcommand args name (key-hash, records), or the server.
func dispatch(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case "key-hash":
			return keyHashCommand(args[1:], getenv, stdout, stderr)
		case "records":
			return recordsCommand(ctx, args[1:], stdout, stderr)
		case "check":
			return checkCommand(args[1:], os.Stdin, stdout, stderr)
		}
	}
	return run(ctx, args, getenv, stderr)
}

// repeated is a flag that may be given several times.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ", ") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

const keyHashUsage = `usage: idempotency-extproc key-hash --config FILE (--route NAME | --path PATH) --key KEY [flags]

Prints the key_hash of the record a request would get: the name the records API, the logs and
Envoy's access log use for it. Give the request as the client and Envoy send it: its scope
headers, the claims jwt_authn verified, the mTLS peer, and the path for path parameters.
The policy file's key_hash_secret_file (or --key-hash-secret-file) keys the hash as the server does.

`

// keyHashCommand prints the key_hash a request would get.
func keyHashCommand(args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idempotency-extproc key-hash", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, keyHashUsage)
		fs.PrintDefaults()
	}
	configPath := fs.String("config", "", "the server's YAML policy file (env IDEMPOTENCY_CONFIG)")
	route := fs.String("route", "", "the policy route, as x-idempotency-route names it; without it the route is chosen by --path")
	path := fs.String("path", "", "the request's path, with its query: chooses the route and gives its path parameters")
	key := fs.String("key", "", "the Idempotency-Key as the client sends it")
	secretFile := fs.String("key-hash-secret-file", "", "the server's key-hash secret file (env IDEMPOTENCY_KEY_HASH_SECRET_FILE), if it has one")
	peer := fs.String("peer-identity", "", "the mTLS peer's URI SAN, for peer_identity scope")
	var headers, claims repeated
	fs.Var(&headers, "header", "a request header 'name: value', for header scope (repeatable)")
	fs.Var(&claims, "jwt-claim", "a verified claim name=value, for jwt_claim scope; a JSON value (number, list) is read as JSON (repeatable)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	switch {
	case fs.NArg() > 0:
		return fmt.Errorf("key-hash: unexpected arguments %q", fs.Args())
	case *key == "":
		return errors.New("key-hash: --key is required (the Idempotency-Key as the client sends it)")
	case *route == "" && *path == "":
		return errors.New("key-hash: give --route (the policy route name) or --path (the request's path), or both")
	}
	serverArgs := []string{}
	if *configPath != "" {
		serverArgs = append(serverArgs, "--config", *configPath)
	}
	if *secretFile != "" {
		serverArgs = append(serverArgs, "--key-hash-secret-file", *secretFile)
	}
	cfg, err := loadConfig(serverArgs, getenv, io.Discard)
	if err != nil {
		return fmt.Errorf("key-hash: %w", err)
	}
	req := extproc.KeyRequest{Route: *route, Path: *path, Key: *key, PeerIdentity: *peer}
	for _, h := range headers {
		name, value, ok := strings.Cut(h, ":")
		if !ok {
			return fmt.Errorf("key-hash: --header %q: write it as 'name: value'", h)
		}
		req.Headers = append(req.Headers, [2]string{strings.ToLower(strings.TrimSpace(name)), strings.TrimSpace(value)})
	}
	for _, c := range claims {
		name, value, ok := strings.Cut(c, "=")
		if !ok || name == "" {
			return fmt.Errorf("key-hash: --jwt-claim %q: write it as name=value", c)
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
	if *path == "" {
		req.Path = "/"
	}
	name, hashed, err := extproc.KeyHash(cfg.policy, req, cfg.keyHash)
	if err != nil {
		return fmt.Errorf("key-hash: %w", err)
	}
	_, err = fmt.Fprintf(stdout, "%s\troute=%s\n", hashed, name)
	return err
}

const recordsUsage = `usage: idempotency-extproc records get|purge KEY_HASH --admin-url URL --token-file FILE

Calls the records API of a running server (started with --admin-token-file):
  get     prints the record: its route, state, times, status and body size
  purge   deletes the record, whatever its state: the next request with its key runs

KEY_HASH is the 64 hex digits of the logs' key_hash (or of idempotency-extproc key-hash).

`

// recordsCommand calls the records API.
func recordsCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idempotency-extproc records", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, recordsUsage)
		fs.PrintDefaults()
	}
	adminURL := fs.String("admin-url", "http://localhost:9003", "the server's admin listener")
	tokenFile := fs.String("token-file", "", "the file holding the server's admin token (its --admin-token-file)")
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
			return nil
		}
		fs.Usage()
		return errors.New("records: say get or purge, then the key_hash")
	}
	op := args[0]
	if op != "get" && op != "purge" {
		fs.Usage()
		return fmt.Errorf("records: %q is neither get nor purge", op)
	}
	// The key_hash may come before or after the flags.
	var keyHash string
	rest := args[1:]
	if len(rest) > 0 && !strings.HasPrefix(rest[0], "-") {
		keyHash, rest = rest[0], rest[1:]
	}
	if err := fs.Parse(rest); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if keyHash == "" && fs.NArg() == 1 {
		keyHash = fs.Arg(0)
	} else if fs.NArg() > 0 {
		return fmt.Errorf("records: unexpected arguments %q", fs.Args())
	}
	if !validKeyHash(keyHash) {
		return fmt.Errorf("records %s: %q is not a key_hash: 64 hex digits, as the logs print it", op, keyHash)
	}
	if *tokenFile == "" {
		return fmt.Errorf("records %s: --token-file is required (the file of the server's --admin-token-file)", op)
	}
	token, err := readSecretFile(*tokenFile)
	if err != nil {
		return fmt.Errorf("records %s: --token-file: %w", op, err)
	}
	base, err := url.Parse(*adminURL)
	if err != nil || (base.Scheme != "http" && base.Scheme != "https") || base.Host == "" {
		return fmt.Errorf("records %s: --admin-url %q is not an http(s) URL such as http://localhost:9003", op, *adminURL)
	}
	method := http.MethodGet
	if op == "purge" {
		method = http.MethodDelete
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, base.JoinPath("/v1/records", keyHash).String(), nil)
	if err != nil {
		return fmt.Errorf("records %s: %w", op, err)
	}
	req.Header.Set("Authorization", "Bearer "+string(token))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("records %s: cannot reach the admin listener at %s: %w", op, base.Redacted(), err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	switch resp.StatusCode {
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
	case http.StatusUnauthorized:
		return fmt.Errorf("records %s: the server refused the token (401): %s must hold the token of the server's --admin-token-file", op, *tokenFile)
	case http.StatusNotFound:
		if resp.Header.Get("Content-Type") == "application/problem+json" {
			return fmt.Errorf("records %s: no record %s (it expired, was purged, or never existed under this policy's key prefixes)", op, keyHash)
		}
		return fmt.Errorf("records %s: %s has no records API (404): start the server with --admin-token-file", op, base.Redacted())
	default:
		return fmt.Errorf("records %s: the server answered %s: %s", op, resp.Status, strings.TrimSpace(string(body)))
	}
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
