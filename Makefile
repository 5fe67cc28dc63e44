# microbatch — the two commands are `make demo` and `make test`; both set up what they need.
# Everything downloaded or generated lives in .venv/ and .local/ (git-ignored).

SHELL := /bin/bash
PYTHON ?= python3
VENV := $(CURDIR)/.venv
BIN := $(VENV)/bin
UV_VERSION := 0.13.9
STAMP := $(VENV)/.installed
NATIVE := $(VENV)/.native
NATIVE_SOURCES := $(wildcard libs/microbatch-native/src/*.rs) \
  $(addprefix libs/microbatch-native/,Cargo.toml Cargo.lock pyproject.toml microbatch_native.pyi)
BYTECODE := $(VENV)/.bytecode

export MICROBATCH_HOME ?= $(CURDIR)/.local
export AIRFLOW_HOME ?= $(CURDIR)/.local/airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
# Airflow's metadata DB: the local stack's PostgreSQL (`make airflow` starts it), as
# production runs Airflow. psycopg 3 serves both the sync and the async engine.
export MICROBATCH_POSTGRES_PORT ?= 5433
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN ?= postgresql+psycopg://microbatch:microbatch@127.0.0.1:$(MICROBATCH_POSTGRES_PORT)/airflow
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC ?= $(AIRFLOW__DATABASE__SQL_ALCHEMY_CONN)
# The embedded stack's S3 keys (SeaweedFS starts with them), so an AWS_PROFILE or
# AWS_ACCESS_KEY_ID in your shell does not stand in for them; unset when you point
# MICROBATCH_S3_ENDPOINT_URL at your own S3 (then your keys or the AWS chain apply).
ifndef MICROBATCH_S3_ENDPOINT_URL
export MICROBATCH_S3_ACCESS_KEY_ID ?= microbatch
export MICROBATCH_S3_SECRET_ACCESS_KEY ?= microbatch-secret
endif
export PYSPARK_PYTHON := $(BIN)/python
export PYSPARK_DRIVER_PYTHON := $(BIN)/python
export PATH := $(BIN):$(PATH)

.PHONY: all venv tools jars setup browser postgres test test-unit typecheck soak lint format demo \
        airflow stack-up stack-down stack-status bench nexmark lock clean cluster connect docs

all: venv

## ---- set-up (idempotent) -------------------------------------------------------------

tools:
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || \
	  { echo "error: need Python 3.11 (found $$($(PYTHON) --version)); set PYTHON=python3.11" >&2; exit 1; }
	@command -v java >/dev/null || { echo "error: java not found (Kafka and Spark need it): apt-get install -y openjdk-17-jre-headless" >&2; exit 1; }
	@command -v mvn >/dev/null || { echo "error: mvn not found (it fetches the Kafka jars): apt-get install -y maven" >&2; exit 1; }

venv: $(STAMP) $(NATIVE) $(BYTECODE)

# Re-runs only when the lock or the library's, the dev package's or the provider's
# metadata changed. libs/microbatch-dev is the local stack, the demo and the examples
# (microbatch.localstack, .demo, .examples; `microbatch-stack`), kept out of the runtime
# wheel. plugins/ is also the provider distribution microbatch-airflow
# (plugins/pyproject.toml): its entry points register the plugin, connection types and
# [microbatch] config. pyspark 4.2.0 comes from PyPI as a source distribution: uv builds it
# on every fresh clone and keeps each build (~1.4 GB) as a new revision in its cache, so
# set-up prunes the revisions no install uses any more, or the cache grows without bound.
$(STAMP): requirements.lock libs/microbatch/pyproject.toml libs/microbatch-dev/pyproject.toml \
          plugins/pyproject.toml | tools
	@echo "==> Python environment (.venv) from requirements.lock"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	@$(BIN)/uv pip install -q --python $(BIN)/python -r requirements.lock \
	  -e libs/microbatch -e libs/microbatch-dev -e plugins
	@$(BIN)/uv cache prune -q
	@touch $@

# microbatch-native, the Kafka reader in Rust (librdkafka's C sources built into it, crates
# from crates.io at Cargo.lock's versions): a wheel built by maturin and installed into the
# venv, so the stage-1 tasks (the executors) import it as the driver does. ~1-2 min the
# first time on 2 cores; again only when its sources change.
$(NATIVE): $(STAMP) $(NATIVE_SOURCES)
	@command -v cargo >/dev/null || { echo "error: cargo not found (it builds microbatch-native, the native Kafka reader): install Rust with rustup (https://rustup.rs)" >&2; exit 1; }
	@echo "==> microbatch-native (the Kafka reader in Rust): cargo build --release, ~1-2 min the first time"
	@$(BIN)/uv pip install -q --python $(BIN)/python --reinstall-package microbatch-native libs/microbatch-native
	@touch $@

# Bytecode for everything installed and for the library, compiled once here: a process
# that must compile its imports (PYTHONDONTWRITEBYTECODE=1, or a read-only venv) spends
# ~2 s on pyspark, pandas and boto3 alone, on every batch and every Airflow task.
$(BYTECODE): $(STAMP) $(NATIVE)
	@echo "==> bytecode for .venv, libs/microbatch and libs/microbatch-dev"
	@$(BIN)/python -m compileall -q -j 0 $(VENV)/lib libs/microbatch/src libs/microbatch-dev/src >$(VENV)/compileall.log 2>&1 || \
	  { tail -5 $(VENV)/compileall.log; echo "(files that do not compile stay source-only)"; }
	@touch $@

# The Kafka broker's jars, Spark's Kafka connector (stage 1's JVM reader), Delta Lake's
# Spark connector (reading the Delta sink's tables) and Apache Iceberg's Java library (the
# test reading the Iceberg sink's tables with Iceberg's own reader), from Maven Central.
jars: venv
	@$(BIN)/python -c 'from microbatch.localstack.kafka import ensure_jars; from microbatch.settings import Settings; print("==> Kafka jars in", ensure_jars(Settings.from_env().home_path))'
	@$(BIN)/python -c 'from microbatch.localstack.spark_kafka import ensure_spark_kafka_jars; from microbatch.settings import Settings; print("==> Spark Kafka connector in", ensure_spark_kafka_jars(Settings.from_env().home_path)[0].parent)'
	@$(BIN)/python -c 'from microbatch.localstack.delta_jars import ensure_delta_jars; from microbatch.settings import Settings; print("==> Delta Lake for Spark in", ensure_delta_jars(Settings.from_env().home_path)[0].parent)'
	@$(BIN)/python -c 'from microbatch.localstack.iceberg_jars import ensure_iceberg_jars; from microbatch.settings import Settings; print("==> Apache Iceberg (Java) in", ensure_iceberg_jars(Settings.from_env().home_path)[0].parent)'

setup: venv jars

# Debian's PostgreSQL server (Airflow's metadata DB in `make airflow` and the tests). A
# no-op when its binaries are there (on PATH or in /usr/lib/postgresql/<major>/bin); else
# apt-get as root (or through sudo). The stack runs its own cluster under .local/ (the
# tests: under the temp dir), never the system's.
postgres:
	@{ command -v initdb >/dev/null && command -v postgres >/dev/null; } || \
	  ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || { \
	  echo "==> Debian package postgresql (Airflow's metadata DB)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; else \
	    echo "error: need root to install postgresql: apt-get install -y postgresql" >&2; exit 1; fi; \
	  $$SUDO apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq postgresql >/dev/null || \
	    { echo "error: apt-get install postgresql failed" >&2; exit 1; }; }

# Debian's headless Chromium and its WebDriver, for the browser test of the Airflow UI
# (tests/e2e/test_airflow_standalone.py). A no-op when both are on PATH; else apt-get as
# root (or through sudo).
BROWSER_PACKAGES := chromium chromium-driver
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  echo "==> Debian packages $(BROWSER_PACKAGES) (the browser test)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; else \
	    echo "error: need root to install $(BROWSER_PACKAGES): apt-get install -y $(BROWSER_PACKAGES)" >&2; exit 1; fi; \
	  $$SUDO apt-get update -qq >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(BROWSER_PACKAGES) >/dev/null || \
	    { echo "error: apt-get install $(BROWSER_PACKAGES) failed" >&2; exit 1; }; }

## ---- the two commands --------------------------------------------------------------

test: setup browser postgres
	@echo "==> ruff"
	@$(BIN)/ruff check libs dags plugins jobs tests bench docs/hooks.py
	@echo "==> mypy (strict: microbatch.runtime, .dataflow, .joins, .testing)"
	@$(MYPY)
	@echo "==> pytest (unit, then integration on real Kafka/SeaweedFS/Spark, then Airflow)"
	@$(BIN)/pytest $(PYTEST_ARGS)

test-unit: venv
	@$(BIN)/pytest tests/unit $(PYTEST_ARGS)

# The public API's types: mypy --strict on microbatch.runtime, .dataflow, .joins and .testing
# (their configuration: [tool.mypy] in libs/microbatch/pyproject.toml). Its cache is
# .mypy_cache/ (git-ignored): a few seconds once warm.
MYPY := $(BIN)/mypy --config-file libs/microbatch/pyproject.toml
typecheck: venv
	@echo "==> mypy (strict: microbatch.runtime, .dataflow, .joins, .testing)"
	@$(MYPY)

# The kill soak (not in `make test`): ROUNDS runs SIGKILLed at random moments, then the
# outputs against a plain-Python count. SEED picks the kills.
ROUNDS ?= 12
soak: setup
	@MICROBATCH_SOAK_ROUNDS=$(ROUNDS) MICROBATCH_SOAK_SEED=$${SEED:-7} \
	  $(BIN)/pytest tests/integration/runtime/test_soak.py -q -s $(PYTEST_ARGS)

demo: setup postgres
	@$(BIN)/python -m microbatch.demo --job jobs/clickstream.py

## ---- services ----------------------------------------------------------------------

airflow: setup postgres
	@$(BIN)/python -m microbatch.localstack.airflow

stack-up: jars
	@$(BIN)/microbatch-stack up

stack-down: venv
	@$(BIN)/microbatch-stack down

stack-status: venv
	@$(BIN)/microbatch-stack status

## ---- maintenance ---------------------------------------------------------------------

lint: venv
	@$(BIN)/ruff check libs dags plugins jobs tests bench docs/hooks.py
	@$(BIN)/ruff format --check libs dags plugins jobs tests bench docs/hooks.py

format: venv
	@$(BIN)/ruff format libs dags plugins jobs tests bench docs/hooks.py
	@$(BIN)/ruff check --fix libs dags plugins jobs tests bench docs/hooks.py

# The documentation site (mkdocs.yml) into .local/site: the user guide (docs/*.md), the API
# reference from the docstrings and the CLI reference from the parser (docs/hooks.py).
# Strict: a broken link, anchor or cross-reference fails it. Open .local/site/index.html.
docs: venv
	@echo "==> docs (mkdocs, strict) into .local/site"
	@NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: setup
	@for b in bench/bench_*.py; do [ -e "$$b" ] || continue; echo "==> $$b"; $(BIN)/python $$b || exit 1; done

# Nexmark q0-q8 on microbatch and Structured Streaming (bench/nexmark; not in `make bench`):
# builds the generator once with cargo, generates the events once per size under .local/.
# E.g. make nexmark NEXMARK_ARGS="--events 10M --warmup 200k".
nexmark: setup
	@$(BIN)/python bench/nexmark/run.py $(NEXMARK_ARGS)

# Regenerate the exact pins after editing requirements.in.
lock: venv
	@$(BIN)/uv pip compile -q --python-version 3.11 requirements.in -o requirements.lock
	@echo "requirements.lock updated; run make venv"

clean: stack-down
	rm -rf $(MICROBATCH_HOME)/stack $(MICROBATCH_HOME)/demo.log

## ---- Spark engines (issue 8) -------------------------------------------------------------

cluster: venv
	@$(BIN)/microbatch-stack up --only spark-cluster
	@echo "jobs use it with: export MICROBATCH_SPARK_MASTER=spark://127.0.0.1:7077 (state and outputs on S3)"

connect: venv
	@$(BIN)/microbatch-stack up --only spark-connect
	@echo "jobs use it with: export MICROBATCH_SPARK_MASTER=sc://127.0.0.1:15002"
