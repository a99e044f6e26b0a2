package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The version set at link time wins; then the module version go install records; then
// "devel" with the VCS commit the build recorded.
func TestBuildOf(t *testing.T) {
	vcs := func(rev, modified string) []debug.BuildSetting {
		return []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified}}
	}
	const rev = "0e5d0b74eb0239193467341d85c5c1957542a58a"
	for _, tc := range []struct {
		name                   string
		linkedVersion, linkRev string
		info                   *debug.BuildInfo
		want                   build
	}{
		{"linked", "v1.2.0", "abc123", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.0.0-x"}, Settings: vcs(rev, "false")},
			build{version: "v1.2.0", revision: "abc123", goVersion: "go1.26.8"}},
		{"linked version, revision from the build", "v1.2.0", "", &debug.BuildInfo{GoVersion: "go1.26.8", Settings: vcs(rev, "false")},
			build{version: "v1.2.0", revision: rev, goVersion: "go1.26.8"}},
		{"go install @v1.3.0", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/idempotency-extproc/idempotency-extproc", Version: "v1.3.0"}},
			build{version: "v1.3.0", revision: "unknown", goVersion: "go1.26.8"}},
		{"go install @main", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Path: "github.com/idempotency-extproc/idempotency-extproc", Version: "v0.0.0-20261207045700-f25308f47955"}},
			build{version: "v0.0.0-20261207045700-f25308f47955", revision: "f25308f47955", goVersion: "go1.26.8"}},
		{"go install @commit after a tag", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v1.2.1-0.20261207045700-f25308f47955+incompatible"}},
			build{version: "v1.2.1-0.20261207045700-f25308f47955+incompatible", revision: "f25308f47955", goVersion: "go1.26.8"}},
		{"a version that only looks like one", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v1.2.0-rc.1-f25308f47955"}},
			build{version: "v1.2.0-rc.1-f25308f47955", revision: "unknown", goVersion: "go1.26.8"}},
		{"a build in a clean checkout", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}, Settings: vcs(rev, "false")},
			build{version: "devel+0e5d0b74eb02", revision: rev, goVersion: "go1.26.8"}},
		{"a build with changes", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}, Settings: vcs(rev, "true")},
			build{version: "devel+0e5d0b74eb02.dirty", revision: rev, goVersion: "go1.26.8"}},
		{"nothing recorded", "", "", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}},
			build{version: "devel", revision: "unknown", goVersion: runtime.Version()}},
		{"no build info", "", "", nil, build{version: "devel", revision: "unknown", goVersion: runtime.Version()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, buildOf(tc.linkedVersion, tc.linkRev, tc.info))
		})
	}
}

// -ldflags "-X main.version=…" reaches --version, as the Dockerfile passes it.
func TestBinaryVersionFromLinkerFlags(t *testing.T) {
	bin, err := binary()
	require.NoError(t, err)
	for _, arg := range []string{"--version", "version"} {
		out, err := exec.Command(bin, arg).Output()
		require.NoError(t, err)
		require.Equal(t, binaryVersion+"\n", string(out))
	}
	out, err := exec.Command(bin, "help").Output()
	require.NoError(t, err, "help exits 0")
	require.True(t, strings.HasPrefix(string(out), "usage: idempotency-extproc"), "help on stdout")
}

// The Makefile's build links the git revision, so that `version` reports it also where the Go
// toolchain records no VCS information (GOFLAGS=-buildvcs=false).
func TestMakeBuildReportsTheRevision(t *testing.T) {
	rev, err := exec.Command("git", "rev-parse", "HEAD").Output()
	require.NoError(t, err, "the tests run in a git checkout")
	tag, _ := exec.Command("git", "describe", "--tags", "--dirty").Output()
	bin := filepath.Join(t.TempDir(), "idempotency-extproc")
	cmd := exec.Command("make", "-s", "-C", "../..", "build", "BIN="+bin)
	cmd.Env = append(os.Environ(), "GOFLAGS=-buildvcs=false")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	want := "devel+" + string(rev[:12])
	if t := strings.TrimSpace(string(tag)); t != "" {
		want = t
	}
	out, err = exec.Command(bin, "version").Output()
	require.NoError(t, err)
	require.Equal(t, want+"\n", string(out))
}
