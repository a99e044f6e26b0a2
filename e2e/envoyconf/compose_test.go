package envoyconf

import (
	"bytes"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// compose mirrors the parts of envoy/compose.yaml the demo depends on; it is decoded strictly so
// a misspelt key fails here rather than in `docker compose up`.
type compose struct {
	Name     string                    `yaml:"name"`
	Services map[string]composeService `yaml:"services"`
}

type composeService struct {
	Image string `yaml:"image"`
	Build *struct {
		Context    string            `yaml:"context"`
		Dockerfile string            `yaml:"dockerfile"`
		Args       map[string]string `yaml:"args"`
	} `yaml:"build"`
	Command     []string          `yaml:"command"`
	StopGrace   string            `yaml:"stop_grace_period"`
	Environment map[string]string `yaml:"environment"`
	Volumes     []string          `yaml:"volumes"`
	Ports       []string          `yaml:"ports"`
	Expose      []string          `yaml:"expose"`
	DependsOn   map[string]struct {
		Condition string `yaml:"condition"`
	} `yaml:"depends_on"`
	Healthcheck *struct {
		Test     []string `yaml:"test"`
		Interval string   `yaml:"interval"`
		Timeout  string   `yaml:"timeout"`
		Retries  int      `yaml:"retries"`
	} `yaml:"healthcheck"`
}

// The compose file is held to envoy.yaml without a Docker engine: every endpoint Envoy dials is
// a service that listens there, and the processor uses Redis.
func TestComposeMatchesEnvoyYAML(t *testing.T) {
	data, err := os.ReadFile(envoyFile(t, "compose.yaml"))
	require.NoError(t, err)
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var c compose
	require.NoError(t, dec.Decode(&c))

	envoy := c.Services["envoy"]
	require.Regexp(t, `^envoyproxy/envoy:v1\.\d+`, envoy.Image)
	require.Contains(t, envoy.Volumes, "./envoy.yaml:/etc/envoy/envoy.yaml:ro")
	require.Contains(t, envoy.Ports, "10000:10000")
	require.Contains(t, envoy.DependsOn, "extproc")
	require.Contains(t, envoy.DependsOn, "app")

	proc := c.Services["extproc"]
	require.NotNil(t, proc.Build)
	grace, err := time.ParseDuration(proc.StopGrace)
	require.NoError(t, err, "stop_grace_period")
	require.Greater(t, grace, 15*time.Second, "compose must let the 15 s drain finish before SIGKILL")
	require.Equal(t, "..", proc.Build.Context)
	require.Equal(t, "Dockerfile", proc.Build.Dockerfile)
	// The binary reports the revision the compose run passes in (.git is not in the context).
	require.Equal(t, "${REVISION:-unknown}", proc.Build.Args["REVISION"])
	require.Contains(t, proc.Command, "--store=redis")
	require.Contains(t, proc.Command, "--redis-url=redis://redis:6379/0")
	// The processor runs envoy/policy.yaml, whose routes envoy.yaml names.
	require.Contains(t, proc.Command, "--config=/etc/idempotency/policy.yaml")
	require.Contains(t, proc.Volumes, "./policy.yaml:/etc/idempotency/policy.yaml:ro")
	shippedPolicy(t)
	require.Contains(t, proc.Expose, "9002")
	require.Equal(t, "service_healthy", proc.DependsOn["redis"].Condition)
	require.NotNil(t, c.Services["redis"].Healthcheck)
	require.Regexp(t, `^redis:7`, c.Services["redis"].Image)

	b, err := Load(envoyFile(t, "envoy.yaml"))
	require.NoError(t, err)
	f, err := ExtProc(b)
	require.NoError(t, err)
	upstream, err := catchAllCluster(b)
	require.NoError(t, err)
	for _, name := range []string{f.GetGrpcService().GetEnvoyGrpc().GetClusterName(), upstream} {
		for _, lle := range cluster(b, name).GetLoadAssignment().GetEndpoints() {
			for _, e := range lle.GetLbEndpoints() {
				sa := e.GetEndpoint().GetAddress().GetSocketAddress()
				svc, ok := c.Services[sa.GetAddress()]
				require.True(t, ok, "cluster %s dials %s, which is not a compose service", name, sa.GetAddress())
				port := strconv.Itoa(int(sa.GetPortValue()))
				require.Contains(t, svc.Expose, port, "service %s does not expose %s", sa.GetAddress(), port)
			}
		}
	}
	require.Equal(t, "8080", c.Services["app"].Environment["HTTP_PORT"])
}
