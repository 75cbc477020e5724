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
export AWS_ENDPOINT_URL ?= http://127.0.0.1:4566
export AWS_REGION ?= us-east-1
export AWS_ACCESS_KEY_ID ?= test
export AWS_SECRET_ACCESS_KEY ?= test
export CARGO_TERM_COLOR ?= never

LOCALSTACK := infra/localstack/localstack.sh
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
	DATABASE_URL=$(TEST_DATABASE_URL) $(LOCALSTACK) with cargo test --locked -- --test-threads=$(TEST_THREADS)

.PHONY: dev
dev: ## run the whole pipeline on this machine until Ctrl-C (Postgres + LocalStack found or started)
	cargo build --locked --bin rowq
	infra/dev/run.sh dev

DEMO_JOBS ?= 1000
.PHONY: demo
demo: ## dev plus a mixed batch of demo jobs, live progress and a summary (DEMO_JOBS=1000)
	cargo build --locked --bin rowq
	infra/dev/run.sh demo --jobs $(DEMO_JOBS)

.PHONY: check
check: ## fmt + clippy only
	cargo fmt --all -- --check
	cargo clippy --all-targets --locked -- -D warnings

.PHONY: localstack-up
localstack-up: ## start LocalStack (SQS) on 127.0.0.1:4566, installing it on first use
	$(LOCALSTACK) up

.PHONY: localstack-down
localstack-down: ## stop the LocalStack that localstack-up started
	$(LOCALSTACK) down

.PHONY: tools
tools: $(TOOLS)/.cargo-lambda-$(CARGO_LAMBDA_VERSION) ## install cargo-lambda (from PyPI) into .cache/tools-venv

$(TOOLS)/.cargo-lambda-$(CARGO_LAMBDA_VERSION):
	python3 -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check cargo-lambda==$(CARGO_LAMBDA_VERSION)
	touch $@

.PHONY: lambda-watch
lambda-watch: tools ## serve the worker on the local Lambda runtime emulator (127.0.0.1:9000)
	cargo lambda watch -A 127.0.0.1 -P 9000

.PHONY: lambda-invoke
lambda-invoke: tools ## invoke the watched worker with the committed FIFO fixture event
	cargo lambda invoke worker -A 127.0.0.1 -P 9000 --data-file tests/fixtures/fifo-job-event.json

.PHONY: clean
clean: ## remove build output and the cached LocalStack virtualenv
	$(LOCALSTACK) down
	cargo clean
	rm -rf .cache
