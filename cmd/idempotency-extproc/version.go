package main

import (
	"runtime"
	"runtime/debug"
)

// version and revision are set when the binary is linked, as the Dockerfile does:
//
//	go build -ldflags "-X main.version=v1.2.0 -X main.revision=$(git rev-parse HEAD)" ./cmd/idempotency-extproc
//
// Without them, the build's own record says what it can (buildOf).
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
// had changes). info may be nil.
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
