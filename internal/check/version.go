package check

import (
	"fmt"
	"strconv"
	"strings"
)

// envoyVersion is an Envoy release, major.minor.patch; a version given as major.minor has
// patch -1 (any patch release).
type envoyVersion struct {
	major, minor, patch int
	text                string
}

// parseVersion reads --envoy-version: 1.38, 1.39.1, v1.39.1. Empty is no version.
func parseVersion(s string) (*envoyVersion, error) {
	if s == "" {
		return nil, nil
	}
	parts := strings.Split(strings.TrimPrefix(s, "v"), ".")
	if len(parts) < 2 || len(parts) > 3 {
		return nil, fmt.Errorf("%q is not an Envoy version such as 1.38 or 1.39.1", s)
	}
	n := make([]int, 3)
	n[2] = -1
	for i, p := range parts {
		v, err := strconv.Atoi(p)
		if err != nil || v < 0 || p == "" {
			return nil, fmt.Errorf("%q is not an Envoy version such as 1.38 or 1.39.1", s)
		}
		n[i] = v
	}
	return &envoyVersion{major: n[0], minor: n[1], patch: n[2], text: strings.TrimPrefix(s, "v")}, nil
}

// before reports whether v is older than major.minor.patch; a version without patch is taken
// as its first release (the defects of x.y.0 are in every x.y the user may run).
func (v *envoyVersion) before(major, minor, patch int) bool {
	p := max(v.patch, 0)
	switch {
	case v.major != major:
		return v.major < major
	case v.minor != minor:
		return v.minor < minor
	}
	return p < patch
}

// versionFindings are the warnings of v's known ext_proc defects, from Envoy's changelogs
// (changelogs/1.39.0.yaml, 1.39.1.yaml).
func versionFindings(v *envoyVersion) []Finding {
	if v == nil {
		return nil
	}
	warn := func(field, problem, fix string) Finding {
		return Finding{File: "--envoy-version", Resource: "Envoy " + v.text, Field: field, Kind: kindEnvoyVersion, Problem: problem, Fix: fix}
	}
	var out []Finding
	if v.before(1, 39, 0) {
		out = append(out,
			warn("failure_mode_allow",
				"before 1.39 Envoy ignores failure_mode_allow: false when it cannot create the gRPC client to the processor (envoyproxy/envoy#45220): requests then reach the upstream without the processor, unprotected",
				"run Envoy 1.39.1 or later"),
			warn("ext_proc",
				"before 1.39 Envoy mishandles unexpected ProcessingResponses sent packed together (CVE-2026-47207); the processor never sends them, but a compromised or misbehaving processor could",
				"run Envoy 1.39.1 or later"))
	}
	if !v.before(1, 39, 0) && v.before(1, 39, 1) {
		out = append(out, warn("ext_proc",
			"1.39.0 lacks the lifetime fixes of ext_proc and the gRPC async client that landed in 1.39.1 (use-after-free or double callbacks while waiting for a stream's remote close, streams that fail to create synchronously)",
			"run Envoy 1.39.1 or later"))
	}
	return out
}
