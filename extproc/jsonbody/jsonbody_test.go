package jsonbody

import (
	"bytes"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParsePointer(t *testing.T) {
	for _, tc := range []struct {
		in     string
		tokens []string
		err    bool
	}{
		{in: "", tokens: nil},
		{in: "/", tokens: []string{""}},
		{in: "/params/arguments/_idempotency_key", tokens: []string{"params", "arguments", "_idempotency_key"}},
		{in: "/a~1b/m~0n", tokens: []string{"a/b", "m~n"}},
		{in: "/~01", tokens: []string{"~1"}},
		{in: "/0", tokens: []string{"0"}},
		{in: "params", err: true},
		{in: "/a~", err: true},
		{in: "/a~2", err: true},
	} {
		p, err := ParsePointer(tc.in)
		if tc.err {
			require.Error(t, err, tc.in)
			continue
		}
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.tokens, p.tokens, tc.in)
		require.Equal(t, tc.in, p.String())
	}
}

func pointers(t testing.TB, ss ...string) []Pointer {
	var ps []Pointer
	for _, s := range ss {
		p, err := ParsePointer(s)
		require.NoError(t, err)
		ps = append(ps, p)
	}
	return ps
}

func TestValues(t *testing.T) {
	body := []byte(`{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge","arguments":{"_idempotency_key":"k-1","amount":9007199254740993,"list":[1,{"x":"y"}]},"_meta":{"idempotencyKey":"m"}}}`)
	got, err := Values(body, pointers(t, "/method", "/params/arguments/_idempotency_key", "/params/arguments/amount",
		"/params/arguments/list/1/x", "/params/missing", "/params/_meta", "/params/_meta/idempotencyKey", "/id", "/method"))
	require.NoError(t, err)
	want := []string{`"tools/call"`, `"k-1"`, `9007199254740993`, `"y"`, "", `{"idempotencyKey":"m"}`, `"m"`, `7`, `"tools/call"`}
	for i, w := range want {
		if w == "" {
			require.Nil(t, got[i], i)
			continue
		}
		require.Equal(t, w, string(got[i]), i)
	}
	s, ok := String(got[1])
	require.True(t, ok)
	require.Equal(t, "k-1", s)
	_, ok = String(got[2])
	require.False(t, ok, "a number is not a string")

	// Whitespace around a value is not part of it.
	got, err = Values([]byte("{ \"a\" :\n [ 1 , 2 ] , \"b\" : { \"c\" : true } }"), pointers(t, "/a", "/a/1", "/b"))
	require.NoError(t, err)
	require.Equal(t, "[1,2]", string(got[0]))
	require.Equal(t, "2", string(got[1]))
	require.Equal(t, `{"c":true}`, string(got[2]))

	// Equal values read alike however they were written; a string and a number never do.
	got, err = Values([]byte(`{"a":"\u0061","b":1.0,"c":{"y" : 1, "x":2},"d":"1","e":9007199254740993}`), pointers(t, "/a", "/b", "/c", "/d", "/e"))
	require.NoError(t, err)
	require.Equal(t, []string{`"a"`, `1`, `{"x":2,"y":1}`, `"1"`, `9007199254740993`},
		[]string{string(got[0]), string(got[1]), string(got[2]), string(got[3]), string(got[4])})
}

func TestValuesRefuses(t *testing.T) {
	for name, tc := range map[string]struct {
		body string
		err  error
	}{
		"not JSON":          {`{"a":`, ErrNotJSON},
		"two values":        {`{} {}`, ErrNotJSON},
		"trailing bracket":  {`{"a":1}]`, ErrNotJSON},
		"trailing word":     {`{"a":1} x`, ErrNotJSON},
		"trailing brace":    {`{"a":1}}`, ErrNotJSON},
		"duplicate names":   {`{"key":"a","key":"b"}`, ErrNotJSON},
		"empty":             {``, ErrNotJSON},
		"deep":              {strings.Repeat("[", 65) + strings.Repeat("]", 65), ErrTooDeep},
		"10,000 deep":       {strings.Repeat("[", 10000), ErrTooDeep},
		"deep objects":      {strings.Repeat(`{"a":`, 65) + "1" + strings.Repeat("}", 65), ErrTooDeep},
		"deep, not pointed": {`{"k":"v","x":` + strings.Repeat("[", 100) + strings.Repeat("]", 100) + `}`, ErrTooDeep},
	} {
		_, err := Values([]byte(tc.body), pointers(t, "/key", "/k"))
		require.ErrorIs(t, err, tc.err, name)
		_, err = Canonical(nil, []byte(tc.body), nil)
		require.ErrorIs(t, err, tc.err, name)
	}
	// 64 levels are allowed.
	_, err := Values([]byte(strings.Repeat("[", 64)+strings.Repeat("]", 64)), nil)
	require.NoError(t, err)
}

// Lookup reads the pointed members of a body that nests too deep elsewhere, and still refuses
// what is not JSON, or a pointed member too deep to read.
func TestLookupPastDeepMembers(t *testing.T) {
	deep := strings.Repeat("[", 100) + strings.Repeat("]", 100)
	ptrs := pointers(t, "/method", "/params/name", "/id")
	values, err := Lookup([]byte(`{"params":{"x":`+deep+`,"name":"send"},"method":"tools/call","id":7}`), ptrs)
	require.NoError(t, err)
	require.Equal(t, []string{`"tools/call"`, `"send"`, `7`}, []string{string(values[0]), string(values[1]), string(values[2])})
	_, err = Values([]byte(`{"method":"tools/call","x":`+deep+`}`), ptrs)
	require.ErrorIs(t, err, ErrTooDeep, "Values keeps its limit")

	for name, body := range map[string]string{
		"not JSON":           `{"method":"tools/call","x":` + deep,
		"duplicate names":    `{"method":"a","method":"b"}`,
		"pointed, too deep":  `{"method":` + deep + `}`,
		"beyond the decoder": `{"x":` + strings.Repeat("[", 20000) + strings.Repeat("]", 20000) + `}`,
	} {
		_, err := Lookup([]byte(body), ptrs)
		require.Error(t, err, name)
	}
}

func TestCanonical(t *testing.T) {
	for _, tc := range []struct {
		in, ignore, want string
	}{
		{in: `{"b":1,"a":[true,null,"x"]}`, want: `{"a":[true,null,"x"],"b":1}`},
		{in: " { \"b\" : 1 ,\n \"a\" : 2 } ", want: `{"a":2,"b":1}`},
		// RFC 8785's number forms where they keep the value.
		{in: `[1.0,1e2,-0,1.50,0.000001,1e-7,1e21,123456789012345678]`, want: `[1,100,0,1.5,0.000001,1e-7,1e+21,123456789012345678]`},
		// The written value where the double would change it.
		{in: `[9007199254740993,9007199254740992,12345678901234567891,1.2345678901234567891e19,0.1000000000000000000001,1e400]`,
			want: `[9007199254740993,9007199254740992,12345678901234567891,12345678901234567891,1.000000000000000000001e-1,1e400]`},
		// Zero is zero whatever its exponent.
		{in: `[0e9999999999,-0.0e-5,0]`, want: `[0,0,0]`},
		// Strings in their shortest escaping; member names ordered by UTF-16 code units.
		{in: `{"\u0061":"\u00e9\/\u001f","\ud83d\ude00":1,"\ufb33":2}`, want: "{\"a\":\"é/\\u001f\",\"\U0001F600\":1,\"\uFB33\":2}"},
		// Ignored members, at any depth.
		{in: `{"jsonrpc":"2.0","id":7,"params":{"_meta":{"k":1},"name":"x"}}`, ignore: "/id,/params/_meta", want: `{"jsonrpc":"2.0","params":{"name":"x"}}`},
		{in: `{"a":[{"b":1,"c":2}]}`, ignore: "/a/0/c", want: `{"a":[{"b":1}]}`},
	} {
		var ig []Pointer
		if tc.ignore != "" {
			ig = pointers(t, strings.Split(tc.ignore, ",")...)
		}
		got, err := Canonical(nil, []byte(tc.in), ig)
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want, string(got), tc.in)
	}
}

// TestCanonicalExact: bodies that differ only in an integer beyond 2^53 have different
// canonical forms (a fingerprint tells them apart), while member order and whitespace do not
// count.
func TestCanonicalExact(t *testing.T) {
	a, err := Canonical(nil, []byte(`{"amount":9007199254740993,"to":"x"}`), nil)
	require.NoError(t, err)
	b, err := Canonical(nil, []byte(`{"to":"x", "amount":9007199254740992}`), nil)
	require.NoError(t, err)
	require.NotEqual(t, string(a), string(b))
	c, err := Canonical(nil, []byte("{\"to\" : \"x\",\n\"amount\" : 9007199254740993}"), nil)
	require.NoError(t, err)
	require.Equal(t, string(a), string(c))
}

func TestReplaceID(t *testing.T) {
	deep := strings.Repeat("[", 100) + strings.Repeat("]", 100)
	for _, tc := range []struct{ in, id, want string }{
		{`{"jsonrpc":"2.0","id":1,"result":{"id":5}}`, `"abc"`, `{"jsonrpc":"2.0","id":"abc","result":{"id":5}}`},
		{`{"result":{"id":5},"jsonrpc":"2.0", "id" : "x-1" }`, `42`, `{"result":{"id":5},"jsonrpc":"2.0", "id" : 42 }`},
		{`{"jsonrpc":"2.0","id":null,"error":{}}`, `9007199254740993`, `{"jsonrpc":"2.0","id":9007199254740993,"error":{}}`},
		// A stored response may nest deeper than a request body may.
		{`{"jsonrpc":"2.0","result":` + deep + `,"id":1}`, `2`, `{"jsonrpc":"2.0","result":` + deep + `,"id":2}`},
	} {
		got, rw := ReplaceID([]byte(tc.in), []byte(tc.id))
		require.Equal(t, IDReplaced, rw, tc.in)
		require.Equal(t, tc.want, string(got))
	}
	for _, tc := range []struct {
		in string
		rw Rewrite
	}{
		{`{"jsonrpc":"2.0","result":1}`, IDKept},
		{`{"id":"order-77","status":"sent"}`, IDKept},
		{`{"jsonrpc":"2.0","id":1,"method":"ping"}`, IDKept},
		{`{"result":{},"id":1}`, IDKept},
		{`[{"id":1}]`, IDKept},
		{`not json`, IDKept},
		{``, IDKept},
		{`{"jsonrpc":"2.0","id":1,"result":`, IDUnreplaceable},
		{`{"jsonrpc":"2.0","id":1,"id":1,"result":{}}`, IDUnreplaceable},
		{`{"jsonrpc":"2.0","id":1,"result":{}} {}`, IDUnreplaceable},
		{`{"jsonrpc":"2.0","id":1,"result":` + strings.Repeat("[", 20000) + strings.Repeat("]", 20000) + `}`, IDUnreplaceable},
	} {
		got, rw := ReplaceID([]byte(tc.in), []byte(`7`))
		require.Equal(t, tc.rw, rw, tc.in)
		require.Equal(t, tc.in, string(got))
	}
	// A request without an id has none to give: the message is left as it is.
	in := `{"jsonrpc":"2.0","id":1,"result":{}}`
	got, rw := ReplaceID([]byte(in), nil)
	require.Equal(t, IDKept, rw)
	require.Equal(t, in, string(got))
}

func TestID(t *testing.T) {
	for in, want := range map[string]string{
		`{"jsonrpc":"2.0","id":1.0,"method":"m"}`: `1.0`,
		`{"id" :  "\u0031" , "method":"m"}`:       `"\u0031"`,
		`{"params":{"id":2},"id":-0}`:             `-0`,
		`{"id":12345678901234567890123}`:          `12345678901234567890123`,
		`{"method":"m","params":{"id":2}}`:        ``,
		`[{"id":1}]`:                              ``,
		`{"id":1,"id":2}`:                         ``,
		`{"id":1`:                                 ``,
	} {
		require.Equal(t, want, string(ID([]byte(in))), in)
	}
}

func TestReplaceEventIDs(t *testing.T) {
	replace := func(body, id string) string {
		t.Helper()
		out, ok := ReplaceEventIDs([]byte(body), []byte(id))
		require.True(t, ok, body)
		return string(out)
	}
	body := "event: message\r\n" +
		"data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"id\":1}}\r\n\r\n" +
		"id: 17\n" +
		"event: message\n" +
		"data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"content\":[]}}\n\n"
	want := strings.Replace(body, `"id":1,"result"`, `"id":"second","result"`, 1)
	require.Equal(t, want, replace(body, `"second"`))
	plain := "data: hello\n\n"
	require.Equal(t, plain, replace(plain, `1`))

	// One message over several data lines, lines ending in CR alone.
	multi := "event: message\rdata: {\"jsonrpc\":\"2.0\",\rdata: \"id\":1,\rdata:\"result\":{}}\r\rdata: {\"jsonrpc\":\"2.0\",\"id\":2,\"error\":{}}"
	want = strings.Replace(strings.Replace(multi, `"id":1`, `"id":"x"`, 1), `"id":2`, `"id":"x"`, 1)
	require.Equal(t, want, replace(multi, `"x"`))

	// A result deeper than a request body may nest.
	deep := "data: {\"jsonrpc\":\"2.0\",\"result\":" + strings.Repeat("[", 70) + strings.Repeat("]", 70) + ",\"id\":1}\n\n"
	require.Equal(t, strings.Replace(deep, `"id":1`, `"id":2`, 1), replace(deep, `2`))

	// An id after a line break is replaced on its own line; one split over data lines cannot
	// be replaced in place, and the body is refused whole.
	broken := "data: {\"jsonrpc\":\"2.0\",\"id\"\ndata: :\ndata: 1,\"result\":{}}\n\n"
	require.Equal(t, strings.Replace(broken, "data: 1,", "data: 2,", 1), replace(broken, `2`))
	split := "data: {\"jsonrpc\":\"2.0\",\"id\":[1,\ndata: 2],\"result\":{}}\n\n"
	out, ok := ReplaceEventIDs([]byte(split), []byte(`2`))
	require.False(t, ok)
	require.Equal(t, split, string(out))
}

func FuzzParsePointer(f *testing.F) {
	for _, s := range []string{"", "/", "/a~1b/m~0n", "/a~", "/~01", "x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParsePointer(s)
		if err != nil {
			return
		}
		// Writing the tokens back with their escapes gives the text parsed.
		var b strings.Builder
		for _, tok := range p.tokens {
			b.WriteByte('/')
			b.WriteString(strings.ReplaceAll(strings.ReplaceAll(tok, "~", "~0"), "/", "~1"))
		}
		if b.String() != s {
			t.Fatalf("%q parsed as %q", s, p.tokens)
		}
	})
}

func FuzzCanonical(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":[true,null,"x"]}`, `[1.0,1e2,-0,9007199254740993]`, `{"id":1,"params":{"_meta":{}}}`, `"\ud83d"`, `[[[[`,
		`{"params":{"a":[1,2,3,{"x":[4,5]}],"name":"n","_meta":{"idempotencyKey":"k"}},"id":[1]}`, `{"\ufb33":1,"\ud83d\ude00":2,"a\u0000":3,"a":{"z":[],"y":{},"id":4}}`, `{"params":{"b":1,"_meta":2,"a":[{"d":1,"c":2}]},"id":1}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		ignore := pointers(t, "/id", "/params/_meta")
		c, err := Canonical(nil, body, ignore)
		// One pass writes what the two passes the package first took wrote (jsontext's own
		// RFC 8785 ordering), and refuses what they refused.
		want, wantErr := canonicalTwoPass(nil, body, ignore)
		if !errors.Is(err, wantErr) || !bytes.Equal(c, want) {
			t.Fatalf("canonical form of %q: %q (%v), the two-pass form %q (%v)", body, c, err, want, wantErr)
		}
		// In one pass with values: the same form, and the values Values reads, ignored or not.
		// Values below ignored members and beside them (one pass), and values that hold ignored
		// members (read whole, in a pass of their own).
		ignore = pointers(t, "/id", "/params/_meta", "/params/a/0", "/params/a/2")
		for _, ptrs := range [][]Pointer{
			pointers(t, "/id", "/params/_meta/idempotencyKey", "/params/name", "/params/a/0", "/params/_meta", "/params/a/3/x"),
			pointers(t, "/params/name", "", "/params"),
		} {
			c, values, err := CanonicalValues(nil, body, ignore, ptrs)
			want, wantErr := canonicalTwoPass(nil, body, ignore)
			wantValues, valuesErr := Values(body, ptrs)
			if !errors.Is(err, wantErr) || !errors.Is(err, valuesErr) || !bytes.Equal(c, want) || !slices.EqualFunc(values, wantValues, bytes.Equal) {
				t.Fatalf("one pass over %q: %q %q (%v); two passes: %q %q (%v, %v)", body, c, values, err, want, wantValues, wantErr, valuesErr)
			}
		}
		if err != nil {
			return
		}
		// The canonical form is JSON, and its own canonical form.
		if !json.Valid(c) {
			t.Fatalf("canonical form of %q is not JSON: %q", body, c)
		}
		again, err := Canonical(nil, c, nil)
		if err != nil || !bytes.Equal(again, c) {
			t.Fatalf("canonical form of %q is not stable: %q then %q (%v)", body, c, again, err)
		}
	})
}

func FuzzReplaceID(f *testing.F) {
	for _, s := range []string{`{"jsonrpc":"2.0","id":1,"result":{}}`, `{"id" : "x" }`, `{"a":[{"id":1}]}`, `{`} {
		f.Add([]byte(s), []byte(`"new"`))
	}
	f.Add([]byte(`{"id":1}`), []byte(nil))
	f.Fuzz(func(t *testing.T, msg, id []byte) {
		// An id is what Values read from a request: JSON by this package's own reading (which
		// refuses invalid UTF-8, where encoding/json's Valid does not).
		if _, err := Values(id, nil); err != nil {
			if _, rw := ReplaceID(msg, id); rw == IDReplaced && len(bytes.TrimSpace(id)) == 0 {
				t.Fatalf("an empty id replaced %q's", msg)
			}
			return
		}
		out, rw := ReplaceID(msg, id)
		if rw != IDReplaced {
			if !bytes.Equal(out, msg) {
				t.Fatalf("unchanged message changed: %q -> %q", msg, out)
			}
			return
		}
		v, err := Values(out, pointers(t, "/id"))
		// A message this package reads as JSON (strict UTF-8, unlike encoding/json's Valid)
		// keeps being JSON, with the new id.
		if _, merr := Values(msg, nil); merr == nil && (err != nil || v[0] == nil) {
			t.Fatalf("%q with id %q gave %q (%v)", msg, id, out, err)
		}
		// Values reads values in their canonical form: the id's is what it must read back.
		want, cerr := Canonical(nil, id, nil)
		if err == nil && v[0] != nil && (cerr != nil || !bytes.Equal(v[0], want)) {
			t.Fatalf("%q with id %q gave id %q", msg, id, v[0])
		}
	})
}
