package cache

import (
	"fmt"
	"strconv"
	"time"

	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
)

// Each record is one Redis string under its key, so that every operation touches one key (no
// hash tags under Cluster; a large completion's staging key, which lives for one round trip, is
// put in the record's slot), a claim is one native command, and the server stores one value.
// This version writes layout 3 and reads layouts 2 and 3:
//
//	offset  bytes  field
//	0       1      layout version: '3' (recordLayout) or '2'
//	1       1      state: 'p' pending or 'c' completed
//	2       26     owner token (kept after completion so that a retried Complete succeeds)
//	28      13     lifetime of the completed record in milliseconds, decimal, zero-padded
//	layout 3 only:
//	41      13     created at: when the key was claimed, Unix milliseconds, decimal, zero-padded
//	54      13     expires at: the end of the lease while pending (rewritten by Renew), the end
//	               of the TTL once completed, Unix milliseconds, decimal, zero-padded
//	both, at the header's end (41 in layout 2, 67 in layout 3):
//	+0      8      fingerprint length, hexadecimal
//	+8      n      fingerprint
//	layout 3 only:
//	+8+n    2      route name length, hexadecimal (at most MaxRouteBytes)
//	+10+n   r      route name (Claim.Route)
//	then           encoded response (completed only)
//
// The key's own expiry is the lease while pending and the TTL once completed; the stored expiry
// is the same instant on the writer's clock, so that Acquire, one SET NX GET, returns it without
// a second command. The first 28 bytes, all that the owner checks read, are the same in both
// layouts. The scripts read the offsets built from these constants.
const (
	recordLayout  = '3'
	layout2       = '2'
	tokenLen      = 26
	ttlDigits     = 13 // any time.Duration in milliseconds
	timeDigits    = 13 // Unix milliseconds until the year 2286
	fpLenDigits   = 8
	ownerLen      = 2 + tokenLen
	ttlOffset     = ownerLen
	createdOffset = ttlOffset + ttlDigits
	expiresOffset = createdOffset + timeDigits
	headerLen     = expiresOffset + timeDigits + fpLenDigits // layout 3
	header2Len    = ttlOffset + ttlDigits + fpLenDigits      // layout 2
)

// appendPending appends the pending record of claim c owned by token, claimed at now, to b.
func appendPending(b []byte, token string, c Claim, now time.Time) []byte {
	return appendRecord(b, 'p', token, c.TTL, now, now.Add(c.LockTTL), c.Fingerprint, c.Route)
}

// appendCompleted appends the record l completes with resp, expiring at expires, to b: the
// whole record, built from what the lease carries, so that Redis need not splice it together.
// With a keyring the response is sealed, bound to the record's key (see sealed.go).
func appendCompleted(b []byte, l Lease, expires time.Time, resp Response, ring *seal.Keyring) []byte {
	b = appendRecord(b, 'c', l.token, l.claim.TTL, l.created, expires, l.claim.Fingerprint, l.claim.Route)
	return appendStoredResponse(b, resp, ring, sealedAAD(ring, l.key))
}

// completedSize returns len(appendCompleted(nil, l, _, resp, ring)) without encoding.
func completedSize(l Lease, resp Response, ring *seal.Keyring) int {
	return headerLen + len(l.claim.Fingerprint) + routeLenDigits + len(l.claim.Route) + storedResponseSize(resp, ring)
}

func appendRecord(b []byte, state byte, token string, ttl time.Duration, created, expires time.Time, fp []byte, route string) []byte {
	b = append(b, recordLayout, state)
	b = append(b, token...)
	b = appendPadded(b, uint64(ttl.Milliseconds()), 10, ttlDigits)
	b = appendMillis(b, created)
	b = appendMillis(b, expires)
	b = appendPadded(b, uint64(len(fp)), 16, fpLenDigits)
	b = append(b, fp...)
	b = appendPadded(b, uint64(len(route)), 16, routeLenDigits)
	return append(b, route...)
}

// routeLenDigits is the width of a layout 3 record's route name length.
const routeLenDigits = 2

// routeOf cuts a route name to MaxRouteBytes.
func routeOf(route string) string { return route[:min(len(route), MaxRouteBytes)] }

// appendMillis appends t as Unix milliseconds in timeDigits digits; the zero time, or one
// before 1970, is 0.
func appendMillis(b []byte, t time.Time) []byte {
	return appendPadded(b, uint64(max(t.UnixMilli(), 0)), 10, timeDigits)
}

// appendPadded appends n in base, left-padded with zeros to width digits.
func appendPadded(b []byte, n uint64, base, width int) []byte {
	var digits [20]byte
	d := strconv.AppendUint(digits[:0], n, base)
	for range width - len(d) {
		b = append(b, '0')
	}
	return append(b, d...)
}

// decodeRecord decodes a record of either layout and returns it with its owner token. A layout 2
// record has neither CreatedAt nor ExpiresAt.
//
// The response is opened with ring, bound to key.
func decodeRecord(v string, ring *seal.Keyring, key string) (*Record, string, error) {
	if len(v) < 2 {
		return nil, "", fmt.Errorf("%w: a record of %d bytes", ErrCorrupt, len(v))
	}
	rec := &Record{}
	hdr := headerLen
	switch v[0] {
	case recordLayout:
	case layout2:
		hdr = header2Len
	default:
		return nil, "", fmt.Errorf("%w: record layout %q is not supported by this version", ErrCorrupt, v[0])
	}
	if len(v) < hdr {
		return nil, "", fmt.Errorf("%w: a record of %d bytes", ErrCorrupt, len(v))
	}
	if v[0] == recordLayout {
		created, err1 := parseMillis(v[createdOffset : createdOffset+timeDigits])
		expires, err2 := parseMillis(v[expiresOffset : expiresOffset+timeDigits])
		if err1 != nil || err2 != nil {
			return nil, "", fmt.Errorf("%w: record times %q", ErrCorrupt, v[createdOffset:expiresOffset+timeDigits])
		}
		rec.CreatedAt, rec.ExpiresAt = created, expires
	}
	token := v[2:ownerLen]
	n, err := strconv.ParseUint(v[hdr-fpLenDigits:hdr], 16, 32)
	if err != nil || n > uint64(len(v)-hdr) {
		return nil, "", fmt.Errorf("%w: record fingerprint length %q", ErrCorrupt, v[hdr-fpLenDigits:hdr])
	}
	// One copy of the fingerprint and the response, each capped at its own end.
	b := []byte(v[hdr:])
	if n > 0 {
		rec.Fingerprint = b[:n:n]
	}
	b = b[n:]
	if v[0] == recordLayout {
		if rec.Route, b, err = cutRoute(b); err != nil {
			return nil, "", err
		}
	}
	switch v[1] {
	case 'p':
		rec.State = Pending
	case 'c':
		rec.State = Completed
		resp, err := decodeStoredResponse(b, ring, key)
		if err != nil {
			return nil, "", err
		}
		rec.Response = resp
	default:
		return nil, "", fmt.Errorf("%w: record state %q", ErrCorrupt, v[1])
	}
	return rec, token, nil
}

// cutRoute returns the route name at the start of b, a layout 3 record's after its fingerprint,
// and the bytes after it.
func cutRoute(b []byte) (string, []byte, error) {
	if len(b) < routeLenDigits {
		return "", nil, fmt.Errorf("%w: record without its route", ErrCorrupt)
	}
	r, err := strconv.ParseUint(string(b[:routeLenDigits]), 16, 16)
	if err != nil || r > uint64(len(b)-routeLenDigits) {
		return "", nil, fmt.Errorf("%w: record route length %q", ErrCorrupt, b[:routeLenDigits])
	}
	return string(b[routeLenDigits : routeLenDigits+r]), b[routeLenDigits+r:], nil
}

// parseMillis parses what appendMillis wrote; 0 is the zero time.
func parseMillis(s string) (time.Time, error) {
	ms, err := strconv.ParseInt(s, 10, 64)
	if err != nil || ms < 0 {
		return time.Time{}, fmt.Errorf("%w: time %q", ErrCorrupt, s)
	}
	if ms == 0 {
		return time.Time{}, nil
	}
	return time.UnixMilli(ms), nil
}
