# rowq — every command a developer or CI needs. `make help` lists them.
#
# Postgres: DATABASE_URL (default: the server at 127.0.0.1:5432, database `test`).
# SQS: LocalStack on the host from PyPI, installed into .cache/ and started on demand
# (infra/localstack/localstack.sh); AWS_ENDPOINT_URL points the AWS SDK at it.

SHELL := /usr/bin/env bash
.DEFAULT_GOAL := help

export DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
export AWS_ENDPOINT_URL ?= http://127.0.0.1:4566
export AWS_REGION ?= us-east-1
export AWS_ACCESS_KEY_ID ?= test
export AWS_SECRET_ACCESS_KEY ?= test
export CARGO_TERM_COLOR ?= never

LOCALSTACK := infra/localstack/localstack.sh
# Tests share two cores with LocalStack and Postgres; more threads only add contention.
TEST_THREADS ?= 4

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

.PHONY: test
test: ## lint, then every test against real Postgres and LocalStack (starts and stops LocalStack)
	cargo fmt --all -- --check
	cargo clippy --all-targets --locked -- -D warnings
	$(LOCALSTACK) with cargo test --locked -- --test-threads=$(TEST_THREADS)

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

.PHONY: clean
clean: ## remove build output and the cached LocalStack virtualenv
	$(LOCALSTACK) down
	cargo clean
	rm -rf .cache
