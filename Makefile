# Targets explain themselves: `make help`.
GO ?= go
STATICCHECK ?= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2
# A count, not a duration: with a duration Go's fuzzer can fail with "context deadline
# exceeded" when a worker is slow to stop on a loaded machine.
FUZZTIME ?= 10000x
# How hard the fuzzer minimizes an input it keeps, also a count: Go's default is 60 seconds per
# input, which a short run can spend on one new input alone.
FUZZMINIMIZE ?= 1000x
# test-busy: how many CPU-bound processes run beside the suite (two fill a two-core machine).
HOGS ?= 2
PKGS := ./...
# What `version`, the ready log line and idempotency_build_info report, linked into the binary so
# that a build reports them also where the Go toolchain records no VCS information
# (GOFLAGS=-buildvcs=false). Without a tag, VERSION is empty and the binary says devel+REVISION.
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
VERSION ?= $(shell git describe --tags --dirty 2>/dev/null)
LDFLAGS := -X main.version=$(VERSION) -X main.revision=$(REVISION)
BIN ?= bin/idempotency-extproc
# Every build and test is of the binary the image builds: with go-control-plane's generated
# encoders (extproc/codec.go). One set of build flags lets the tests, the end-to-end binary and
# the walk share their compiled packages.
GOFLAGS ?= -tags=vtprotobuf
export GOFLAGS

.PHONY: help build test test-busy lint unit allocs bench bench-compare bench-inside bench-costs fuzz run deploy-test demo walk

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## the binary at BIN (bin/idempotency-extproc), with its version and revision from git
	$(GO) build -tags vtprotobuf -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/idempotency-extproc

test: lint unit allocs bench fuzz deploy-test ## the whole suite, as CI runs it: lint, race tests, allocation tests, benchmarks once, short fuzzing, deploy/

test-busy: ## make test beside HOGS CPU-bound processes, killed however it ends: the suite must hold on a busy machine
	@hogs=""; for i in $$(seq $(HOGS)); do yes >/dev/null & hogs="$$hogs $$!"; done; \
	trap 'kill $$hogs 2>/dev/null' EXIT; trap 'exit 130' INT TERM HUP; \
	echo "test-busy: make test beside $(HOGS) CPU-bound processes (pids$$hogs)"; \
	$(MAKE) test

lint: ## gofmt, go vet and staticcheck must be clean
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(STATICCHECK) $(PKGS)

unit: ## every test with the race detector
	$(GO) test -race -count=1 -timeout 15m $(PKGS)

allocs: ## the tests that count allocations, without the race detector, which adds its own
	$(GO) test -count=1 -run 'CopiesOnce|ReusesItsBuffer' ./cache/

bench: ## every benchmark once, so they keep compiling and running
	$(GO) test -run '^$$' -bench . -benchtime 1x -benchmem -count=1 $(PKGS)

deploy-test: ## deploy/test, a module of its own: the Helm chart, dashboard, alerts, Dockerfile and CI workflow
	cd deploy/test && $(GO) vet ./... && $(STATICCHECK) ./... && $(GO) test -count=1 -timeout 15m ./...

walk: ## the product functions and types one covered request passes, from the program itself: docs/architecture.md's walk
	$(GO) test -count=1 -run '^TestArchitectureWalk$$' -v ./e2e/ | sed -n '/the walk of one request/,/^---/p'

demo: ## try it without Docker: the processor, the Envoy emulator and a demo upstream on loopback (e2e/demo/README.md)
	$(GO) run ./e2e/demo

bench-compare: ## the shipped binary, as the chart starts it, against a null and a naive Redis processor: docs/performance.md (needs redis-server)
	$(GO) run ./e2e/bench -mode user -duration 9s -rounds 3

bench-inside: ## where the processor's cost goes: store calls, Redis commands and latency per workload and body mode, served by the benchmark itself (needs redis-server, redis-benchmark)
	$(GO) run -tags vtprotobuf ./e2e/bench -duration 10s -rounds 5

bench-costs: ## what features, body sizes and streams cost over the null processor, docs/performance.md (needs redis-server, redis-benchmark)
	$(GO) run -tags vtprotobuf ./e2e/bench -mode costs -duration 10s -rounds 5

run: ## the server on the embedded memory store with envoy/policy.yaml: ext_proc gRPC on :9002, admin HTTP on :9003
	$(GO) run -ldflags "$(LDFLAGS)" ./cmd/idempotency-extproc --store memory --config envoy/policy.yaml --log-format console

fuzz: ## each fuzz target for FUZZTIME (seed corpora in each package's testdata/fuzz)
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeResponse$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./cache/
	$(GO) test -run '^$$' -fuzz '^FuzzParseKey$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./extproc/
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeRequest$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./extproc/wire/
	$(GO) test -run '^$$' -fuzz '^FuzzStreamMessages$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./extproc/
	$(GO) test -run '^$$' -fuzz '^FuzzJSONStreamMessages$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./extproc/
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./extproc/policy/
	$(GO) test -run '^$$' -fuzz '^FuzzOpen$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./cache/seal/
	$(GO) test -run '^$$' -fuzz '^FuzzParseKeyring$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./cache/seal/
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeSealedResponse$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./cache/
	$(GO) test -run '^$$' -fuzz '^FuzzReadBootstrap$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./internal/check/
	$(GO) test -run '^$$' -fuzz '^FuzzReadKubernetes$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./internal/check/
	$(GO) test -run '^$$' -fuzz '^FuzzParsePointer$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./extproc/jsonbody/
	$(GO) test -run '^$$' -fuzz '^FuzzCanonical$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./extproc/jsonbody/
	$(GO) test -run '^$$' -fuzz '^FuzzReplaceID$$' -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINIMIZE) ./extproc/jsonbody/
