package main

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// settingsTable is the README's table of the program's settings, written from settings().
func settingsTable() string {
	var b strings.Builder
	b.WriteString("| flag | env | file key | default | meaning |\n| --- | --- | --- | --- | --- |\n")
	for _, s := range settings() {
		key := "none"
		if !s.notInFile {
			key = "`" + s.fileKey() + "`"
		}
		b.WriteString("| `--" + s.name + "` | `" + s.env() + "` | " + key + " | " + code(s.def) + " | " + cell(s.markdown()) + " |\n")
	}
	return b.String()
}

// policyTable is the README's table of the policy file's fields, written from policy.Fields().
func policyTable() string {
	var b strings.Builder
	b.WriteString("| field | where | default | meaning |\n| --- | --- | --- | --- |\n")
	for _, f := range policy.Fields() {
		def := "none"
		if f.Default != "none" {
			def = code(f.Default)
		}
		b.WriteString("| `" + f.Key + "` | " + f.Where + " | " + def + " | " + cell(f.Doc) + " |\n")
	}
	return b.String()
}

func code(v string) string {
	if v == "" {
		return "none"
	}
	return "`" + v + "`"
}

// cell escapes what would end a Markdown table cell.
func cell(s string) string { return strings.ReplaceAll(s, "|", `\|`) }

// readmeConfiguration returns the README's Configuration section.
func readmeConfiguration(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	readme := string(data)
	start := strings.Index(readme, "\n## Configuration\n")
	require.GreaterOrEqual(t, start, 0, "README.md has a Configuration section")
	section := readme[start+1:]
	if end := strings.Index(section[3:], "\n## "); end >= 0 {
		section = section[:end+3]
	}
	return section
}

// The README's Configuration section lists every setting and every policy field with its
// default, as the tables the program runs on say: when this fails, paste the text it prints
// (docs/notes/policy.md holds it too) over the README's two tables.
func TestREADMEListsEverySetting(t *testing.T) {
	section := readmeConfiguration(t)
	var missing []string
	for _, table := range []string{settingsTable(), policyTable()} {
		if !strings.Contains(section, table) {
			missing = append(missing, table)
		}
	}
	require.Empty(t, missing, "README.md's Configuration section lacks these tables as the code has them; paste them over its tables:\n\n%s",
		strings.Join(missing, "\n"))
}

// The policy file the README's Configuration section shows is one the program takes.
func TestREADMEPolicyExampleParses(t *testing.T) {
	section := readmeConfiguration(t)
	blocks := regexp.MustCompile("(?s)```yaml\n(.*?)```").FindAllStringSubmatch(section, -1)
	require.NotEmpty(t, blocks, "a YAML example")
	for _, b := range blocks {
		_, _, err := policy.ParseFile([]byte(b[1]), fileSettings(settings()))
		require.NoError(t, err, "README example:\n%s", b[1])
	}
}
