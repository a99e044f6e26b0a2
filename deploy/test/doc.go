// Package deploytest holds the tests of deploy/: the Helm chart is linted and rendered with
// several value sets by Helm's own Go packages, every rendered object is decoded strictly into
// its Kubernetes, Istio, Envoy Gateway or Prometheus Operator API type, the mesh filters pass
// the contract checks of e2e/envoyconf, every metric that the Grafana dashboard and the
// alerting rules name is on a running binary's /metrics, and docs/operating.md's metrics table
// and runbooks match that binary and those rules.
//
// It is a module of its own so that Helm and the API types stay out of the product's go.mod.
// Run it with `make deploy-test` (part of `make test`) or `cd deploy/test && go test ./...`.
package deploytest
