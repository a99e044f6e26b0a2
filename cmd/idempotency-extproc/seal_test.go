package main

import (
	"encoding/base64"
	"strings"
	"testing"

	"github.com/alicebob/miniredis/v2"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
)

// The secret settings reach the stores (SPEC §12): with --record-keys-file the binary writes
// sealed records and replays them byte for byte; with --key-hash-secret-file its record names
// are HMACs, stable under one secret, other than the plain SHA-256 names.
func TestRunSealsRecordsAndKeysTheirNames(t *testing.T) {
	keys := writeNamed(t, "keys", "k1:"+base64.StdEncoding.EncodeToString([]byte(strings.Repeat("K", 32)))+"\n")
	secret := writeNamed(t, "secret", strings.Repeat("S", 32)+"\n")
	const body = `{"account":"DE89370400440532013000","token":"tok_visible"}`

	// storeOnce runs the binary with args, completes one request whose response is body, checks
	// the replay, and returns the record's name and stored bytes.
	storeOnce := func(t *testing.T, args ...string) (name, value string) {
		mr := miniredis.RunT(t)
		_, ready, cancel, done := runOnMiniredis(t, mr, runOptions{}, args...)
		addr := ready["grpc_addr"].(string)
		s := openClaim(t, addr, "k")
		require.NoError(t, s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("201")}, {Key: "set-cookie", RawValue: []byte("session=visible-cookie")}}},
		}}}))
		_, err := s.Recv()
		require.NoError(t, err)
		require.NoError(t, s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: true}}}))
		_, err = s.Recv()
		require.NoError(t, err)
		_ = s.CloseSend()

		dup, err := extprocv3.NewExternalProcessorClient(dial(t, addr)).Process(t.Context())
		require.NoError(t, err)
		require.NoError(t, dup.Send(bodilessPost("k")))
		resp, err := dup.Recv()
		require.NoError(t, err)
		require.Equal(t, body, string(resp.GetImmediateResponse().GetBody()), "replayed byte for byte")
		cancel()
		require.NoError(t, <-done)
		require.Len(t, mr.Keys(), 1)
		name = mr.Keys()[0]
		value, err = mr.Get(name)
		require.NoError(t, err)
		return name, value
	}

	plainName, plain := storeOnce(t)
	require.Contains(t, plain, "tok_visible", "without sealing the body is readable in the store")
	sealedName, sealed := storeOnce(t, "--record-keys-file", keys)
	require.Equal(t, plainName, sealedName, "sealing does not change the record's name")
	for _, secretPart := range []string{"DE89370400440532013000", "tok_visible", "visible-cookie", "set-cookie"} {
		require.NotContains(t, sealed, secretPart, "a sealed record holds no part of the response")
	}
	keyedName, _ := storeOnce(t, "--key-hash-secret-file", secret)
	require.NotEqual(t, plainName, keyedName, "an HMAC name, not the SHA-256 one")
	again, _ := storeOnce(t, "--key-hash-secret-file", secret)
	require.Equal(t, keyedName, again, "stable under one secret")
}
