package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/idempotency-extproc/idempotency-extproc/cache"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// config is the whole configuration: the settings of SPEC §2 and the policy of SPEC §6.
type config struct {
	grpcAddr            string
	adminAddr           string
	store               string
	redisURL            string
	redisClusterAddrs   []string
	redisSentinelAddrs  []string
	redisSentinelMaster string
	memoryMaxBytes      int64
	logLevel            zerolog.Level
	logFormat           string

	policy *policy.Policy
}

// setting is one row of SPEC §2: a flag, its environment variable, the policy file key that may
// also set it, and its default. Flags beat the environment, which beats the file, which beats
// the default.
type setting struct {
	name  string // the flag, without dashes; the file key is the same with underscores
	def   string
	usage string
	apply func(c *config, v string) error
}

func (s setting) env() string {
	return "IDEMPOTENCY_" + strings.ToUpper(strings.ReplaceAll(s.name, "-", "_"))
}

var settings = []setting{
	{"grpc-addr", ":9002", "ext_proc gRPC listener; unix:///path.sock for a Unix socket", func(c *config, v string) error {
		c.grpcAddr = v
		return checkAddr(v)
	}},
	{"admin-addr", ":9003", "HTTP listener for /metrics, /healthz and /readyz", func(c *config, v string) error {
		c.adminAddr = v
		return checkAddr(v)
	}},
	{"store", "memory", "memory or redis", func(c *config, v string) error {
		if v != "memory" && v != "redis" {
			return fmt.Errorf("must be memory or redis, got %q", v)
		}
		c.store = v
		return nil
	}},
	{"redis-url", "redis://localhost:6379/0", "standalone redis:// or TLS rediss:// URL, user and password in the URL", func(c *config, v string) error {
		c.redisURL = v
		return nil
	}},
	{"redis-cluster-addrs", "", "comma-separated seed nodes; selects Redis Cluster", func(c *config, v string) error {
		c.redisClusterAddrs = splitList(v)
		return nil
	}},
	{"redis-sentinel-addrs", "", "comma-separated sentinels; selects Sentinel", func(c *config, v string) error {
		c.redisSentinelAddrs = splitList(v)
		return nil
	}},
	{"redis-sentinel-master", "mymaster", "the master name the sentinels watch", func(c *config, v string) error {
		if v == "" {
			return errors.New("must not be empty")
		}
		c.redisSentinelMaster = v
		return nil
	}},
	{"memory-max-bytes", strconv.Itoa(cache.DefaultMemoryMaxBytes), "memory store bound; least recently used completed records go first", func(c *config, v string) error {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n <= 0 {
			return fmt.Errorf("must be a positive number of bytes, got %q", v)
		}
		c.memoryMaxBytes = n
		return nil
	}},
	{"log-level", "info", "trace, debug, info, warn or error", func(c *config, v string) error {
		l, err := zerolog.ParseLevel(v)
		if err != nil || v == "" {
			return fmt.Errorf("must be trace, debug, info, warn or error, got %q", v)
		}
		c.logLevel = l
		return nil
	}},
	{"log-format", "json", "json or console", func(c *config, v string) error {
		if v != "json" && v != "console" {
			return fmt.Errorf("must be json or console, got %q", v)
		}
		c.logFormat = v
		return nil
	}},
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

// Settings are the settings of SPEC §2 as a policy file may give them, next to the policy.
type Settings struct {
	GRPCAddr            *string   `yaml:"grpc_addr"`
	AdminAddr           *string   `yaml:"admin_addr"`
	Store               *string   `yaml:"store"`
	RedisURL            *string   `yaml:"redis_url"`
	RedisClusterAddrs   *[]string `yaml:"redis_cluster_addrs"`
	RedisSentinelAddrs  *[]string `yaml:"redis_sentinel_addrs"`
	RedisSentinelMaster *string   `yaml:"redis_sentinel_master"`
	MemoryMaxBytes      *string   `yaml:"memory_max_bytes"`
	LogLevel            *string   `yaml:"log_level"`
	LogFormat           *string   `yaml:"log_format"`
}

func (f *Settings) values() map[string]string {
	v := map[string]string{}
	str := func(name string, p *string) {
		if p != nil {
			v[name] = *p
		}
	}
	list := func(name string, p *[]string) {
		if p != nil {
			v[name] = strings.Join(*p, ",")
		}
	}
	str("grpc-addr", f.GRPCAddr)
	str("admin-addr", f.AdminAddr)
	str("store", f.Store)
	str("redis-url", f.RedisURL)
	list("redis-cluster-addrs", f.RedisClusterAddrs)
	list("redis-sentinel-addrs", f.RedisSentinelAddrs)
	str("redis-sentinel-master", f.RedisSentinelMaster)
	str("memory-max-bytes", f.MemoryMaxBytes)
	str("log-level", f.LogLevel)
	str("log-format", f.LogFormat)
	return v
}

// file is the YAML file: the policy of SPEC §6 and, optionally, the settings of SPEC §2.
type file struct {
	policy.Document `yaml:",inline"`
	Settings        `yaml:",inline"`
}

// loadConfig builds the configuration from flags, the environment and the policy file. Its
// error names every bad setting at once, each with where it came from.
func loadConfig(args []string, getenv func(string) string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("idempotency-extproc", flag.ContinueOnError)
	fs.SetOutput(stderr)
	configPath := fs.String("config", "", "YAML policy file (env IDEMPOTENCY_CONFIG); without one the defaults apply")
	flags := map[string]*string{}
	for _, s := range settings {
		flags[s.name] = fs.String(s.name, s.def, s.usage+" (env "+s.env()+")")
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })

	path, pathSource := getenv("IDEMPOTENCY_CONFIG"), "environment variable IDEMPOTENCY_CONFIG"
	if explicit["config"] {
		path, pathSource = *configPath, "flag --config"
	}
	var errs []error
	var doc file
	if path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			// The other settings are still checked, so that every bad one is reported at once.
			errs = append(errs, fmt.Errorf("config (%s): %w", pathSource, err))
		} else if err := policy.Decode(data, &doc); err != nil {
			errs = append(errs, fmt.Errorf("config file %s: %w", path, err))
		}
	}
	p, err := policy.Compile(doc.Document)
	if err != nil {
		errs = append(errs, fmt.Errorf("config file %s: %w", path, err))
	}

	c := &config{policy: p}
	fromFile := doc.Settings.values()
	sources := map[string]string{}
	for _, s := range settings {
		v, source := s.def, "default"
		if fv, ok := fromFile[s.name]; ok {
			v, source = fv, "config file key "+strings.ReplaceAll(s.name, "-", "_")
		}
		if ev, ok := lookupEnv(getenv, s.env()); ok {
			v, source = ev, "environment variable "+s.env()
		}
		if explicit[s.name] {
			v, source = *flags[s.name], "flag --"+s.name
		}
		sources[s.name] = source
		if err := s.apply(c, v); err != nil {
			errs = append(errs, fmt.Errorf("%s (%s): %w", s.name, source, err))
		}
	}
	switch {
	case len(c.redisClusterAddrs) > 0 && len(c.redisSentinelAddrs) > 0:
		errs = append(errs, fmt.Errorf("redis-cluster-addrs (%s) and redis-sentinel-addrs (%s): choose Cluster or Sentinel, not both",
			sources["redis-cluster-addrs"], sources["redis-sentinel-addrs"]))
	case c.store == "redis":
		// What the Redis client would refuse at start-up, reported with the rest.
		if err := cache.CheckRedisOptions(c.redisOptions(0)); err != nil {
			errs = append(errs, fmt.Errorf("redis-url (%s): %w", sources["redis-url"], err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return c, nil
}

// redisOptions are the Redis store's options, each call bounded by timeout.
func (c *config) redisOptions(timeout time.Duration) cache.RedisOptions {
	return cache.RedisOptions{
		URL:            c.redisURL,
		ClusterAddrs:   c.redisClusterAddrs,
		SentinelAddrs:  c.redisSentinelAddrs,
		SentinelMaster: c.redisSentinelMaster,
		Timeout:        timeout,
	}
}

// lookupEnv treats an empty variable as unset, as most deployment tools write unset values.
func lookupEnv(getenv func(string) string, name string) (string, bool) {
	v := getenv(name)
	return v, v != ""
}
