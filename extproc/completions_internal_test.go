package extproc

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
)

// TestOwnHeaders: a pending completion's headers are copies: the message they were decoded from
// can change or go, and they keep their names, values and nil values.
func TestOwnHeaders(t *testing.T) {
	msg := []byte("content-typeapplication/jsonx-emptyx-nil")
	// The names share the message's memory too, so that clearing it shows a name not copied.
	str := unsafe.String(&msg[0], len(msg))
	hs := []cache.Header{
		{Name: str[0:12], Value: msg[12:28]},
		{Name: str[28:35], Value: msg[35:35]},
		{Name: str[35:40]},
	}
	own := ownHeaders(hs)
	clear(msg)
	require.Equal(t, []cache.Header{
		{Name: "content-type", Value: []byte("application/json")},
		{Name: "x-empty", Value: []byte{}},
		{Name: "x-nil"},
	}, own)
	require.Nil(t, own[2].Value)
	require.Equal(t, len(own[0].Value), cap(own[0].Value), "an append reallocates")
	require.Nil(t, ownHeaders(nil))
}
