package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/idempotency-extproc/idempotency-extproc/internal/check"
)

const checkUsage = `usage: idempotency-extproc check --config POLICY [--format text|json] [--envoy-version 1.38] [FILE…]

Checks the Envoy, Istio or Envoy Gateway configuration in each FILE against the policy the
server runs, and reports every setting that silently breaks protection (an error) or costs
something you should know (a warning). A FILE is an Envoy bootstrap (YAML or JSON) or Kubernetes
YAML: helm template output, kubectl get -o yaml, List kinds. "-" reads standard input. Without a
FILE, check validates the policy file as the server does at start-up.

Text output: one line per finding, errors first:
  FILE: RESOURCE: FIELD: severity: what breaks; the fix
Exit status: 0 no error (warnings allowed), 1 at least one error, 2 a file cannot be read or parsed.

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

// checkCommand checks deployment files against a policy (check.Run). The policy is loaded as
// the server loads it at start-up (loadConfig with --config and no environment), so a policy
// check passes exactly when the server would start on it.
func checkCommand(args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("idempotency-extproc check", flag.ContinueOnError)
	configPath := fs.String("config", "", "the server's YAML policy file (required)")
	format := fs.String("format", "text", "text or json")
	version := fs.String("envoy-version", "", "the Envoy version the deployment runs, e.g. 1.38: adds the warnings of its known ext_proc defects")
	if done, err := parseCommandFlags(fs, args, checkUsage, stdout); done {
		if err != nil {
			return &exitError{checkBadFile, err}
		}
		return nil
	}
	switch {
	case *configPath == "":
		return &exitError{checkBadFile, errors.New("check: --config is required (the server's policy file)")}
	case *format != "text" && *format != "json":
		return &exitError{checkBadFile, fmt.Errorf("check: --format must be text or json, got %q", *format)}
	}
	cfg, err := loadConfig([]string{"--config", *configPath}, func(string) string { return "" })
	if err != nil {
		return &exitError{checkBadFile, fmt.Errorf("check: %w", err)}
	}
	files := fs.Args()
	if len(files) == 0 {
		if *version != "" {
			return &exitError{checkBadFile, errors.New("check: --envoy-version needs a FILE to check")}
		}
		if *format == "json" {
			_, err := fmt.Fprintln(stdout, "[]")
			return err
		}
		_, err := fmt.Fprintf(stdout, "%s: the policy is valid\n", *configPath)
		return err
	}
	var inputs []check.Input
	var readErrs []error
	for _, name := range files {
		var data []byte
		var err error
		if name == "-" {
			data, err = io.ReadAll(stdin)
		} else {
			data, err = os.ReadFile(name)
		}
		if err != nil {
			readErrs = append(readErrs, fmt.Errorf("%s: %w", name, unwrapPath(err)))
			continue
		}
		inputs = append(inputs, check.Input{Name: name, Data: data})
	}
	if err := errors.Join(readErrs...); err != nil {
		return &exitError{checkBadFile, fmt.Errorf("check: %w", err)}
	}
	rep, err := check.Run(cfg.policy, inputs, check.Options{EnvoyVersion: *version})
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
	if len(rep.Skipped) > 0 {
		b.WriteString("skipped (kinds check does not read): " + strings.Join(rep.Skipped, ", ") + "\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}
