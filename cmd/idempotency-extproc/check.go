package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
	"github.com/idempotency-extproc/idempotency-extproc/internal/yamllimit"
)

const checkUsage = `usage: idempotency-extproc check --config POLICY [--format text|json] [--envoy-version 1.38] [serve's flags] [FILE…]

Checks the Envoy, Istio or Envoy Gateway configuration in each FILE against the policy the
server runs, and reports every setting that silently breaks protection (an error) or costs
something you should know (a warning). A FILE is an Envoy bootstrap (YAML or JSON) or Kubernetes
YAML: helm template output, kubectl get -o yaml, List kinds. "-" reads standard input.

First it validates the whole configuration as the server does at start-up: the policy file and
every flag and environment variable of serve (--store, the Redis settings, durability, ...),
so give it the server's flags and environment. It connects to nothing and reads no secret: a
secret file that is not there yet is noted on stderr. Without a FILE, that is all it does.

Text output: one line per finding, errors first:
  FILE:LINE:COLUMN: RESOURCE: FIELD: severity: what breaks; the fix
or, without findings, one line saying what was checked ("ok: 3 routes protected in 2 files").

Each input is read up to --max-input-bytes; its YAML may hold one value per 32 of those bytes,
nested at most 100 deep, and a mapping at most 5000 keys. Standard input is named <stdin>.

Exit status: 0 no error (warnings allowed), 1 at least one error, 2 a file cannot be read or
parsed or is beyond those bounds. SIGTERM or SIGINT ends check at once.

`

// exitError is an error that ends the process with its own exit status.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// ExitCode is the status the process exits with.
func (e *exitError) ExitCode() int { return e.code }

// Exit statuses of check.
const (
	checkFound   = 1 // at least one error finding
	checkBadFile = 2 // the policy or a FILE cannot be read or parsed
)

// checkCommand checks deployment files against the configuration the server would run with
// (check.Run). It takes every setting of serve, from its flags and the environment (getenv) as
// serve does, and validates them with the server's own start-up validation (startupConfig),
// which reads no secret and connects to nothing: a check passes exactly when the server would
// start with the same flags and environment. A secret file that is not there yet is noted on
// stderr, not refused.
func checkCommand(args []string, getenv func(string) string, stdin io.Reader, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idempotency-extproc check", flag.ContinueOnError)
	format := fs.String("format", "text", "text or json")
	version := fs.String("envoy-version", "", "the Envoy version the deployment runs, e.g. 1.38: adds the warnings of its known ext_proc defects")
	// The server's settings, as serve takes them; --config is required here.
	for _, s := range allSettings {
		fs.String(s.name, s.def, s.flagUsage())
	}
	maxInput := fs.Int64("max-input-bytes", check.DefaultMaxInputBytes, "the most `bytes` each FILE (and standard input) may hold; their YAML may hold one value per "+strconv.Itoa(yamllimit.BytesPerValue)+" of them, nested at most "+strconv.Itoa(yamllimit.MaxDepth)+" deep")
	if done, err := parseCommandFlags(fs, args, checkUsage, stdout); done {
		if err != nil {
			return &exitError{checkBadFile, err}
		}
		return nil
	}
	serverArgs, configGiven := serverSettingsGiven(fs, getenv)
	switch {
	case !configGiven:
		return &exitError{checkBadFile, errors.New("check: --config is required (the server's policy file)")}
	case *format != "text" && *format != "json":
		return &exitError{checkBadFile, fmt.Errorf("check: --format must be text or json, got %q", *format)}
	case *maxInput <= 0:
		return &exitError{checkBadFile, fmt.Errorf("check: --max-input-bytes must be positive, got %d", *maxInput)}
	}
	cfg, err := startupConfig(serverArgs, getenv, true)
	if err != nil {
		return &exitError{checkBadFile, fmt.Errorf("check: %w", err)}
	}
	for _, n := range cfg.notes {
		if _, err := fmt.Fprintln(stderr, "note: "+n); err != nil {
			return err
		}
	}
	files := fs.Args()
	if len(files) == 0 {
		if *version != "" {
			return &exitError{checkBadFile, errors.New("check: --envoy-version needs a FILE to check")}
		}
		return writePolicyValid(stdout, cfg.configPath, *format)
	}
	inputs, err := readCheckInputs(files, stdin, *maxInput)
	if err != nil {
		return &exitError{checkBadFile, fmt.Errorf("check: %w", err)}
	}
	policyData, _ := os.ReadFile(cfg.configPath) // start-up read it: only for the findings' lines
	rep, err := check.Run(cfg.policy, inputs, check.Options{EnvoyVersion: *version, MaxInputBytes: *maxInput, Policy: check.Input{Name: cfg.configPath, Data: policyData}})
	if err != nil {
		return &exitError{checkBadFile, fmt.Errorf("check: %w", err)}
	}
	if err := writeReport(stdout, rep, *format); err != nil {
		return err
	}
	if n := rep.Errors(); n > 0 {
		return &exitError{checkFound, fmt.Errorf("check: %d error(s): protection breaks with this configuration", n)}
	}
	return nil
}

// serverSettingsGiven are the server's settings given as check's flags, as server arguments,
// and whether the policy file is named (by --config or IDEMPOTENCY_CONFIG).
func serverSettingsGiven(fs *flag.FlagSet, getenv func(string) string) (serverArgs []string, configGiven bool) {
	configGiven = getenv("IDEMPOTENCY_CONFIG") != ""
	fs.Visit(func(f *flag.Flag) {
		if slices.ContainsFunc(allSettings, func(s setting) bool { return s.name == f.Name }) {
			serverArgs = append(serverArgs, "--"+f.Name+"="+f.Value.String())
		}
		configGiven = configGiven || f.Name == "config"
	})
	return serverArgs, configGiven
}

// writePolicyValid is the report of a check of the policy alone, which start-up validated.
func writePolicyValid(stdout io.Writer, configPath, format string) error {
	if format == "json" {
		_, err := fmt.Fprintln(stdout, "[]")
		return err
	}
	_, err := fmt.Fprintf(stdout, "%s: the policy is valid\n", configPath)
	return err
}

// readCheckInputs reads the files to check ("-" is stdin), each of at most maxInput bytes; its
// error names every file that could not be read.
func readCheckInputs(files []string, stdin io.Reader, maxInput int64) ([]check.Input, error) {
	var inputs []check.Input
	var readErrs []error
	for _, name := range files {
		in, err := readCheckInput(name, stdin, maxInput)
		if err != nil {
			readErrs = append(readErrs, err)
			continue
		}
		inputs = append(inputs, in)
	}
	return inputs, errors.Join(readErrs...)
}

// unwrapPath drops the operation and path of an *os.PathError, which the caller names.
func unwrapPath(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// writeReport prints the findings: a JSON array of findings, or one line each and a line naming
// the objects skipped.
func writeReport(w io.Writer, rep check.Report, format string) error {
	if format == "json" {
		findings := rep.Findings
		if findings == nil {
			findings = []check.Finding{}
		}
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(findings)
	}
	var b strings.Builder
	for _, f := range rep.Findings {
		b.WriteString(f.String() + "\n")
	}
	if len(rep.Findings) == 0 {
		fmt.Fprintf(&b, "ok: %s protected in %s\n", plural(rep.Routes, "route"), plural(rep.Files, "file"))
	}
	if len(rep.Skipped) > 0 {
		b.WriteString("skipped (kinds check does not read): " + strings.Join(rep.Skipped, ", ") + "\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// plural is "1 route", "2 routes".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
