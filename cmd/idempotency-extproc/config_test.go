package main

import (
	"encoding/base64"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "policy.yaml")
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

func env(kv map[string]string) func(string) string {
	return func(k string) string { return kv[k] }
}

func TestConfigDefaults(t *testing.T) {
	c, err := loadConfig(nil, env(nil))
	require.NoError(t, err)
	require.Equal(t, ":9002", c.grpcAddr)
	require.Equal(t, ":9003", c.adminAddr)
	require.Equal(t, "memory", c.store)
	require.Equal(t, "redis://localhost:6379/0", c.redisURL)
	require.Empty(t, c.redisClusterAddrs)
	require.Empty(t, c.redisSentinelAddrs)
	require.Equal(t, "mymaster", c.redisSentinelMaster)
	require.Equal(t, int64(268435456), c.memoryMaxBytes)
	require.Equal(t, 10000, c.maxStreams)
	require.Equal(t, zerolog.InfoLevel, c.logLevel)
	require.Equal(t, "json", c.logFormat)
	require.Equal(t, policy.Default().Default, c.policy.Default)
	require.Empty(t, c.configPath)
	require.Nil(t, c.adminToken)
	require.Nil(t, c.recordKeys)
	require.Nil(t, c.keyHashSecret)
}

func TestConfigPrecedence(t *testing.T) {
	file := writeFile(t, `
store: redis
redis_url: redis://file:6379/0
log_level: warn
log_format: console
redis_cluster_addrs: [f1:7000, f2:7000]
store_timeout: 250ms
`)
	cases := []struct {
		name string
		args []string
		env  map[string]string
		want func(t *testing.T, c *config)
	}{
		{"file beats defaults", []string{"--config", file}, nil, func(t *testing.T, c *config) {
			require.Equal(t, "redis", c.store)
			require.Equal(t, "redis://file:6379/0", c.redisURL)
			require.Equal(t, zerolog.WarnLevel, c.logLevel)
			require.Equal(t, []string{"f1:7000", "f2:7000"}, c.redisClusterAddrs)
			require.Equal(t, 250*time.Millisecond, c.policy.StoreTimeout)
			require.Equal(t, ":9002", c.grpcAddr, "unset in the file: the default")
		}},
		{"env beats the file", []string{"--config", file}, map[string]string{
			"IDEMPOTENCY_REDIS_URL": "redis://env:6379/0", "IDEMPOTENCY_LOG_LEVEL": "debug",
		}, func(t *testing.T, c *config) {
			require.Equal(t, "redis://env:6379/0", c.redisURL)
			require.Equal(t, zerolog.DebugLevel, c.logLevel)
			require.Equal(t, "console", c.logFormat)
		}},
		{"flags beat env", []string{"--config", file, "--redis-url", "redis://flag:6379/0", "--log-format=json"}, map[string]string{
			"IDEMPOTENCY_REDIS_URL": "redis://env:6379/0", "IDEMPOTENCY_LOG_FORMAT": "console",
		}, func(t *testing.T, c *config) {
			require.Equal(t, "redis://flag:6379/0", c.redisURL)
			require.Equal(t, "json", c.logFormat)
		}},
		{"the file path from env", nil, map[string]string{"IDEMPOTENCY_CONFIG": file}, func(t *testing.T, c *config) {
			require.Equal(t, "redis", c.store)
		}},
		{"the file path flag beats env", []string{"--config", file}, map[string]string{"IDEMPOTENCY_CONFIG": "/nonexistent"}, func(t *testing.T, c *config) {
			require.Equal(t, "redis", c.store)
		}},
		{"lists from env and flags", []string{"--redis-sentinel-addrs", " s1:26379, s2:26379 ,"}, map[string]string{
			"IDEMPOTENCY_REDIS_SENTINEL_MASTER": "payments",
		}, func(t *testing.T, c *config) {
			require.Equal(t, []string{"s1:26379", "s2:26379"}, c.redisSentinelAddrs)
			require.Equal(t, "payments", c.redisSentinelMaster)
		}},
		{"unix socket", []string{"--grpc-addr", "unix:///tmp/x.sock", "--memory-max-bytes", "1024"}, nil, func(t *testing.T, c *config) {
			require.Equal(t, "unix:///tmp/x.sock", c.grpcAddr)
			require.Equal(t, int64(1024), c.memoryMaxBytes)
		}},
		{"max streams from env", nil, map[string]string{"IDEMPOTENCY_MAX_STREAMS": "250"}, func(t *testing.T, c *config) {
			require.Equal(t, 250, c.maxStreams)
		}},
		{"an empty variable counts as unset", []string{"--config", file}, map[string]string{"IDEMPOTENCY_STORE": "", "IDEMPOTENCY_LOG_LEVEL": ""}, func(t *testing.T, c *config) {
			require.Equal(t, "redis", c.store, "from the file")
			require.Equal(t, zerolog.WarnLevel, c.logLevel)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := loadConfig(tc.args, env(tc.env))
			require.NoError(t, err)
			tc.want(t, c)
		})
	}
}

// The Redis settings are checked only when the Redis store is chosen.
func TestConfigIgnoresRedisSettingsForMemory(t *testing.T) {
	c, err := loadConfig([]string{"--redis-url", "not a url"}, env(nil))
	require.NoError(t, err)
	require.Equal(t, "memory", c.store)
}

func TestConfigInvalid(t *testing.T) {
	cases := []struct {
		name string
		args []string
		env  map[string]string
		file string
		want []string
	}{
		{"bad flag values", []string{"--store", "mongo", "--log-level", "loud", "--memory-max-bytes", "0"}, nil, "",
			[]string{`store (flag --store): must be memory or redis, got "mongo"`, "log-level (flag --log-level)", "memory-max-bytes (flag --memory-max-bytes)"}},
		{"bad stream limits", []string{"--max-streams", "0"}, map[string]string{"IDEMPOTENCY_MAX_STREAMS": "many"}, "",
			[]string{`max-streams (flag --max-streams): must be a positive number of streams, got "0"`}},
		{"a negative stream limit", nil, map[string]string{"IDEMPOTENCY_MAX_STREAMS": "-5"}, "",
			[]string{`max-streams (environment variable IDEMPOTENCY_MAX_STREAMS): must be a positive number of streams, got "-5"`}},
		{"bad env value", nil, map[string]string{"IDEMPOTENCY_LOG_FORMAT": "xml"}, "",
			[]string{`log-format (environment variable IDEMPOTENCY_LOG_FORMAT): must be json or console, got "xml"`}},
		{"bad file setting and policy together", nil, nil, "store: disk\ndefaults: {ttl: soon}\nroutes: [{name: a, match: {path_regex: '('}}]\n",
			[]string{"store (config file key store)", "defaults.ttl", "routes[0] (a).match.path_regex"}},
		{"unknown file field", nil, nil, "grpc_address: :1\n", []string{"policy: grpc_address: unknown field (line 1)"}},
		{"a misspelt file setting", nil, nil, "redis_ulr: redis://x\n", []string{"policy: redis_ulr: unknown field (did you mean redis_url?)"}},
		{"a list for a single setting", nil, nil, "grpc_addr: [a, b]\nredis_sentinel_addrs: {a: 1}\n",
			[]string{"policy: grpc_addr: must be a string, got a list (line 1)", "policy: redis_sentinel_addrs: must be a string, got a mapping (line 2)"}},
		{"a setting without a value in the file", nil, nil, "store:\n", []string{"policy: store: has no value"}},
		{"the file cannot name itself", nil, nil, "config: other.yaml\n", []string{"policy: config: unknown field"}},
		{"cluster and sentinel", []string{"--redis-cluster-addrs", "a:1"}, map[string]string{"IDEMPOTENCY_REDIS_SENTINEL_ADDRS": "b:2"}, "",
			[]string{"redis-cluster-addrs (flag --redis-cluster-addrs) and redis-sentinel-addrs (environment variable IDEMPOTENCY_REDIS_SENTINEL_ADDRS): choose Cluster or Sentinel, not both"}},
		{"bad addresses and redis url at once", []string{"--grpc-addr", "nonsense", "--admin-addr", "host:port", "--store", "redis", "--log-level", "nope"},
			map[string]string{"IDEMPOTENCY_REDIS_URL": "redis://user:s3cret#pw@host:6379/0"}, "",
			[]string{`grpc-addr (flag --grpc-addr): must be host:port or unix:///path, got "nonsense"`, `admin-addr (flag --admin-addr)`,
				"log-level (flag --log-level)", "redis-url (environment variable IDEMPOTENCY_REDIS_URL): cache: redis url: not a valid URL"}},
		{"cluster database", []string{"--store", "redis", "--redis-cluster-addrs", "a:1", "--redis-url", "redis://h:6379/2"}, nil, "",
			[]string{"redis-url (flag --redis-url)", "database 0"}},
		{"empty unix socket path", []string{"--grpc-addr", "unix://"}, nil, "", []string{"grpc-addr (flag --grpc-addr): must be host:port or unix:///path, got an empty path"}},
		{"unknown flag", []string{"--colour"}, nil, "", []string{"flag provided but not defined: -colour"}},
		{"stray argument", []string{"--store", "memory", "extra"}, nil, "", []string{`unexpected arguments ["extra"]`}},
		{"missing file, with the rest", []string{"--config", "/nonexistent/policy.yaml", "--store", "disk"}, nil, "",
			[]string{"config (flag --config): open /nonexistent/policy.yaml: no such file", "store (flag --store)"}},
		{"missing file from the environment", nil, map[string]string{"IDEMPOTENCY_CONFIG": "/nonexistent/policy.yaml"}, "",
			[]string{"config (environment variable IDEMPOTENCY_CONFIG): open /nonexistent/policy.yaml"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			args := tc.args
			if tc.file != "" {
				args = append(args, "--config", writeFile(t, tc.file))
			}
			_, err := loadConfig(args, env(tc.env))
			require.Error(t, err)
			for _, w := range tc.want {
				require.ErrorContains(t, err, w)
			}
			require.NotContains(t, err.Error(), "s3cret", "a password never reaches an error")
		})
	}
}

func writeNamed(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

func TestConfigSecretFiles(t *testing.T) {
	token := writeNamed(t, "token", "tok-3f9a\n")
	keys := writeNamed(t, "keys", "k2:"+strings.Repeat("A", 42)+"E=\nk1:"+strings.Repeat("B", 42)+"E=\n")
	secret := writeNamed(t, "secret", strings.Repeat("s", 32)+"\r\n")

	c, err := loadConfig([]string{"--admin-token-file", token}, env(map[string]string{
		"IDEMPOTENCY_RECORD_KEYS_FILE": keys, "IDEMPOTENCY_KEY_HASH_SECRET_FILE": secret,
	}))
	require.NoError(t, err)
	require.Equal(t, []byte("tok-3f9a"), c.adminToken, "without the trailing newline")
	require.Equal(t, "k2:"+strings.Repeat("A", 42)+"E=\nk1:"+strings.Repeat("B", 42)+"E=\n", string(c.recordKeys), "as written")
	require.Equal(t, "k2", c.keyring.ActiveID(), "the first line is the active key")
	require.Equal(t, []string{"k2", "k1"}, c.keyring.IDs())
	require.NotNil(t, c.keyHash)
	require.Equal(t, []byte(strings.Repeat("s", 32)), c.keyHashSecret, "without the trailing CRLF")

	other := writeNamed(t, "other-token", "tok-other")
	c, err = loadConfig([]string{"--config", writeFile(t, "admin_token_file: "+token+"\nkey_hash_secret_file: "+secret+"\n"), "--admin-token-file", other}, env(nil))
	require.NoError(t, err)
	require.Equal(t, []byte("tok-other"), c.adminToken, "the flag beats the file")
	require.Equal(t, []byte(strings.Repeat("s", 32)), c.keyHashSecret, "from the file")
}

// A secret file that cannot be used stops start-up with the setting, where it came from and the
// path; never the file's content.
func TestConfigBadSecretFiles(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "absent")
	cases := []struct {
		name    string
		setting string
		content *string // nil: no such file
		want    string
	}{
		{"a missing token file", "admin-token-file", nil, "admin-token-file (flag --admin-token-file): open " + missing + ": no such file or directory"},
		{"a missing keys file", "record-keys-file", nil, "record-keys-file (flag --record-keys-file): open " + missing},
		{"a missing secret file", "key-hash-secret-file", nil, "key-hash-secret-file (flag --key-hash-secret-file): open " + missing},
		{"an empty token file", "admin-token-file", ptr("\n"), "is empty"},
		{"an empty keys file", "record-keys-file", ptr(""), "is empty"},
		{"an empty secret file", "key-hash-secret-file", ptr(" \n"), "is empty"},
		{"a token with a space", "admin-token-file", ptr("s3cret-part other-part\n"), "the token holds spaces or control characters"},
		{"a token on two lines", "admin-token-file", ptr("s3cret-part\nother-part\n"), "the token holds spaces or control characters"},
		{"a short secret", "key-hash-secret-file", ptr("s3cret-but-short\n"), "holds 16 bytes; at least 32 are needed"},
		{"a key that is not 32 bytes", "record-keys-file", ptr("a:" + base64.StdEncoding.EncodeToString([]byte("s3cret-but-short")) + "\n"), "line 1"},
		{"a line without an id", "record-keys-file", ptr(base64.StdEncoding.EncodeToString([]byte(strings.Repeat("s3cret!!", 4))) + "\n"), "line 1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := missing
			if tc.content != nil {
				path = writeNamed(t, "file", *tc.content)
			}
			_, err := loadConfig([]string{"--" + tc.setting, path}, env(nil))
			require.ErrorContains(t, err, tc.setting+" (flag --"+tc.setting+"): ")
			require.ErrorContains(t, err, path)
			require.ErrorContains(t, err, tc.want)
			require.NotContains(t, err.Error(), "s3cret", "a secret never reaches an error")
		})
	}

	dir := t.TempDir()
	_, err := loadConfig(nil, env(map[string]string{"IDEMPOTENCY_ADMIN_TOKEN_FILE": dir}))
	require.ErrorContains(t, err, "admin-token-file (environment variable IDEMPOTENCY_ADMIN_TOKEN_FILE): "+dir+": not a regular file (a directory)")
}

func ptr(s string) *string { return &s }

// -h lists every setting with its environment variable and default, and is flag.ErrHelp.
func TestConfigHelp(t *testing.T) {
	_, err := loadConfig([]string{"-h"}, env(nil))
	require.ErrorIs(t, err, flag.ErrHelp)
	var out strings.Builder
	require.NoError(t, writeUsage(&out))
	for _, s := range allSettings {
		require.Contains(t, out.String(), "-"+s.name+" ", s.name)
		require.Contains(t, out.String(), "(env "+s.env()+")", s.name)
		if s.def != "" {
			require.Contains(t, out.String(), s.def, s.name)
		}
	}
}

// A zero runOptions runs with the production settings.
func TestRunOptionsDefaults(t *testing.T) {
	o := runOptions{}.withDefaults()
	require.Equal(t, 15*time.Second, o.drainTimeout)
	require.Equal(t, 30*time.Second, o.keepaliveTime)
	require.Equal(t, 10*time.Second, o.keepaliveTimeout)
	require.NotNil(t, o.listen)
	require.NotNil(t, o.openStore)
	require.Equal(t, 2*time.Minute, o.adminIdleTimeout)
	require.Greater(t, adminWriteTimeout, recordsTimeout, "a records API call answers before its connection is cut")
	require.Equal(t, time.Second, runOptions{drainTimeout: time.Second}.withDefaults().drainTimeout, "a set field stays")
}

// Waiting for replicas needs a store that has them: the memory store refuses durability at
// start-up, naming the setting and the routes that ask for it.
func TestConfigDurabilityNeedsRedis(t *testing.T) {
	file := writeFile(t, `
routes:
  - {name: pay, match: {path_prefix: /pay}, durability: {replicas: 1}}
  - {name: refund, match: {path_prefix: /refund}}
  - {name: ledger, match: {path_prefix: /ledger}, durability: {replicas: 2}}
`)
	_, err := loadConfig([]string{"--config", file}, env(nil))
	require.EqualError(t, err, `durability.replicas (config file `+file+`) is above 0 for route "pay", route "ledger", and the memory store (store, default) has no replicas to wait for: use the Redis store, or durability.replicas: 0`)

	file = writeFile(t, "durability: {replicas: 1}\nroutes: [{name: off, match: {path_prefix: /o}, durability: {replicas: 0}}]\n")
	_, err = loadConfig([]string{"--config", file, "--store", "memory"}, env(nil))
	require.ErrorContains(t, err, "is above 0 for the defaults, and the memory store (store, flag --store)")
	require.NotContains(t, err.Error(), "off")

	c, err := loadConfig([]string{"--config", file, "--store", "redis"}, env(nil))
	require.NoError(t, err)
	require.Equal(t, 1, c.policy.Default.Durability.Replicas)
}
