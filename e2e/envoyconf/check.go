// Package envoyconf prepares the Envoy configuration shipped in envoy/ for the end-to-end tests:
// the settings an Envoy-compatible test proxy needs (ProxySettings), a loopback copy of the
// bootstrap for a real envoy binary (Rewrite) and a helper that runs that binary (StartEnvoy),
// mutations of a bootstrap for tests that change one setting, and the demo JWTs. The checks that
// hold configuration to the contract live in internal/check; this package names them for the
// tests outside the main module.
//
// Everything here is test support. Functions are safe for concurrent use; none keeps state.
package envoyconf

import (
	"fmt"
	"os"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	filterextproc "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"google.golang.org/protobuf/proto"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
	"github.com/idempotency-extproc/idempotency-extproc/internal/check/checktest"
)

// The configuration checks live in internal/check, which the check subcommand runs on users'
// files; these names let the tests of e2e/ and deploy/test (a module of its own, which cannot
// import an internal package) call the same code.
type (
	// Thresholds are a cluster's circuit breaker thresholds (check.Thresholds).
	Thresholds = check.Thresholds
	// Deployment is what a deployment makes of the ext_proc filter (check.Deployment).
	Deployment = check.Deployment
	// EGPolicy is an EnvoyExtensionPolicy, translated (check.EGPolicy).
	EGPolicy = check.EGPolicy
	// EGLimits are Envoy Gateway's buffer limits (check.EGLimits).
	EGLimits = check.EGLimits
)

// Load reads an Envoy bootstrap file (check.Parse).
func Load(path string) (*bootstrapv3.Bootstrap, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	b, err := check.Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return b, nil
}

// Parse decodes one bootstrap document (check.Parse).
func Parse(yamlBytes []byte) (*bootstrapv3.Bootstrap, error) { return check.Parse(yamlBytes) }

// Validate runs the proto validation rules on m and every typed config in it (check.Validate).
func Validate(m proto.Message) error { return check.Validate(m) }

// ExtProc returns the ext_proc filter config of b's first connection manager.
func ExtProc(b *bootstrapv3.Bootstrap) (*filterextproc.ExternalProcessor, error) {
	f, _, err := checktest.ExtProcFilter(b)
	return f, err
}

// CheckSpec holds an ext_proc filter config to the contract (check.CheckSpec).
func CheckSpec(f *filterextproc.ExternalProcessor, storeTimeout time.Duration) error {
	return check.CheckSpec(f, storeTimeout)
}

// CheckProtection refuses the settings of d that break idempotency under p (check.CheckProtection).
func CheckProtection(d Deployment, p *policy.Policy) error { return check.CheckProtection(d, p) }

// WithoutGatewayGaps drops the refusal Envoy Gateway cannot avoid (check.WithoutGatewayGaps).
func WithoutGatewayGaps(err error) error { return check.WithoutGatewayGaps(err) }

// IstioExtProc returns the filter of an Istio file's EnvoyFilter (check.IstioDeployment).
func IstioExtProc(path string) (*filterextproc.ExternalProcessor, error) {
	d, err := check.IstioDeployment(path)
	if err != nil {
		return nil, err
	}
	return d.Filter, nil
}

// IstioDeployment reads the deployment of an Istio file (check.IstioDeployment).
func IstioDeployment(path string) (Deployment, error) { return check.IstioDeployment(path) }

// IstioAccessLogFormats returns the access log formats an Istio file adds (check.IstioAccessLogFormats).
func IstioAccessLogFormats(path string) ([]string, error) { return check.IstioAccessLogFormats(path) }

// EnvoyGateway translates an Envoy Gateway file (check.EnvoyGateway).
func EnvoyGateway(path string) ([]EGPolicy, EGLimits, error) { return check.EnvoyGateway(path) }

// cluster returns the static cluster of b named name, or nil; catchAllCluster the cluster of the
// first route with prefix "/".
var (
	cluster         = checktest.Cluster
	catchAllCluster = checktest.CatchAllCluster
)
