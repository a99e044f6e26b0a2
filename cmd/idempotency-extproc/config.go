package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/cache/seal"
	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// config is the whole configuration: the settings of allSettings and the compiled policy.
type config struct {
	configPath          string
	grpcAddr            string
	adminAddr           string
	adminPprof          bool
	store               string
	redisURL            string
	redisClusterAddrs   []string
	redisSentinelAddrs  []string
	redisSentinelMaster string
	redisBatching       bool
	memoryMaxBytes      int64
	maxStreams          int
	logLevel            zerolog.Level
	logFormat           string
	// adminToken is the records API's bearer token, without the file's trailing newline; nil
	// without --admin-token-file.
	adminToken []byte
	// recordKeys is the content of --record-keys-file, for the sealing package to parse; nil
	// without it.
	recordKeys []byte
	// keyHashSecret is the HMAC secret of stored keys, without the file's trailing newline; nil
	// without --key-hash-secret-file.
	keyHashSecret []byte
	// keyring seals stored responses (from recordKeys); nil when off.
	keyring *seal.Keyring
	// keyHash makes the HMAC of stored keys (from keyHashSecret); nil for SHA-256.
	keyHash func() hash.Hash

	// checkOnly is set for check, which validates the configuration without reading a secret:
	// the files of the secret settings are looked at, never read, and one that is not there yet
	// (a Kubernetes Secret not made yet) is a note instead of an error. adminToken, recordKeys,
	// keyHashSecret, keyring and keyHash then stay nil.
	checkOnly bool
	// notes are what check says about the configuration without failing it.
	notes []string

	policy *policy.Policy
}

// setting is one setting of the program: the flag --name, the environment variable
// IDEMPOTENCY_NAME, the policy file key name (with underscores), its default, what it does (for
// -h and docs/configuration.md) and apply, which validates a value and sets it. Flags beat the
// environment, which beats the file, which beats the default; an empty variable counts as unset.
type setting struct {
	name string
	def  string // "" is shown as none
	doc  string
	// list takes a YAML list in the policy file as well as a comma-separated string.
	list bool
	// notInFile is for the setting that names the file.
	notInFile bool
	apply     func(c *config, v string) error
}

func (s setting) env() string {
	return "IDEMPOTENCY_" + strings.ToUpper(strings.ReplaceAll(s.name, "-", "_"))
}

func (s setting) fileKey() string { return strings.ReplaceAll(s.name, "-", "_") }

// docParts splits doc around the one word in braces that names the setting's value: {file},
// {address}. docs/configuration.md shows the word as it is; -h shows it as the flag's placeholder
// (-config file), which the flag package takes from the first back-quoted word of a usage.
func (s setting) docParts() (before, word, after string) {
	before, rest, ok := strings.Cut(s.doc, "{")
	if !ok {
		return s.doc, "", ""
	}
	word, after, _ = strings.Cut(rest, "}")
	return before, word, after
}

// markdown is doc as docs/configuration.md's table of settings shows it.
func (s setting) markdown() string {
	before, word, after := s.docParts()
	return before + word + after
}

// flagUsage is doc as -h shows it: the value's word back-quoted, the only back quotes left, and
// the environment variable.
func (s setting) flagUsage() string {
	before, word, after := s.docParts()
	plain := strings.NewReplacer("`", "")
	if word != "" {
		word = "`" + word + "`"
	}
	return plain.Replace(before) + word + plain.Replace(after) + " (env " + s.env() + ")"
}

// minKeyHashSecret is the shortest --key-hash-secret-file accepted: HMAC-SHA256's block of
// entropy.
const minKeyHashSecret = 32

// allSettings are the settings of the server, in the order -h and docs/configuration.md list them.
var allSettings = []setting{
	{name: "config", notInFile: true, doc: "the YAML policy {file}, which may also give the settings below under their file key; without one the defaults apply",
		apply: func(c *config, v string) error {
			c.configPath = v
			return nil
		}},
	{name: "grpc-addr", def: ":9002", doc: "the ext_proc gRPC listener's {address}: host:port, or `unix:///path.sock` for a Unix socket, which its owner and group may connect to (a stale socket there is replaced; any other file is left alone and refused)",
		apply: func(c *config, v string) error {
			c.grpcAddr = v
			return checkAddr(v)
		}},
	{name: "admin-addr", def: ":9003", doc: "the admin HTTP listener's {address}, serving `/metrics`, `/healthz`, `/readyz` and, with `--admin-token-file`, `/v1/records/`",
		apply: func(c *config, v string) error {
			c.adminAddr = v
			return checkAddr(v)
		}},
	{name: "admin-pprof", def: "false", doc: "whether the admin listener also serves Go's runtime profiles at `/debug/pprof/`, a {bool}: off by default, as anyone who reaches the admin port could then take CPU and heap profiles and execution traces; turn it on to find where the process spends its CPU, then off",
		apply: func(c *config, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return fmt.Errorf("must be true or false, got %q", v)
			}
			c.adminPprof = b
			return nil
		}},
	{name: "store", def: "memory", doc: "the {kind} of store: `memory` or `redis` (Redis 7.0 or later, or Valkey)",
		apply: func(c *config, v string) error {
			if v != "memory" && v != "redis" {
				return fmt.Errorf("must be memory or redis, got %q", v)
			}
			c.store = v
			return nil
		}},
	{name: "redis-url", def: "redis://localhost:6379/0", doc: "the Redis {url}: standalone `redis://` or TLS `rediss://`, user and password in the URL; for Cluster and Sentinel its user, password and TLS apply to the nodes, whose certificates are checked against the addresses they are dialled at (its host is ignored); a private CA is trusted through `SSL_CERT_FILE`; checked at start-up with `--store redis`, and its errors never show the password (percent-encode `#`, `/`, `@`, `:` and `%` in it); the store speaks RESP2 unless the URL asks for RESP3 (`?protocol=3`), which costs go-redis a look for push notifications before every reply",
		apply: func(c *config, v string) error {
			c.redisURL = v
			return nil
		}},
	{name: "redis-cluster-addrs", list: true, doc: "comma-separated seed node {addresses} (a YAML list in the file); selects Redis Cluster",
		apply: func(c *config, v string) error {
			c.redisClusterAddrs = splitList(v)
			return nil
		}},
	{name: "redis-sentinel-addrs", list: true, doc: "comma-separated sentinel {addresses} (a YAML list in the file); selects Sentinel",
		apply: func(c *config, v string) error {
			c.redisSentinelAddrs = splitList(v)
			return nil
		}},
	{name: "redis-sentinel-master", def: "mymaster", doc: "the master {name} the sentinels watch",
		apply: func(c *config, v string) error {
			if v == "" {
				return errors.New("must not be empty")
			}
			c.redisSentinelMaster = v
			return nil
		}},
	{name: "redis-batching", def: "true", doc: "whether concurrent Redis calls are batched, a {bool}: `true` shares their round trips in pipelined batches (measured faster under load; staged completions of 256 KiB or more still go alone); `false` sends each call in a round trip of its own",
		apply: func(c *config, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return fmt.Errorf("must be true or false, got %q", v)
			}
			c.redisBatching = b
			return nil
		}},
	{name: "memory-max-bytes", def: strconv.Itoa(cache.DefaultMemoryMaxBytes), doc: "the memory store's bound in {bytes}; least recently used completed records go first",
		apply: func(c *config, v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n <= 0 {
				return fmt.Errorf("must be a positive number of bytes, got %q", v)
			}
			c.memoryMaxBytes = n
			return nil
		}},
	{name: "max-streams", def: strconv.Itoa(extproc.DefaultMaxStreams), doc: "the most ext_proc streams one replica keeps open at once, a {number}: Envoy holds one per HTTP request it is processing, and a stream beyond the limit is refused at once with `RESOURCE_EXHAUSTED` (docs/operating.md shows the memory a stream takes)",
		apply: func(c *config, v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				return fmt.Errorf("must be a positive number of streams, got %q", v)
			}
			c.maxStreams = n
			return nil
		}},
	{name: "log-level", def: "info", doc: "the least {level} logged: `trace`, `debug`, `info`, `warn` or `error`",
		apply: func(c *config, v string) error {
			l, err := zerolog.ParseLevel(v)
			if err != nil || v == "" {
				return fmt.Errorf("must be trace, debug, info, warn or error, got %q", v)
			}
			c.logLevel = l
			return nil
		}},
	{name: "log-format", def: "json", doc: "the log {format}: `json` or `console`",
		apply: func(c *config, v string) error {
			if v != "json" && v != "console" {
				return fmt.Errorf("must be json or console, got %q", v)
			}
			c.logFormat = v
			return nil
		}},
	{name: "admin-token-file", doc: "a {file} holding the bearer token of the records API on the admin listener (one line, no spaces); without it `/v1/records/` answers 404",
		apply: func(c *config, v string) error {
			b, err := c.secretFile("admin-token-file", v, readSecretFile)
			if err != nil || b == nil {
				return err
			}
			if bytes.ContainsFunc(b, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
				return fmt.Errorf("%s: the token holds spaces or control characters; write it alone on one line", v)
			}
			c.adminToken = b
			return nil
		}},
	{name: "record-keys-file", doc: "a {file} of lines `<id>:<base64 of 32 bytes>`, the first the active key: stored responses are sealed with AES-256-GCM; records sealed with any listed key are read",
		apply: func(c *config, v string) error {
			b, err := c.secretFile("record-keys-file", v, readFile)
			if err != nil || b == nil {
				return err
			}
			ring, err := seal.ParseKeyring(b)
			if err != nil {
				return fmt.Errorf("%s: %w", v, err) // names the line, never a key
			}
			c.recordKeys, c.keyring = b, ring
			return nil
		}},
	{name: "key-hash-secret-file", doc: "a {file} of at least 32 bytes: stored keys are HMAC-SHA256 with it instead of SHA-256; changing it re-keys every record",
		apply: func(c *config, v string) error {
			b, err := c.secretFile("key-hash-secret-file", v, readSecretFile)
			if err != nil || b == nil {
				return err
			}
			if len(b) < minKeyHashSecret {
				return fmt.Errorf("%s holds %d bytes; at least %d are needed (for example from head -c 32 /dev/urandom)", v, len(b), minKeyHashSecret)
			}
			h, err := seal.NewKeyHasher(b)
			if err != nil {
				return fmt.Errorf("%s: %w", v, err)
			}
			c.keyHashSecret, c.keyHash = b, h
			return nil
		}},
}

// readFile reads the secret file a setting names at start-up (a token, a key-hash secret, a
// keyring): nil for "" (the setting is off), an error naming the path when it is not a regular
// file of at most maxSecretFileBytes, cannot be read or holds nothing but spaces. The error
// never holds the file's content.
func readFile(path string) ([]byte, error) {
	if path == "" {
		return nil, nil
	}
	b, err := readBoundedFile(path, maxSecretFileBytes)
	if err != nil {
		return nil, err
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return nil, fmt.Errorf("%s is empty", path)
	}
	return b, nil
}

// secretFile returns the content of the file at path, which the secret setting name names, read
// with read as start-up reads it. Under check (c.checkOnly) the file is only looked at, as
// lookAtFile does, and nil is returned: a file that is not there is noted, since a Secret is
// mounted only where the server runs.
func (c *config) secretFile(name, path string, read func(string) ([]byte, error)) ([]byte, error) {
	if path == "" || !c.checkOnly {
		return read(path)
	}
	err := lookAtFile(path, maxSecretFileBytes)
	if errors.Is(err, fs.ErrNotExist) {
		c.notes = append(c.notes, fmt.Sprintf("%s: %s is not there to look at; the server reads it at start-up", name, path))
		return nil, nil
	}
	return nil, err
}

// readSecretFile is readFile without the one trailing newline that editors and echo write, so
// that a secret written by hand and one mounted from a Kubernetes Secret are the same bytes.
func readSecretFile(path string) ([]byte, error) {
	b, err := readFile(path)
	if b != nil {
		b = bytes.TrimSuffix(bytes.TrimSuffix(b, []byte("\n")), []byte("\r"))
	}
	return b, err
}

// checkAddr checks a listener address: host:port (the host may be empty, the port a number or
// a service name), or unix:///path.
func checkAddr(v string) error {
	if path, ok := strings.CutPrefix(v, "unix://"); ok {
		if path == "" {
			return errors.New("must be host:port or unix:///path, got an empty path")
		}
		return nil
	}
	_, port, err := net.SplitHostPort(v)
	if err == nil {
		_, err = net.LookupPort("tcp", port)
	}
	if err != nil {
		return fmt.Errorf("must be host:port or unix:///path, got %q", v)
	}
	return nil
}

func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// fileSettings are the settings the policy file may give, for policy.ParseFile.
func fileSettings(all []setting) []policy.Setting {
	var out []policy.Setting
	for _, s := range all {
		if !s.notInFile {
			out = append(out, policy.Setting{Key: s.fileKey(), List: s.list})
		}
	}
	return out
}

// serverFlags is the flag set of the server's settings, silent: its caller reports its errors
// and prints its usage.
func serverFlags(all []setting) (*flag.FlagSet, map[string]*string) {
	fs := flag.NewFlagSet("idempotency-extproc", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	flags := map[string]*string{}
	for _, s := range all {
		flags[s.name] = fs.String(s.name, s.def, s.flagUsage())
	}
	return fs, flags
}

// startupConfig is the configuration the server starts with, validated as start-up validates it:
// the settings and the policy (loadConfig) and the files environment variables name for the
// libraries (checkLibraryFiles). run calls it with checkOnly false; check calls it with
// checkOnly true, which reads no secret and connects to nothing, and gets what it notes
// (config.notes) instead of an error for a file that is not there.
func startupConfig(args []string, getenv func(string) string, checkOnly bool) (*config, error) {
	c, err := loadConfigFor(args, getenv, checkOnly)
	if err != nil {
		return nil, err
	}
	notes, err := checkLibraryFiles(getenv, checkOnly)
	if err != nil {
		return nil, err
	}
	c.notes = append(c.notes, notes...)
	if _, _, err := tracingProtocol(getenv); err != nil {
		return nil, err
	}
	return c, nil
}

// loadConfig builds the configuration from flags, the environment and the policy file. Its
// error names every bad setting at once, each with where it came from. After -h it returns
// flag.ErrHelp, for its caller to print the usage (writeUsage).
func loadConfig(args []string, getenv func(string) string) (*config, error) {
	return loadConfigFor(args, getenv, false)
}

// loadConfigFor is loadConfig, for check when checkOnly is set (config.checkOnly).
func loadConfigFor(args []string, getenv func(string) string, checkOnly bool) (*config, error) {
	in, err := parseServerFlags(args, getenv)
	if err != nil {
		return nil, err
	}
	c := &config{policy: policy.Default(), checkOnly: checkOnly}
	var errs []error
	path, pathSource := in.value(allSettings[slices.IndexFunc(allSettings, func(s setting) bool { return s.notInFile })], nil)
	var file map[string]string
	if path != "" {
		var err error
		if c.policy, file, err = readPolicyFile(path, pathSource); err != nil {
			// The other settings are still checked, so that every bad one is reported at once.
			errs = append(errs, err)
		}
	}
	sources := map[string]string{}
	for _, s := range allSettings {
		v, source := in.value(s, file)
		sources[s.name] = source
		if err := s.apply(c, v); err != nil {
			errs = append(errs, fmt.Errorf("%s (%s): %w", s.name, source, err))
		}
	}
	if err := c.checkTogether(sources, path); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return c, nil
}

// settingInputs are where a setting's value may come from besides the policy file: the flags
// given and the environment.
type settingInputs struct {
	flags    map[string]*string
	explicit map[string]bool
	getenv   func(string) string
}

// parseServerFlags parses the server's flags; its error says how to list them, or is
// flag.ErrHelp after -h.
func parseServerFlags(args []string, getenv func(string) string) (settingInputs, error) {
	fs, flags := serverFlags(allSettings)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return settingInputs{}, err
		}
		return settingInputs{}, fmt.Errorf("%w (idempotency-extproc help lists the flags)", err)
	}
	if fs.NArg() > 0 {
		return settingInputs{}, fmt.Errorf("unexpected arguments %q: the server takes flags only (idempotency-extproc help lists the commands and flags)", fs.Args())
	}
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	return settingInputs{flags: flags, explicit: explicit, getenv: getenv}, nil
}

// value is a setting's value and where it came from: a flag given beats the environment, which
// beats the policy file's keys (file), which beat the default.
func (in settingInputs) value(s setting, file map[string]string) (string, string) {
	v, source := s.def, "default"
	if fv, ok := file[s.fileKey()]; ok && !s.notInFile {
		v, source = fv, "config file key "+s.fileKey()
	}
	if ev := in.getenv(s.env()); ev != "" {
		v, source = ev, "environment variable "+s.env()
	}
	if in.explicit[s.name] {
		v, source = *in.flags[s.name], "flag --"+s.name
	}
	return v, source
}

// readPolicyFile reads and parses the policy file at path, which source gave: the policy (the
// defaults when the file cannot be read, nil when it does not parse) and the settings its keys
// give.
func readPolicyFile(path, source string) (*policy.Policy, map[string]string, error) {
	data, err := readBoundedFile(path, maxPolicyFileBytes)
	if err != nil {
		return policy.Default(), nil, fmt.Errorf("config (%s): %w", source, err)
	}
	p, file, err := policy.ParseFile(data, fileSettings(allSettings))
	if err != nil {
		return p, file, fmt.Errorf("config file %s: %w", path, err)
	}
	return p, file, nil
}

// checkTogether refuses the settings that are valid alone and not together; sources says where
// each setting came from, path is the policy file.
func (c *config) checkTogether(sources map[string]string, path string) error {
	switch {
	case len(c.redisClusterAddrs) > 0 && len(c.redisSentinelAddrs) > 0:
		return fmt.Errorf("redis-cluster-addrs (%s) and redis-sentinel-addrs (%s): choose Cluster or Sentinel, not both",
			sources["redis-cluster-addrs"], sources["redis-sentinel-addrs"])
	case c.store == "redis":
		// What the Redis client would refuse at start-up, reported with the rest.
		if err := cache.CheckRedisOptions(c.redisOptions(0)); err != nil {
			return fmt.Errorf("redis-url (%s): %w", sources["redis-url"], err)
		}
	case c.store == "memory" && c.policy != nil:
		if waits := durableRoutes(c.policy); len(waits) > 0 {
			return fmt.Errorf("durability.replicas (config file %s) is above 0 for %s, and the memory store (store, %s) has no replicas to wait for: use the Redis store, or durability.replicas: 0",
				path, strings.Join(waits, ", "), sources["store"])
		}
	}
	return nil
}

// durableRoutes names the routes that wait for replicas (durability.replicas above 0): "the
// defaults", then each route by its name.
func durableRoutes(p *policy.Policy) []string {
	var names []string
	for _, r := range append([]*policy.Route{p.Default}, p.Routes...) {
		if r.Durability.Replicas > 0 {
			names = append(names, r.Description())
		}
	}
	return names
}

// redisOptions are the Redis store's options, each call bounded by timeout.
func (c *config) redisOptions(timeout time.Duration) cache.RedisOptions {
	return cache.RedisOptions{
		URL:             c.redisURL,
		ClusterAddrs:    c.redisClusterAddrs,
		SentinelAddrs:   c.redisSentinelAddrs,
		SentinelMaster:  c.redisSentinelMaster,
		Timeout:         timeout,
		Keyring:         c.keyring,
		DisableBatching: !c.redisBatching,
	}
}
