package main

import (
	"cmp"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// The records API on the admin listener: GET and DELETE /v1/records/{key_hash}, and GET
// /v1/records?route=&limit=&cursor= to list them a page at a time, behind a bearer token read
// from --admin-token-file. Without the token file these paths answer 404, as any unknown path
// does.

// recordView is a record as the API shows it.
type recordView struct {
	KeyHash   string  `json:"key_hash"`
	Route     string  `json:"route"`
	State     string  `json:"state"`
	CreatedAt *string `json:"created_at"`
	ExpiresAt *string `json:"expires_at"`
	Status    int     `json:"status"`
	BodyBytes int     `json:"body_bytes"`
}

// recordsAPI serves the records API.
type recordsAPI struct {
	store    cache.Store
	token    []byte
	prefixes []string // the policy's key prefixes: a key_hash names a record under one of them
	timeout  time.Duration
	log      zerolog.Logger
	requests *prometheus.CounterVec
}

// The op and result labels of idempotency_admin_requests_total.
var (
	recordOps     = []string{"get", "purge", "list"}
	recordResults = []string{"ok", "unreadable", "not_found", "unauthorized", "bad_request", "store_error"}
)

func newRecordsAPI(store cache.Store, token []byte, prefixes []string, timeout time.Duration, log zerolog.Logger, reg prometheus.Registerer) (*recordsAPI, error) {
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idempotency_admin_requests_total",
		Help: "Calls of the records API on the admin listener, by operation (get, purge, list) and result.",
	}, []string{"op", "result"})
	for _, op := range recordOps {
		for _, r := range recordResults {
			requests.WithLabelValues(op, r)
		}
	}
	if err := reg.Register(requests); err != nil {
		return nil, err
	}
	return &recordsAPI{store: store, token: token, prefixes: prefixes, timeout: timeout, log: log, requests: requests}, nil
}

// register adds the API's routes to mux.
func (a *recordsAPI) register(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/records/{key_hash}", func(w http.ResponseWriter, r *http.Request) { a.serve(w, r, "get") })
	mux.HandleFunc("DELETE /v1/records/{key_hash}", func(w http.ResponseWriter, r *http.Request) { a.serve(w, r, "purge") })
	mux.HandleFunc("GET /v1/records", func(w http.ResponseWriter, r *http.Request) { a.serve(w, r, "list") })
}

func (a *recordsAPI) serve(w http.ResponseWriter, r *http.Request, op string) {
	keyHash := r.PathValue("key_hash")
	result := a.handle(w, r, op, keyHash)
	a.requests.WithLabelValues(op, result).Inc()
	// A refused call is counted, and logged only at debug: anyone who reaches the listener can
	// make one, as often as they like.
	ev := a.log.Info()
	switch result {
	case "store_error":
		ev = a.log.Warn()
	case "unauthorized":
		ev = a.log.Debug()
	}
	if !validKeyHash(keyHash) {
		keyHash = "" // not ours to log: it could be anything
	}
	ev.Str("component", "records-api").Str("method", r.Method).Str("op", op).Str("key_hash", keyHash).Str("result", result).Msg("records API call")
}

func (a *recordsAPI) handle(w http.ResponseWriter, r *http.Request, op, keyHash string) string {
	if !a.authorized(r) {
		w.Header().Set("WWW-Authenticate", `Bearer realm="idempotency-extproc"`)
		writeProblem(w, http.StatusUnauthorized, "unauthorized", "This call needs Authorization: Bearer with the admin token.")
		return "unauthorized"
	}
	if op == "list" {
		return a.list(w, r)
	}
	if !validKeyHash(keyHash) {
		writeProblem(w, http.StatusBadRequest, "invalid-key-hash", "A key_hash is the 64 lower-case hex digits the logs print.")
		return "bad_request"
	}
	ctx, cancel := context.WithTimeout(r.Context(), a.timeout)
	defer cancel()
	for _, prefix := range a.prefixes {
		key := prefix + keyHash
		var err error
		var rec *cache.Record
		if op == "get" {
			rec, err = a.store.Lookup(ctx, key)
		} else {
			err = a.store.Purge(ctx, key)
		}
		switch {
		case errors.Is(err, cache.ErrNotFound):
			continue
		case err != nil && !errors.Is(err, cache.ErrCorrupt):
			writeProblem(w, http.StatusServiceUnavailable, "store-unavailable", "The idempotency store did not answer; retry later.")
			return "store_error"
		case op == "purge":
			w.WriteHeader(http.StatusNoContent)
			return "ok"
		}
		view := viewOf(keyHash, rec)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(view)
		if rec == nil {
			return "unreadable"
		}
		return "ok"
	}
	writeProblem(w, http.StatusNotFound, "record-not-found", "No live record has this key_hash.")
	return "not_found"
}

// viewOf is the API's view of rec, the record stored under keyHash; a nil rec is one that exists
// but this replica cannot open (cache.ErrCorrupt).
func viewOf(keyHash string, rec *cache.Record) recordView {
	if rec == nil {
		return recordView{KeyHash: keyHash, State: "unreadable"}
	}
	view := recordView{KeyHash: keyHash, Route: rec.Route, State: "pending"}
	if rec.State == cache.Completed {
		view.State, view.Status, view.BodyBytes = "completed", rec.Response.Status, len(rec.Response.Body)
		if rec.Response.OutcomeUnknown {
			view.State = "outcome_unknown"
		}
	}
	view.CreatedAt, view.ExpiresAt = rfc3339(rec.CreatedAt), rfc3339(rec.ExpiresAt)
	return view
}

// recordsPage is a page of GET /v1/records: its records and the cursor of the next page, empty
// after the last.
type recordsPage struct {
	Records []recordView `json:"records"`
	Cursor  string       `json:"cursor"`
}

// fromStart stands in a list cursor for a store cursor that starts its prefix's listing.
const fromStart = "-"

// The records a list page holds: limit's default and bound.
const (
	defaultListLimit = 100
	maxListLimit     = 1000
)

// list answers GET /v1/records?route=&limit=&cursor=: about limit records (the store's pages are
// approximate; a route filter may leave a page with fewer, even none, before the last), walking
// each key prefix of the policy in turn with the store's cursor-paged listing (SCAN on Redis).
// The cursor is the prefix's index, '.', the store's cursor (fromStart for none).
func (a *recordsAPI) list(w http.ResponseWriter, r *http.Request) string {
	lister, ok := a.store.(cache.Lister)
	if !ok {
		writeProblem(w, http.StatusNotImplemented, "list-unsupported", "This store cannot list its records.")
		return "bad_request"
	}
	req, ok := a.listRequest(w, r.URL.Query())
	if !ok {
		return "bad_request"
	}
	ctx, cancel := context.WithTimeout(r.Context(), a.timeout)
	defer cancel()
	page := recordsPage{Records: []recordView{}}
	for req.at < len(a.prefixes) && len(page.Records) < req.limit {
		prefix := a.prefixes[req.at]
		keys, next, err := lister.Keys(ctx, prefix, req.cursor, req.limit-len(page.Records))
		if errors.Is(err, cache.ErrBadCursor) {
			writeProblem(w, http.StatusBadRequest, "invalid-cursor", "The cursor is not one a page of this listing gave.")
			return "bad_request"
		}
		if err == nil {
			page.Records, err = a.appendViews(ctx, page.Records, prefix, keys, req.route)
		}
		if err != nil {
			writeProblem(w, http.StatusServiceUnavailable, "store-unavailable", "The idempotency store did not answer; retry later.")
			return "store_error"
		}
		req.cursor = next
		if next == "" {
			req.at++
		}
	}
	if req.at < len(a.prefixes) {
		page.Cursor = strconv.Itoa(req.at) + "." + cmp.Or(req.cursor, fromStart)
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(page)
	return "ok"
}

// listCall is a list call's query, read: the route to list ("" for all), the most records to
// return, and where the page starts: the index of a key prefix and the store's cursor within it
// ("" from its start).
type listCall struct {
	route     string
	limit, at int
	cursor    string
}

// listRequest reads a list call's query; on a bad one it writes the problem and reports false.
func (a *recordsAPI) listRequest(w http.ResponseWriter, q url.Values) (listCall, bool) {
	req := listCall{route: q.Get("route"), limit: defaultListLimit}
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxListLimit {
			writeProblem(w, http.StatusBadRequest, "invalid-limit", fmt.Sprintf("limit is a whole number from 1 to %d.", maxListLimit))
			return req, false
		}
		req.limit = n
	}
	if v := q.Get("cursor"); v != "" {
		i, c, ok := strings.Cut(v, ".")
		n, err := strconv.Atoi(i)
		if !ok || err != nil || n < 0 || n >= len(a.prefixes) || c == "" {
			writeProblem(w, http.StatusBadRequest, "invalid-cursor", "The cursor is not one a page of this listing gave.")
			return req, false
		}
		req.at, req.cursor = n, c
		if c == fromStart {
			req.cursor = ""
		}
	}
	return req, true
}

// appendViews appends to views the records of keys, listed under prefix, that are still there
// and, when route is not "", belong to that route. Its error is the store's.
func (a *recordsAPI) appendViews(ctx context.Context, views []recordView, prefix string, keys []string, route string) ([]recordView, error) {
	for _, key := range keys {
		keyHash, ok := strings.CutPrefix(key, prefix)
		if !ok || !validKeyHash(keyHash) {
			continue // a key of another prefix that begins with this one, or a staged completion
		}
		rec, err := a.store.Lookup(ctx, key)
		switch {
		case errors.Is(err, cache.ErrNotFound):
			continue // it expired or was purged since the listing saw it
		case err != nil && !errors.Is(err, cache.ErrCorrupt):
			return views, err
		case route != "" && (rec == nil || rec.Route != route):
			continue
		}
		views = append(views, viewOf(keyHash, rec))
	}
	return views, nil
}

// authorized compares the bearer token in constant time. The scheme is matched in any case, as
// RFC 9110 section 11.1 says schemes are.
func (a *recordsAPI) authorized(r *http.Request) bool {
	scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	return ok && strings.EqualFold(scheme, "Bearer") &&
		subtle.ConstantTimeCompare([]byte(strings.TrimLeft(token, " ")), a.token) == 1
}

func rfc3339(t time.Time) *string {
	if t.IsZero() {
		return nil
	}
	s := t.UTC().Format(time.RFC3339)
	return &s
}

// writeProblem writes an RFC 9457 problem.
func writeProblem(w http.ResponseWriter, status int, code, detail string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"type": "about:blank", "title": http.StatusText(status), "status": status, "detail": detail, "code": code,
	})
}
