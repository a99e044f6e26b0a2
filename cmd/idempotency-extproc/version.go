package main

import (
	"runtime"
	"runtime/debug"
	"strings"
)

// version and revision are set when the binary is linked, as the Makefile's build and the
// Dockerfile do:
//
//	go build -ldflags "-X main.version=v1.2.0 -X main.revision=$(git rev-parse HEAD)" ./cmd/idempotency-extproc
//
// Without them, the build's own record says what it can (buildOf): nothing of the VCS where
// GOFLAGS=-buildvcs=false is set.
var version, revision string

// build is what the binary knows of how it was built: what --version prints, the ready log
// line and idempotency_build_info carry.
type build struct {
	version   string
	revision  string // the VCS commit, or "unknown"
	goVersion string
}

// currentBuild is this binary's build.
func currentBuild() build {
	info, _ := debug.ReadBuildInfo()
	return buildOf(version, revision, info)
}

// buildOf decides the version: the one set at link time; else the module version that
// `go install …@v1.2.0` records (or that go build derives from the VCS tag and commit); else
// "devel", with the VCS commit when the build recorded one (and ".dirty" when the work tree
// had changes). The revision is the one set at link time, else the VCS commit the build
// recorded, else the commit prefix of a pseudo-version (`go install …@main` records one). info
// may be nil.
func buildOf(linkedVersion, linkedRevision string, info *debug.BuildInfo) build {
	b := build{version: linkedVersion, revision: linkedRevision, goVersion: runtime.Version()}
	modified := false
	if info != nil {
		if info.GoVersion != "" {
			b.goVersion = info.GoVersion
		}
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				if b.revision == "" {
					b.revision = s.Value
				}
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
		if b.version == "" && info.Main.Version != "(devel)" {
			b.version = info.Main.Version
		}
		if b.revision == "" {
			b.revision = pseudoVersionRevision(info.Main.Version)
		}
	}
	if b.version == "" {
		b.version = "devel"
		if b.revision != "" {
			b.version += "+" + b.revision[:min(12, len(b.revision))]
			if modified {
				b.version += ".dirty"
			}
		}
	}
	if b.revision == "" {
		b.revision = "unknown"
	}
	return b
}

// pseudoVersionRevision returns the commit prefix of a Go pseudo-version such as
// v0.0.0-20261207045700-f25308f47955 (or v1.2.1-0.20261207045700-f25308f47955, with
// +incompatible or not), or "" for any other version.
func pseudoVersionRevision(v string) string {
	v = strings.TrimSuffix(v, "+incompatible")
	i := strings.LastIndexByte(v, '-')
	if i < 0 {
		return ""
	}
	rev, rest := v[i+1:], v[:i]
	if len(rev) != 12 || strings.Trim(rev, "0123456789abcdef") != "" || len(rest) < 14 {
		return ""
	}
	if strings.Trim(rest[len(rest)-14:], "0123456789") != "" {
		return ""
	}
	if sep := rest[:len(rest)-14]; !strings.HasSuffix(sep, "-") && !strings.HasSuffix(sep, ".0.") && !strings.HasSuffix(sep, "-0.") {
		return ""
	}
	return rev
}
