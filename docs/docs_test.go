// Package docs_test checks the repository's documentation as a whole: every relative link and
// anchor of every Markdown file resolves, and no file cites a document the repository does not
// hold.
package docs_test

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/require"
)

// root is the repository, from this directory.
const root = ".."

// skipDirs are not the repository's own documents.
var skipDirs = map[string]bool{".git": true, "testdata": true, "node_modules": true}

// walk calls fn for every file under root whose name has one of exts.
func walk(t *testing.T, exts []string, fn func(path string, data []byte)) {
	t.Helper()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if skipDirs[d.Name()] {
				return filepath.SkipDir
			}
			return nil
		}
		for _, ext := range exts {
			if strings.HasSuffix(path, ext) {
				data, err := os.ReadFile(path)
				if err != nil {
					return err
				}
				fn(path, data)
				return nil
			}
		}
		return nil
	})
	require.NoError(t, err)
}

var (
	// link matches an inline Markdown link or image: [text](target "title").
	link = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	// heading matches an ATX heading.
	heading = regexp.MustCompile(`(?m)^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$`)
	// fence matches a fenced code block, which holds no links or headings.
	fence = regexp.MustCompile("(?ms)^[ \t]*(```|~~~).*?^[ \t]*(```|~~~)[ \t]*$")
)

// anchors returns the anchors GitHub gives the headings of a Markdown document: the heading's
// text lower-cased, without punctuation, spaces turned into hyphens, and -1, -2 … after a
// repeated one.
func anchors(md []byte) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, m := range heading.FindAllSubmatch(fence.ReplaceAll(md, nil), -1) {
		var b strings.Builder
		for _, r := range strings.ToLower(string(m[1])) {
			switch {
			case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
				b.WriteRune(r)
			case r == ' ':
				b.WriteByte('-')
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			out[a+"-"+itoa(n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

func itoa(n int) string {
	const digits = "0123456789"
	if n < 10 {
		return digits[n : n+1]
	}
	return itoa(n/10) + digits[n%10:n%10+1]
}

// Every relative link of every Markdown file names a file of the repository, and every anchor a
// heading of the file it names.
func TestLinksResolve(t *testing.T) {
	docs := map[string][]byte{}
	walk(t, []string{".md"}, func(path string, data []byte) { docs[filepath.Clean(path)] = data })
	require.NotEmpty(t, docs)
	checked := 0
	for path, data := range docs {
		for _, m := range link.FindAllSubmatch(fence.ReplaceAll(data, nil), -1) {
			target := string(m[1])
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			dest := path
			if file != "" {
				dest = filepath.Clean(filepath.Join(filepath.Dir(path), file))
				_, err := os.Stat(dest)
				require.NoError(t, err, "%s links to %s, which does not exist", path, target)
			}
			checked++
			if anchor == "" {
				continue
			}
			md, ok := docs[dest]
			require.True(t, ok, "%s links to an anchor of %s, which is not a Markdown file", path, target)
			require.True(t, anchors(md)[anchor], "%s links to %s, and %s has no heading with that anchor", path, target, dest)
		}
	}
	require.Positive(t, checked)
}

// No file cites a document the repository does not hold; the pages of docs/ and Envoy's own
// source (file and function) are what to cite instead.
func TestNoCitationOfMissingDocuments(t *testing.T) {
	cited := regexp.MustCompile(`SPEC §|SPEC\.md|reference §|envoy-extproc\.md|anchors-idempotency|\.\./shared/|seeds/|STYLE\.md`)
	walk(t, []string{".go", ".md", ".yaml", ".yml", ".json", ".txt", ".tpl", "Makefile", "Dockerfile", ".sh"}, func(path string, data []byte) {
		if filepath.Base(path) == "docs_test.go" {
			return
		}
		for i, line := range bytes.Split(data, []byte("\n")) {
			require.False(t, cited.Match(line), "%s:%d cites a document the repository does not hold: %s", path, i+1, bytes.TrimSpace(line))
		}
	})
}

// Every file of envoy/ that a file names in its text (a comment's "as envoy/envoy.yaml does", a
// test's path) exists: a renamed or never-written example leaves such names behind, and only a
// Markdown link is checked by TestLinksResolve.
func TestNamedEnvoyFilesExist(t *testing.T) {
	named := regexp.MustCompile(`(?:^|[^A-Za-z0-9_./-])(envoy/[A-Za-z0-9._-]+\.(?:yaml|yml|json))`)
	checked := 0
	walk(t, []string{".go", ".md", ".yaml", ".yml", ".json", ".txt", ".tpl", "Makefile", "Dockerfile", ".sh"}, func(path string, data []byte) {
		for i, line := range bytes.Split(data, []byte("\n")) {
			for _, m := range named.FindAllSubmatch(line, -1) {
				_, err := os.Stat(filepath.Join(root, string(m[1])))
				require.NoError(t, err, "%s:%d names %s, which does not exist", path, i+1, m[1])
				checked++
			}
		}
	})
	require.Positive(t, checked)
}

func TestAnchors(t *testing.T) {
	got := anchors([]byte("# Guarantees and failure modes\n## `fail_mode: open`\n## Twice\n## Twice\n```\n# not a heading\n```\n"))
	require.Equal(t, map[string]bool{"guarantees-and-failure-modes": true, "fail_mode-open": true, "twice": true, "twice-1": true}, got)
}

// The README opens with the two commands a newcomer needs, as indented code: one that runs the
// service on the memory store and one that runs the whole test suite. The first names the
// binary's package; the second is the command CI runs, and a Makefile target.
func TestFrontDoorCommands(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	require.NoError(t, err)
	var cmds []string
	for _, line := range strings.Split(string(readme), "\n") {
		if c, ok := strings.CutPrefix(line, "    "); ok && strings.TrimSpace(c) != "" {
			cmds = append(cmds, strings.TrimSpace(c))
		}
		if len(cmds) == 2 {
			break
		}
	}
	require.Equal(t, []string{"go run ./cmd/idempotency-extproc", "make test"}, cmds, "the README's first two commands")
	main, err := os.ReadFile(filepath.Join(root, "cmd", "idempotency-extproc", "main.go"))
	require.NoError(t, err)
	require.Contains(t, string(main), "package main\n")
	makefile, err := os.ReadFile(filepath.Join(root, "Makefile"))
	require.NoError(t, err)
	require.Regexp(t, `(?m)^test:`, string(makefile))
	ci, err := os.ReadFile(filepath.Join(root, ".ci", "run"))
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(ci)), "\n")
	require.Equal(t, "make test", lines[len(lines)-1], ".ci/run ends by running the README's test command")
}
