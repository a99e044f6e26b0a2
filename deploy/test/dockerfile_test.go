package deploytest

import (
	"bufio"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// instruction is one Dockerfile instruction, continuation lines joined.
type instruction struct {
	cmd, args string
}

// parseDockerfile splits a Dockerfile into instructions, dropping comments and joining lines
// that end in a backslash.
func parseDockerfile(t *testing.T, path string) []instruction {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var out []instruction
	var cur strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || (line == "" && cur.Len() == 0) {
			continue
		}
		if l, ok := strings.CutSuffix(line, "\\"); ok {
			cur.WriteString(l + " ")
			continue
		}
		cur.WriteString(line)
		cmd, args, _ := strings.Cut(strings.Join(strings.Fields(cur.String()), " "), " ")
		out = append(out, instruction{strings.ToUpper(cmd), args})
		cur.Reset()
	}
	require.NoError(t, sc.Err())
	return out
}

// The Dockerfile cross-compiles on the builder's platform for the target's (amd64 and arm64
// alike), without cgo, into a distroless non-root image labelled with the OCI annotations.
func TestDockerfile(t *testing.T) {
	ins := parseDockerfile(t, filepath.Join(repoRoot, "Dockerfile"))
	var stages [][]instruction
	for _, in := range ins {
		if in.cmd == "FROM" {
			stages = append(stages, nil)
		}
		require.NotEmpty(t, stages, "%s before the first FROM", in.cmd)
		stages[len(stages)-1] = append(stages[len(stages)-1], in)
	}
	require.Len(t, stages, 2, "a build stage and a runtime stage")
	build, run := stages[0], stages[1]

	require.True(t, strings.HasPrefix(build[0].args, "--platform=$BUILDPLATFORM golang:"), "build stage: %s", build[0].args)
	args := map[string]bool{}
	var goBuild string
	for _, in := range build {
		if in.cmd == "ARG" {
			args[in.args] = true
		}
		if in.cmd == "RUN" && strings.Contains(in.args, "go build") {
			goBuild = in.args
		}
	}
	require.True(t, args["TARGETOS"] && args["TARGETARCH"], "the build stage declares TARGETOS and TARGETARCH")
	for _, want := range []string{"CGO_ENABLED=0", "GOOS=$TARGETOS", "GOARCH=$TARGETARCH", "./cmd/idempotency-extproc", "-trimpath", "-tags vtprotobuf"} {
		require.Contains(t, goBuild, want)
	}
	// The image's version reaches the binary's --version: a build argument is seen only by the
	// stage that declares it.
	require.True(t, args["VERSION=dev"] && args["REVISION=unknown"], "the build stage declares VERSION and REVISION")
	require.Contains(t, goBuild, "-X main.version=${VERSION}")
	require.Contains(t, goBuild, "-X main.revision=${REVISION}")

	require.Regexp(t, `^gcr\.io/distroless/static[-a-z0-9]*:nonroot$`, run[0].args)
	labels := map[string]bool{}
	var user, entrypoint, expose string
	for _, in := range run {
		switch in.cmd {
		case "LABEL":
			for _, m := range regexp.MustCompile(`(org\.opencontainers\.image\.[a-z.]+)=`).FindAllStringSubmatch(in.args, -1) {
				labels[m[1]] = true
			}
		case "USER":
			user = in.args
		case "ENTRYPOINT":
			entrypoint = in.args
		case "EXPOSE":
			expose = in.args
		}
	}
	for _, l := range []string{"title", "description", "source", "url", "version", "revision", "created"} {
		require.True(t, labels["org.opencontainers.image."+l], "OCI label org.opencontainers.image.%s", l)
	}
	// The chart's runAsUser: a numeric non-root user lets runAsNonRoot be checked by the kubelet.
	require.Equal(t, "65532:65532", user)
	require.EqualValues(t, 65532, loadChart(t).Values["podSecurityContext"].(map[string]any)["runAsUser"])
	require.Equal(t, `["/idempotency-extproc"]`, entrypoint)
	require.ElementsMatch(t, []string{"9002", "9003"}, strings.Fields(expose))

	// .dockerignore keeps what the build needs.
	data, err := os.ReadFile(filepath.Join(repoRoot, ".dockerignore"))
	require.NoError(t, err)
	ignored := strings.Fields(string(data))
	for _, need := range []string{"go.mod", "go.sum", "cmd", "cache", "extproc", "internal"} {
		require.False(t, slices.Contains(ignored, need) || slices.Contains(ignored, "/"+need), ".dockerignore drops %s", need)
	}
}

// The build stage's command produces a linux binary for each platform the image is published for:
// the same flags as the Dockerfile's RUN (its -ldflags taken from the Dockerfile, the build
// arguments filled in), with TARGETOS and TARGETARCH set as buildx sets them, and the ELF machine
// of the result checked; the binary for this machine prints the VERSION it was built with. (The
// image itself needs a Docker engine, which CI has and this test does not assume.)
func TestBinaryBuildsForBothPlatforms(t *testing.T) {
	var ldflags string
	for _, in := range parseDockerfile(t, filepath.Join(repoRoot, "Dockerfile")) {
		if m := regexp.MustCompile(`-ldflags="([^"]*)"`).FindStringSubmatch(in.args); in.cmd == "RUN" && m != nil {
			ldflags = strings.NewReplacer("${VERSION}", "v9.8.7-test", "${REVISION}", "c0ffee").Replace(m[1])
		}
	}
	require.NotEmpty(t, ldflags, "the Dockerfile's go build has -ldflags")
	for arch, machine := range map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64} {
		t.Run(arch, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "idempotency-extproc")
			cmd := exec.Command("go", "build", "-trimpath", "-tags", "vtprotobuf", "-ldflags="+ldflags, "-o", out, "./cmd/idempotency-extproc")
			cmd.Dir = repoRoot
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
			b, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", b)
			f, err := elf.Open(out)
			require.NoError(t, err)
			defer f.Close()
			require.Equal(t, machine, f.Machine)
			if runtime.GOOS == "linux" && runtime.GOARCH == arch {
				version, err := exec.Command(out, "--version").Output()
				require.NoError(t, err)
				require.Equal(t, "v9.8.7-test\n", string(version))
			}
		})
	}
}
