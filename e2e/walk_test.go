package e2e_test

import (
	"bufio"
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const module = "github.com/idempotency-extproc/idempotency-extproc/"

// TestArchitectureWalk holds docs/architecture.md's walk to the program: the product functions
// one covered request passes are the ones the walk lists, no more and no fewer, and the count it
// gives is theirs. The program is built as shipped but with coverage counters
// (go build -cover -covermode=atomic), started with no flags (the memory store and the embedded
// default policy) behind the shipped envoy/envoy.yaml, and stopped by SIGTERM, twice: once
// after one POST with an Idempotency-Key, once after two with different keys. A function whose
// counters differ between the two runs is one the second request passed: the walk of one
// request, without what only the first request of a process or a connection does. The store's
// own code (package cache) and the decoder's (package extproc/wire) are counted apart: the walk
// stops at their calls (see apart). `make walk` prints the list.
func TestArchitectureWalk(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "idempotency-extproc")
	build := exec.Command("go", "build", "-tags", "vtprotobuf", "-cover", "-covermode=atomic",
		"-coverpkg=../cmd/...,../extproc/...,../cache/...,../internal/...", "-o", bin, "../cmd/idempotency-extproc")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)

	one, two := requestCounters(t, bin, 1), requestCounters(t, bin, 2)
	walk, store, decoder, ran := walkOf(t, one, two)
	t.Logf("the walk of one request: %d functions\n%s", len(walk), strings.Join(walk, "\n"))
	t.Logf("and in the store's own code (package cache): %d functions\n%s", len(store), strings.Join(store, "\n"))
	t.Logf("and in the decoder of Envoy's messages (package extproc/wire): %d functions\n%s", len(decoder), strings.Join(decoder, "\n"))

	always, sometimes, count, documentedTypes := documentedWalk(t)
	doc, err := os.ReadFile("../docs/architecture.md")
	require.NoError(t, err)
	apartCount := regexp.MustCompile(`extproc/wire` + "`" + ` \(its\s+(\d+) functions`).FindSubmatch(doc)
	require.NotNil(t, apartCount, "docs/architecture.md gives the decoder's count")
	require.Equal(t, strconv.Itoa(len(decoder)), string(apartCount[1]), "the decoder's functions docs/architecture.md counts")
	var missing, extra []string
	for _, n := range always {
		if !slices.Contains(walk, n) {
			missing = append(missing, n)
		}
	}
	for _, n := range walk {
		if !slices.Contains(always, n) && !slices.Contains(sometimes, n) {
			extra = append(extra, n)
		}
	}
	require.Empty(t, missing, "functions docs/architecture.md's walk lists that the request did not pass")
	require.Empty(t, extra, "functions the request passed that docs/architecture.md's walk does not list")
	require.Equal(t, len(always), count, "the count docs/architecture.md gives is the walk's")

	types := walkTypes(t, always, ran)
	t.Logf("the types it passes: %d\n%s", len(types), strings.Join(types, "\n"))
	slices.Sort(documentedTypes)
	require.Equal(t, types, documentedTypes, "the types docs/architecture.md's walk lists are those the walk's code that ran passes")
}

// The counts docs/architecture.md's walk gives are those of the names it lists: each step's
// (N), the functions' total, the types' and the names'. (TestArchitectureWalk holds the names
// to the program.)
func TestArchitectureWalkCounts(t *testing.T) {
	always, _, count, _ := documentedWalk(t)
	require.Equal(t, len(always), count, "That is N functions: the functions outside parentheses")
}

// blockCounts are a run's coverage counters: per file and block (its first and last line and
// column, "file:l.c,l.c"), the times the block ran.
type blockCounts map[string]int64

// requestCounters runs the covered program for n first executions and returns its counters.
func requestCounters(t *testing.T, bin string, n int) blockCounts {
	t.Helper()
	dir := t.TempDir()
	s := newStack(t, stackOptions{binary: bin, env: []string{"GOCOVERDIR=" + dir}})
	for i := range n {
		r := s.do(call{key: fmt.Sprintf("walk-%d", i), body: `{"amount":100,"currency":"EUR"}`,
			headers: map[string]string{"Authorization": "Bearer walk", "Content-Type": "application/json"}})
		require.Equal(t, 200, r.status, "%s", r.body)
		require.Equal(t, "false", r.header.Get("X-Idempotency-Replayed"))
		waitRequestLines(t, s.procs[0], i+1)
	}
	select {
	case <-s.procs[0].signal(syscall.SIGTERM):
	case <-time.After(30 * time.Second):
		t.Fatal("the processor did not exit on SIGTERM")
	}
	out, err := exec.Command("go", "tool", "covdata", "textfmt", "-i", dir, "-o", filepath.Join(dir, "profile.txt")).CombinedOutput()
	require.NoError(t, err, "%s", out)
	f, err := os.ReadFile(filepath.Join(dir, "profile.txt"))
	require.NoError(t, err)
	counts := blockCounts{}
	// file.go:line.col,line.col statements count
	block := regexp.MustCompile(`^(\S+\.go:\d+\.\d+,\d+\.\d+) \d+ (\d+)$`)
	sc := bufio.NewScanner(bytes.NewReader(f))
	for sc.Scan() {
		if m := block.FindStringSubmatch(sc.Text()); m != nil {
			c, err := strconv.ParseInt(m[2], 10, 64)
			require.NoError(t, err)
			counts[m[1]] += c
		}
	}
	require.NotEmpty(t, counts, "the covered program wrote its counters")
	return counts
}

// waitRequestLines waits until the processor has logged n request lines: the stream's last work.
func waitRequestLines(t *testing.T, p *processor, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		got := 0
		for _, l := range p.logs.lines() {
			if l["message"] == "request" {
				got++
			}
		}
		return got >= n
	}, 30*time.Second, 10*time.Millisecond, "the processor logs the request")
}

// walkOf names the functions whose blocks ran more in two than in one: those outside package
// cache (the walk), and those inside it (the store's own code), each sorted. It returns the
// blocks outside package cache that ran more too.
func walkOf(t *testing.T, one, two blockCounts) (walk, store, decoder []string, ran []block) {
	t.Helper()
	names := map[string]bool{}
	for pos, c := range two {
		if c <= one[pos] {
			continue
		}
		b := parseBlock(t, pos)
		name := enclosingFunc(t, filepath.Join("..", b.file), b.from.line)
		names[b.file+"\x00"+name] = true
		if !apart(b.file) {
			ran = append(ran, b)
		}
	}
	for k := range names {
		file, name, _ := strings.Cut(k, "\x00")
		switch {
		case strings.HasPrefix(file, "cache/"):
			store = append(store, name)
		case strings.HasPrefix(file, "extproc/wire/"):
			decoder = append(decoder, name)
		default:
			walk = append(walk, name)
		}
	}
	slices.Sort(walk)
	slices.Sort(store)
	slices.Sort(decoder)
	return slices.Compact(walk), slices.Compact(store), slices.Compact(decoder), ran
}

// apart tells the files whose functions the walk does not follow, as it stops at their calls:
// the store's (package cache) and the decoder's of Envoy's messages (package extproc/wire),
// which stands in for the generated decoder go-control-plane does not ship; the walk gives the
// decoder's count.
func apart(file string) bool {
	return strings.HasPrefix(file, "cache/") || strings.HasPrefix(file, "extproc/wire/")
}

// A block is a coverage block: a file of the module, by its path in the repository, and the
// positions its statements span.
type block struct {
	file     string
	from, to lineCol
}

type lineCol struct{ line, col int }

func (p lineCol) after(q lineCol) bool {
	return p.line > q.line || p.line == q.line && p.col > q.col
}

// parseBlock reads a blockCounts key.
func parseBlock(t *testing.T, pos string) block {
	t.Helper()
	m := regexp.MustCompile(`^(\S+\.go):(\d+)\.(\d+),(\d+)\.(\d+)$`).FindStringSubmatch(strings.TrimPrefix(pos, module))
	require.NotNil(t, m, "a coverage block: %s", pos)
	n := make([]int, 4)
	for i := range n {
		var err error
		n[i], err = strconv.Atoi(m[i+2])
		require.NoError(t, err)
	}
	return block{file: m[1], from: lineCol{n[0], n[1]}, to: lineCol{n[2], n[3]}}
}

// enclosingFunc names the function declared in file around line as the walk writes it:
// Type.method or function, after the package's name outside package extproc. A function
// literal counts as part of the function it is written in.
func enclosingFunc(t *testing.T, file string, line int) string {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, nil, parser.SkipObjectResolution)
	require.NoError(t, err)
	for _, d := range f.Decls {
		fd, ok := d.(*ast.FuncDecl)
		if ok && fset.Position(fd.Pos()).Line <= line && fset.Position(fd.End()).Line >= line {
			return funcName(f.Name.Name, fd)
		}
	}
	// A package-level value's function literal (a table's entry).
	return fmt.Sprintf("%s(%s:%d)", walkPrefix(f.Name.Name), filepath.Base(file), line)
}

// documentedWalk returns the function names docs/architecture.md's walk lists (the backquoted
// names of its numbered steps, but the store's calls, which it prints in bold): those every
// request passes, and those in parentheses, which only some requests do (the first of a process,
// one a second, one a background ticker meets). It returns the count the walk states ("That is N
// functions") and the types it lists too.
func documentedWalk(t *testing.T) (always, sometimes []string, count int, types []string) {
	t.Helper()
	b, err := os.ReadFile("../docs/architecture.md")
	require.NoError(t, err)
	doc := string(b)
	start := strings.Index(doc, "## The walk, name by name")
	require.GreaterOrEqual(t, start, 0, "docs/architecture.md has its walk")
	doc = doc[start:]
	end := regexp.MustCompile(`That is (\d+) functions`).FindStringSubmatchIndex(doc)
	require.NotNil(t, end, "the walk states its count: That is N functions")
	count, err = strconv.Atoi(doc[end[2]:end[3]])
	require.NoError(t, err)
	step := regexp.MustCompile(`(?m)^\d+\. `)
	aside := regexp.MustCompile(`\([^()]*\)`)
	name := regexp.MustCompile("(\\*\\*)?`([A-Za-z][\\w.]*)`")
	names := func(s string) (out []string) {
		for _, m := range name.FindAllStringSubmatch(s, -1) {
			if m[1] == "" {
				out = append(out, m[2])
			}
		}
		return out
	}
	stepCount := regexp.MustCompile(`\((\d+)\)`)
	for _, s := range step.Split(doc[:end[0]], -1)[1:] {
		// The files a step names are in its parenthesis, before the colon.
		_, list, ok := strings.Cut(s, "):")
		require.True(t, ok, "a step names its files, then its functions: %q", s)
		for _, o := range aside.FindAllString(list, -1) {
			sometimes = append(sometimes, names(o)...)
		}
		own := names(aside.ReplaceAllString(list, ""))
		n := stepCount.FindStringSubmatch(list)
		require.NotNil(t, n, "a step gives its count, (N), after its functions: %q", s)
		require.Equal(t, n[1], strconv.Itoa(len(own)), "the count a step gives is its functions outside parentheses: %q", s)
		always = append(always, own...)
	}
	// The types follow, with their count, and the total of names.
	listed := regexp.MustCompile(`(?s)The types it passes:\s+(.*?)\s+\((\d+)\)\.\s+In all (\d+) names`).FindStringSubmatch(doc[end[0]:])
	require.NotNil(t, listed, "the walk lists its types, their count (N), and In all N names")
	types = names(listed[1])
	require.Equal(t, listed[2], strconv.Itoa(len(types)), "the types' count is the types listed")
	require.Equal(t, listed[3], strconv.Itoa(count+len(types)), "In all N names: the functions and the types")
	slices.Sort(always)
	return always, sometimes, count, types
}
