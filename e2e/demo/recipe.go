package main

import (
	_ "embed"
	"errors"
	"fmt"
	"strings"
)

// readme is this directory's README.md: the demo prints its recipe and the test runs it, so the
// page, the banner and the test cannot disagree.
//
//go:embed README.md
var readme string

// recipeURL is the emulator's address as the recipe writes it (the -listen default); the banner
// prints the address the demo really listens on.
const recipeURL = "http://127.0.0.1:10000"

// recipeSection is the README section whose steps are the recipe.
const recipeSection = "## The recipe"

// step is one step of the recipe: a "### " heading of the recipe section and the lines of the one
// ```sh block under it (blank lines dropped).
type step struct {
	title    string
	commands []string
}

// recipe returns the steps of the README's recipe section. It fails on a step without a sh block
// or with two, on an unclosed block and on a README without steps.
func recipe(md string) ([]step, error) {
	var (
		steps     []step
		inSection bool
		fenced    bool // inside a ``` block
		keep      bool // that block is the current step's sh block
		opened    int  // the line that opened it
	)
	for i, line := range strings.Split(md, "\n") {
		n := i + 1
		switch {
		case fenced:
			if strings.HasPrefix(line, "```") {
				fenced, keep = false, false
			} else if keep && strings.TrimSpace(line) != "" {
				steps[len(steps)-1].commands = append(steps[len(steps)-1].commands, line)
			}
		case strings.HasPrefix(line, "```"):
			fenced, opened = true, n
			if inSection && len(steps) > 0 && strings.TrimPrefix(line, "```") == "sh" {
				if len(steps[len(steps)-1].commands) > 0 {
					return nil, fmt.Errorf("line %d: step %q has a second sh block", n, steps[len(steps)-1].title)
				}
				keep = true
			}
		case strings.HasPrefix(line, "## "):
			inSection = strings.TrimSpace(line) == recipeSection
		case inSection && strings.HasPrefix(line, "### "):
			steps = append(steps, step{title: strings.TrimSpace(strings.TrimPrefix(line, "### "))})
		}
	}
	if fenced {
		return nil, fmt.Errorf("line %d: code block not closed", opened)
	}
	if len(steps) == 0 {
		return nil, errors.New(`no steps: "### " headings under "` + recipeSection + `"`)
	}
	for _, st := range steps {
		if len(st.commands) == 0 {
			return nil, fmt.Errorf("step %q has no sh block", st.title)
		}
	}
	return steps, nil
}
