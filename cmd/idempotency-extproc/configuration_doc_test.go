package main

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-extproc/idempotency-extproc/extproc/policy"
)

// settingsTable is docs/configuration.md's table of the program's settings, written from
// allSettings.
func settingsTable() string {
	var b strings.Builder
	b.WriteString("| flag | env | file key | default | meaning |\n| --- | --- | --- | --- | --- |\n")
	for _, s := range allSettings {
		key := "none"
		if !s.notInFile {
			key = "`" + s.fileKey() + "`"
		}
		b.WriteString("| `--" + s.name + "` | `" + s.env() + "` | " + key + " | " + code(s.def) + " | " + cell(s.markdown()) + " |\n")
	}
	return b.String()
}

// policyTable is docs/configuration.md's table of the policy file's fields, written from
// policy.Fields().
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

// configurationDoc is the path of the page that documents every setting, from this directory.
const configurationDoc = "../../docs/configuration.md"

// readConfigurationDoc returns docs/configuration.md.
func readConfigurationDoc(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(configurationDoc)
	require.NoError(t, err)
	return string(data)
}

// docs/configuration.md lists every setting and every policy field with its default, as the
// tables the program runs on say, once: when this fails, paste the text it prints over the page's
// two tables.
func TestConfigurationDocListsEverySetting(t *testing.T) {
	doc := readConfigurationDoc(t)
	var missing []string
	for _, table := range []string{settingsTable(), policyTable()} {
		switch strings.Count(doc, table) {
		case 0:
			missing = append(missing, table)
		case 1:
		default:
			t.Errorf("docs/configuration.md holds this table more than once; keep one:\n\n%s", table)
		}
	}
	require.Empty(t, missing, "docs/configuration.md lacks these tables as the code has them; paste them over its tables:\n\n%s",
		strings.Join(missing, "\n"))
}

// Every policy file docs/configuration.md shows (each yaml block) is one the program takes.
func TestConfigurationDocPolicyExamplesParse(t *testing.T) {
	doc := readConfigurationDoc(t)
	blocks := regexp.MustCompile("(?s)```yaml\n(.*?)```").FindAllStringSubmatch(doc, -1)
	require.NotEmpty(t, blocks, "a YAML example")
	for _, b := range blocks {
		_, _, err := policy.ParseFile([]byte(b[1]), fileSettings(allSettings))
		require.NoError(t, err, "docs/configuration.md example:\n%s", b[1])
	}
}
