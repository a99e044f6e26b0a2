package main

import (
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
)

// The secret settings reach the stores: with --record-keys-file the binary writes
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

// A record this replica cannot open (sealed under a key it does not hold) is never run again:
// a duplicate gets 409 response-not-replayable, whatever fail_mode says, with an
// error log that names no secret; the records API shows it as unreadable and purges it, after
// which the retry runs.
func TestUnreadableRecordIsNotRunAgain(t *testing.T) {
	keyA := "a:" + base64.StdEncoding.EncodeToString([]byte(strings.Repeat("A", 32)))
	keyB := "b:" + base64.StdEncoding.EncodeToString([]byte(strings.Repeat("B", 32)))
	const token = "adm-unreadable-token"
	tokenFile := writeNamed(t, "token", token+"\n")
	mr := miniredis.RunT(t)

	// Completed under key a.
	_, ready, cancel, done := runOnMiniredis(t, mr, runOptions{}, "--record-keys-file", writeNamed(t, "keys-a", keyA+"\n"))
	s := openClaim(t, ready["grpc_addr"].(string), "k")
	require.NoError(t, s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("201")}}},
	}}}))
	_, err := s.Recv()
	require.NoError(t, err)
	require.NoError(t, s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("paid"), EndOfStream: true}}}))
	_, err = s.Recv()
	require.NoError(t, err)
	cancel()
	require.NoError(t, <-done)

	// A replica that holds only key b, failing open.
	policyFile := writeFile(t, "fail_mode: open\n")
	logs, ready, cancel, done := runOnMiniredis(t, mr, runOptions{drainTimeout: 200 * time.Millisecond}, "--record-keys-file", writeNamed(t, "keys-b", keyB+"\n"),
		"--config", policyFile, "--admin-token-file", tokenFile)
	defer func() { cancel(); require.NoError(t, <-done) }()
	addr, adminURL := ready["grpc_addr"].(string), "http://"+ready["admin_addr"].(string)
	dup, err := extprocv3.NewExternalProcessorClient(dial(t, addr)).Process(t.Context())
	require.NoError(t, err)
	require.NoError(t, dup.Send(bodilessPost("k")))
	resp, err := dup.Recv()
	require.NoError(t, err)
	imm := resp.GetImmediateResponse()
	require.NotNil(t, imm, "answered, not sent upstream")
	require.Equal(t, 409, int(imm.GetStatus().GetCode()))
	require.Contains(t, string(imm.GetBody()), `"code":"response-not-replayable"`)
	line := logs.wait(t, "stored record cannot be read; answering response-not-replayable", 5*time.Second)
	require.Equal(t, "error", line["level"])
	require.NotContains(t, logs.String(), strings.Repeat("B", 32))
	require.NotContains(t, logs.String(), base64.StdEncoding.EncodeToString([]byte(strings.Repeat("B", 32))))

	hash := keyHashOf(t, policyFile, "/v1/payments", "k")
	out, err := recordsCall(t, adminURL, tokenFile, "get", hash)
	require.NoError(t, err)
	require.Contains(t, out, `"state": "unreadable"`)
	out, err = recordsCall(t, adminURL, tokenFile, "purge", hash)
	require.NoError(t, err)
	require.Equal(t, "purged "+hash+"\n", out)
	openClaim(t, addr, "k") // the retry runs
	m := scrape(t, adminURL+"/metrics")
	require.Contains(t, m, `idempotency_admin_requests_total{op="get",result="unreadable"} 1`)
	require.Contains(t, m, `idempotency_unreadable_records_total{route="default"} 1`)
	require.Contains(t, m, "\nidempotency_fail_open 1\n", "the gauge IdempotencyFailOpenTraffic joins on")
}
