# vmflow build, test and tool installation. Every target works on a fresh
# Debian machine as root: what the tests need is installed here, from the
# Go module proxy and Debian's archive only.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := build

GO        ?= go
BIN       := $(CURDIR)/bin
TEMPORAL  := $(BIN)/temporal
STATICCHECK := $(BIN)/staticcheck
WORKFLOWCHECK := $(BIN)/workflowcheck

TEMPORAL_VERSION    := v1.5.1
# The self-hosted server (the one CLI v1.5.1 embeds) and its SQL tool, for
# the PostgreSQL backend of the tests (testsupport/devserver.StartPostgres) and
# make bench-fleet. The harness reads this version from the binary.
TEMPORAL_SERVER_VERSION := v1.29.1
TEMPORAL_SERVER   := $(BIN)/temporal-server
TEMPORAL_SQL_TOOL := $(BIN)/temporal-sql-tool
STATICCHECK_VERSION := v0.8.2
WORKFLOWCHECK_VERSION := v0.6.0
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO := $(BIN)/protoc-gen-go
PROTO_FILES := $(wildcard proto/vmflow/v1/*.proto)

# A platform API's module (own go.mod, replace to this one): `go test ./...`
# and `go vet ./...` skip nested modules, so test, vet and staticcheck run it
# explicitly. It proves the public surface (vmflow/platform, workflows) is
# enough and that a client on the SDK's default data converter works.
PLATFORMAPI := examples/platformapi

# The whole suite, e2e included, must stay well inside CI's 90 minutes.
TEST_TIMEOUT ?= 25m
FUZZTIME     ?= 30s

export GOBIN := $(BIN)

.PHONY: build tools qemu prometheus test lint fmt-check vet staticcheck workflowcheck fuzz bench bench-smoke clean proto proto-check proto-tools

## build: both binaries and the vGPU simulator (bin/vmflow-vgpusim, for
# tests and make dev; the agent carries no simulator), stamped with VERSION (git describe) and REVISION
# (the commit): `--version` prints them, the start line logs them, and
# /metrics has them in vmflow_build_info.
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
LDFLAGS  := -X vmflow/internal/service.version=$(VERSION) -X vmflow/internal/service.revision=$(REVISION)

build:
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/vmflow-hostagent ./hostagent
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/vmflow-vgpusim ./hostagent/gpu/vgpusim/cmd/vmflow-vgpusim
	@if [ -d worker ]; then $(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/vmflow-worker ./worker; fi
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/vmflow ./cmd/vmflow

## print-ldflags: the -ldflags `make build` uses (a test builds with them).
.PHONY: print-ldflags
print-ldflags:
	@echo '$(LDFLAGS)'

## tools: the Temporal CLI (dev server + UI), the Temporal server on
# PostgreSQL, QEMU (and GNU cpio), Chromium (e2e Web UI test), Prometheus
# (promtool for the alert rules' tests, the server for the e2e's) and
# Jaeger (the e2e tracing test).
tools: $(TEMPORAL) temporal-server postgresql qemu chromium prometheus jaeger

## jaeger: bin/jaeger, Jaeger v2 (the OpenTelemetry Collector with Jaeger's
# storage and query API) for e2e/trace_test.go, built from a module of its
# own, tools/jaeger (`go get -tool .../cmd/jaeger@VERSION` made it): Jaeger's
# go.mod has replace directives, so `go install` refuses it, and its
# dependencies stay out of vmflow's go.mod. Rebuilt only when missing or
# another version than tools/jaeger/go.mod names (`go version -m`). Measured
# here: ~260 MB of modules (24 s), ~7 min of CPU cold on 2 cores, 8 s warm.
# tools/jaeger is not `go mod tidy`'d: tidy adds the checksums of every test
# dependency of Jaeger, downloads the build does not need. The binary serves
# no UI (its assets come from an npm build): the tests use the query API.
JAEGER := $(BIN)/jaeger
JAEGER_MODULE := tools/jaeger
JAEGER_VERSION = $(shell awk '$$1 == "github.com/jaegertracing/jaeger" {print $$2}' $(JAEGER_MODULE)/go.mod)
.PHONY: jaeger
jaeger:
	@have=$$( { $(GO) version -m "$(JAEGER)" 2>/dev/null || true; } | awk '$$1 == "path" {p = $$2} $$1 == "mod" {print p " " $$2 "@" $$3}'); \
	if [ "$$have" != "github.com/jaegertracing/jaeger/cmd/jaeger github.com/jaegertracing/jaeger@$(JAEGER_VERSION)" ]; then \
		echo ">> building Jaeger $(JAEGER_VERSION) from $(JAEGER_MODULE) into bin/jaeger (minutes the first time)"; \
		(cd $(JAEGER_MODULE) && GOWORK=off $(GO) build -o "$(JAEGER).tmp" github.com/jaegertracing/jaeger/cmd/jaeger); \
		mv "$(JAEGER).tmp" "$(JAEGER)"; \
	fi

## temporal-server: bin/temporal-server and bin/temporal-sql-tool from the
# module proxy (go.temporal.io/server, no replace directives), rebuilt only
# when missing or another version (`go version -m` names the package and module version).
# ~3.5 minutes cold on 2 cores; cached in bin/ like the CLI. Their schema
# (schema/postgresql/v12) stays in the module cache, where the harness
# finds it.
.PHONY: temporal-server
temporal-server:
	@for p in server:$(TEMPORAL_SERVER) tools/sql:$(TEMPORAL_SQL_TOOL); do \
		pkg=$${p%%:*} out=$${p#*:}; \
		have=$$( { $(GO) version -m "$$out" 2>/dev/null || true; } | awk '$$1 == "path" {p = $$2} $$1 == "mod" {print p " " $$2 "@" $$3}'); \
		if [ "$$have" != "go.temporal.io/server/cmd/$$pkg go.temporal.io/server@$(TEMPORAL_SERVER_VERSION)" ]; then \
			echo ">> building go.temporal.io/server/cmd/$$pkg@$(TEMPORAL_SERVER_VERSION) into $$out (minutes the first time)"; \
			tmp=$$(mktemp -d); \
			GOBIN=$$tmp $(GO) install go.temporal.io/server/cmd/$$pkg@$(TEMPORAL_SERVER_VERSION); \
			mv "$$tmp/$${pkg##*/}" "$$out"; rmdir "$$tmp"; \
		fi; \
	done

## postgresql: Debian's PostgreSQL server programs (initdb, postgres); the
# tests run their own cluster, never the package's.
.PHONY: postgresql
postgresql:
	@if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then \
		echo ">> installing Debian's postgresql"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	fi

.PHONY: chromium
chromium:
	@if ! command -v chromium >/dev/null; then \
		echo ">> installing Debian's chromium (headless, for the e2e Web UI test)"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	fi

## prometheus: Debian's prometheus package (2.42): promtool, which
# checks deploy/prometheus/vmflow-rules.yml and runs its unit tests
# (deploy/rules_test.go), and the server, which the e2e runs as a process
# of its own on a free loopback port with its storage in a temporary
# folder (testsupport/promtest), never the package's service (on a host
# running systemd the package enables and starts prometheus.service on
# :9090, as postgresql starts its cluster).
prometheus:
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then \
		echo ">> installing Debian's prometheus (promtool and the server)"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	fi

$(TEMPORAL):
	@echo ">> building the Temporal CLI $(TEMPORAL_VERSION) into bin/ (takes minutes the first time)"
	$(GO) install github.com/temporalio/cli/cmd/temporal@$(TEMPORAL_VERSION)

qemu:
	@if ! command -v qemu-system-x86_64 >/dev/null; then \
		echo ">> installing Debian's qemu-system-x86"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86; \
	fi
	@# qemu-img creates each instance's qcow2 overlay over its read-only base;
	@# GNU cpio checks the guest's initramfs writer (guest/build's tests).
	@if ! command -v qemu-img >/dev/null || ! command -v cpio >/dev/null; then \
		echo ">> installing Debian's qemu-utils (qemu-img) and cpio"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-utils cpio; \
	fi
	@# iproute2's ip makes the network namespaces the network tests run in
	@# (nothing is added to the machine's own namespace).
	@if ! command -v ip >/dev/null; then \
		echo ">> installing Debian's iproute2"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2; \
	fi

## guest: the small real guest (Debian cloud kernel via apt-get download +
# dpkg-deb, initramfs with the Go init of guest/init) into GUEST_DIR. Reuses
# the download; rewrites outputs only when their content changes.
GUEST_DIR ?= $(CURDIR)/.cache/guest
.PHONY: guest
guest:
	$(GO) run ./guest/cmd/mkguest -dir "$(GUEST_DIR)"

$(STATICCHECK):
	$(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

## proto: regenerate the Go beside proto/vmflow/v1/*.proto (committed).
# protoc comes from Debian; its well-known types (timestamp.proto) are in
# /usr/include, where protoc looks by default. protoc-gen-go is pinned to the
# google.golang.org/protobuf version in go.mod so generated code and runtime
# agree.
proto: proto-tools
	PATH="$(BIN):$$PATH" protoc -I proto --go_out=proto --go_opt=paths=source_relative $(PROTO_FILES)

## proto-check: fail if the committed generated Go is not what `make proto` makes.
proto-check: proto-tools
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	PATH="$(BIN):$$PATH" protoc -I proto --go_out="$$tmp" --go_opt=paths=source_relative $(PROTO_FILES); \
	if ! diff -ru --exclude='*.proto' --exclude=doc.go "$$tmp/vmflow/v1" proto/vmflow/v1; then \
		echo "generated proto Go is stale: run make proto (generated with Debian's protoc, here: $$(protoc --version))"; exit 1; \
	fi

# protoc-gen-go is (re)installed when bin/ has none or another version: the
# generated code names the version, so a stale binary makes proto-check fail.
proto-tools:
	@if ! command -v protoc >/dev/null; then \
		echo ">> installing Debian's protobuf-compiler"; \
		apt-get update -qq; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq protobuf-compiler; \
	fi
	@if [ "$$($(PROTOC_GEN_GO) --version 2>/dev/null)" != "protoc-gen-go $(PROTOC_GEN_GO_VERSION)" ]; then \
		echo ">> installing protoc-gen-go $(PROTOC_GEN_GO_VERSION) into bin/"; \
		$(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION); \
	fi

## test: the README's test command. Fuzz targets run their seed corpora only.
test: tools build guest
	$(GO) test -race -timeout $(TEST_TIMEOUT) ./...
	$(GO) test -race -tags vmflow_crashpoints ./internal/crashpoint/
	cd $(PLATFORMAPI) && VMFLOW_TEMPORAL=$(TEMPORAL) $(GO) test -race -timeout 5m ./...
	$(MAKE) --no-print-directory bench-smoke

## bench-smoke: the benchmark sections that need no Temporal (exit detection,
# stop ladder, hot functions), in quick mode (~20 s), into a scratch file:
# the bench's code keeps working between `make bench` runs (the stop section
# once broke unnoticed). Measures nothing; BENCHMARKS.md is untouched.
bench-smoke: qemu guest
	@out=$$(mktemp); trap 'rm -f "$$out"' EXIT; \
	VMFLOW_BENCH=1 VMFLOW_BENCH_QUICK=1 VMFLOW_BENCH_ONLY=exit,stop,micro VMFLOW_BENCH_OUT="$$out" \
		$(GO) test -count=1 -run '^TestBenchmarks$$' -timeout 5m ./bench

lint: vet fmt-check tidy-check staticcheck proto-check workflowcheck units-check

## tidy-check: go.mod and go.sum are exactly what `go mod tidy` makes (direct
# requirements not marked indirect, nothing nobody imports); -diff exits
# non-zero and prints the change when they are not.
.PHONY: tidy-check
tidy-check:
	$(GO) mod tidy -diff

## units-check: the systemd units in deploy/ pass `systemd-analyze verify`
# in a scratch root with the built binaries at their ExecStart paths.
.PHONY: units-check
units-check: build
	bash -n deploy/setup-temporal.sh
	bash -n deploy/temporal/setup-postgres.sh
	deploy/verify-units.sh "$(BIN)"

vet:
	$(GO) vet ./...
	cd $(PLATFORMAPI) && $(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files --cached --others --exclude-standard '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...
	cd $(PLATFORMAPI) && $(STATICCHECK) ./...

## workflowcheck: workflow code must be deterministic (Temporal replays it).
workflowcheck: $(WORKFLOWCHECK)
	$(WORKFLOWCHECK) ./workflows/...

$(WORKFLOWCHECK):
	$(GO) install go.temporal.io/sdk/contrib/tools/workflowcheck@$(WORKFLOWCHECK_VERSION)

## fuzz: every fuzz target for FUZZTIME each (go test runs one target at a time),
# then a long run of the host model (hostagent/hostmodel: rapid state machine
# of the store and every lease kind (vGPUs, whole GPUs, the network) over the
# simulator and a network namespace, MODEL_CHECKS checks per
# driver kind; `make test` runs a short one). Replay a failure with the
# -rapid.seed it prints: go test -run 'TestHostModel/vendor' ./hostagent/hostmodel -rapid.seed=N
# Then the workflow model (workflows/model_test.go: DeleteInstance in the
# SDK's test environment, WORKFLOW_MODEL_CHECKS scenarios, about 9 steps
# each) and a larger sample of it on the dev server, replayed.
MODEL_CHECKS ?= 2000
MODEL_TIMEOUT ?= 3h
WORKFLOW_MODEL_CHECKS ?= 5000
WORKFLOW_MODEL_REPLAYS ?= 20
fuzz: tools
	@grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u | while read -r pkg; do \
		for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$pkg/*_test.go | sed 's/func //'); do \
			echo ">> $$pkg $$f"; \
			$(GO) test -run='^$$' -fuzz="^$$f$$" -fuzztime=$(FUZZTIME) $$pkg; \
		done; \
	done
	VMFLOW_MODEL_CHECKS=$(MODEL_CHECKS) $(GO) test -race -count=1 -v -timeout $(MODEL_TIMEOUT) -run '^TestHostModel$$' ./hostagent/hostmodel
	VMFLOW_WORKFLOW_MODEL_CHECKS=$(WORKFLOW_MODEL_CHECKS) VMFLOW_WORKFLOW_MODEL_REPLAYS=$(WORKFLOW_MODEL_REPLAYS) \
		$(GO) test -race -count=1 -v -timeout $(MODEL_TIMEOUT) -run '^TestWorkflowModel' ./workflows

## bench: measure vmflow against what it replaces, side by side in one run
# (exit detection, stop to gone, through Temporal, scale to 200 VMs, hot
# functions with allocations, a host's CPU per launch at 10, 100 and 1,000
# VMs) and write BENCHMARKS.md. Driver: bench/,
# gated by VMFLOW_BENCH=1 so `make test` never runs it. ~15 minutes. Not
# all of tools: the benchmarks need no Chromium.
bench: $(TEMPORAL) qemu guest
	VMFLOW_BENCH=1 VMFLOW_BENCH_CMD="make bench" $(GO) test -run '^TestBenchmarks$$' -v -count=1 -timeout 30m ./bench

## bench-fleet: the scale table on the self-hosted Temporal server on
# PostgreSQL (durable defaults): 100 and 200 VMs on one host, then 1,000
# `-machine none` VMs (~8 MiB each) over 10 host agents, with workflows per
# second and each process's CPU, then spawns without a host against named
# ones over 1, 3 and 10 agents (throughput, p50/p99); writes its own section of BENCHMARKS.md
# (make bench keeps it). Not part of make bench (its 15 minutes). Measured
# 8 to 10 minutes here (2 cores, shared), hence its own 45-minute timeout.
.PHONY: bench-fleet
bench-fleet: $(TEMPORAL) temporal-server postgresql qemu
	VMFLOW_BENCH=1 $(GO) test -run '^TestBenchFleet$$' -v -count=1 -timeout 45m ./bench

## bench-scale: the control plane alone at fleet size, on the self-hosted
# Temporal server on PostgreSQL: host agents whose QEMU is the stub VMM
# (hostagent/vmm/vmmtest/stubvmm: one thread, no guest, through the real
# jail), 1,000 VMs over 10 agents then 5,000 over 50 (VMFLOW_SCALE_SIZES,
# e.g. 1000/10,10000/100): spawn all, idle, kill -9 and restart every
# agent, delete all; CPU per VM of each process, idle CPU, memory; writes
# its own section of BENCHMARKS.md (make bench keeps it). Not in make test.
SCALE_TIMEOUT ?= 4h
.PHONY: bench-scale
bench-scale: $(TEMPORAL) temporal-server postgresql
	VMFLOW_BENCH=1 $(GO) test -run '^TestBenchScale$$' -v -count=1 -timeout $(SCALE_TIMEOUT) ./bench

clean:
	rm -rf $(BIN)/vmflow-hostagent $(BIN)/vmflow-worker $(BIN)/vmflow

## dev: run vmflow here in the foreground (deploy/dev.sh): Temporal dev server
# (UI :8233), vGPU simulator, worker, host agent; Ctrl-C stops it all.
# HOSTS=N (default 1): N agents here, each its own host (deploy/dev.sh).
# Chromium is not needed for it, so not all of tools.
.PHONY: dev demo
dev: $(TEMPORAL) qemu build guest
	GUEST_DIR="$(GUEST_DIR)" deploy/dev.sh

## demo: against a running make dev: spawn the guest with a vGPU, status, delete, with timings.
demo:
	GUEST_DIR="$(GUEST_DIR)" deploy/dev/demo.sh
