package extproc_test

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc"
	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// outcomesDoc is the page that documents what a client sees, from this directory.
const outcomesDoc = "../docs/outcomes.md"

// problemRow is one row of docs/outcomes.md's table of problem codes.
type problemRow struct {
	line  int
	cells []string // code, status, Retry-After, outcome, when
}

// problemCodeRows returns the rows of the table under the heading "## Problem codes" of md, by
// code. It fails when the section or its table is missing.
func problemCodeRows(t *testing.T, md string) map[string][]problemRow {
	t.Helper()
	lines := strings.Split(md, "\n")
	start := -1
	for i, l := range lines {
		if l == "## Problem codes" {
			start = i
			break
		}
	}
	require.GreaterOrEqual(t, start, 0, "docs/outcomes.md has a \"## Problem codes\" section")
	rows := map[string][]problemRow{}
	header := false
	for i := start + 1; i < len(lines) && !strings.HasPrefix(lines[i], "## "); i++ {
		l := strings.TrimSpace(lines[i])
		if !strings.HasPrefix(l, "|") {
			continue
		}
		cells := strings.Split(strings.Trim(l, "|"), "|")
		for j := range cells {
			cells[j] = strings.TrimSpace(cells[j])
		}
		switch {
		case !header:
			require.Equal(t, []string{"code", "status", "Retry-After", "outcome", "when"}, cells, "docs/outcomes.md:%d: the problem codes table's header", i+1)
			header = true
			continue
		case strings.Trim(cells[0], "-: ") == "":
			continue // the delimiter row
		}
		require.Len(t, cells, 5, "docs/outcomes.md:%d: a row of five cells", i+1)
		code := strings.Trim(cells[0], "`")
		rows[code] = append(rows[code], problemRow{line: i + 1, cells: cells})
	}
	require.True(t, header, "docs/outcomes.md's Problem codes section has a table")
	return rows
}

// Every problem code the processor answers with has exactly one row in docs/outcomes.md's table
// of problem codes, whose status, Retry-After and outcome are the code's; the table lists no
// other code.
func TestOutcomesDocListsEveryProblemCode(t *testing.T) {
	data, err := os.ReadFile(outcomesDoc)
	require.NoError(t, err)
	rows := problemCodeRows(t, string(data))
	answers, disagreeing := extproc.ProblemAnswers()
	require.Empty(t, disagreeing, "problems that share a code must answer alike, or one row cannot document them")

	for _, code := range extproc.ProblemCodes() {
		got := rows[code]
		require.NotEmpty(t, got, "docs/outcomes.md's table of problem codes has no row for %s", code)
		if len(got) > 1 {
			lines := make([]int, len(got))
			for i, r := range got {
				lines[i] = r.line
			}
			require.Failf(t, "a problem code listed twice", "docs/outcomes.md's table of problem codes lists %s on lines %v; keep one row", code, lines)
		}
		cells, want := got[0].cells, answers[code]
		require.Equal(t, strconv.Itoa(want.Status), cells[1], "docs/outcomes.md:%d: the status of %s", got[0].line, code)
		retryAfter := "no"
		if want.RetryAfter {
			retryAfter = "`1`"
		}
		require.Equal(t, retryAfter, cells[2], "docs/outcomes.md:%d: the Retry-After of %s", got[0].line, code)
		require.Equal(t, "`"+string(want.Outcome)+"`", cells[3], "docs/outcomes.md:%d: the outcome of %s", got[0].line, code)
		require.NotEmpty(t, cells[4], "docs/outcomes.md:%d: when %s is answered", got[0].line, code)
	}
	for code, got := range rows {
		require.Contains(t, extproc.ProblemCodes(), code, "docs/outcomes.md:%d: %s is not a problem code of extproc/outcome.go", got[0].line, code)
	}
}

// The codes a policy's problems entries may restyle are exactly the codes the processor answers
// with: a code missing from policy.ProblemCodes could not be restyled, and one only there would be
// accepted and never used.
func TestPolicyKnowsEveryProblemCode(t *testing.T) {
	require.ElementsMatch(t, extproc.ProblemCodes(), policy.ProblemCodes)
}
