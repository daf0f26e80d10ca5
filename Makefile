# Developer and CI entry points. Everything runs from the project's own .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Touched after a successful install: the venv is reinstalled only when pyproject.toml changes.
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

PYTEST_ARGS ?=
DEMO_ARGS ?=

.DEFAULT_GOAL := test
.PHONY: venv test flake lint docs matrix demo bench chaos celery-suite

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

# The suite: in parallel on TEST_WORKERS pytest-xdist workers (4), then the tests that restart
# a shared service, alone (scripts/test.sh; docs/contributing.md).
TEST_WORKERS ?= 4
test: venv
	TEST_WORKERS=$(TEST_WORKERS) bash scripts/test.sh $(PYTEST_ARGS)

# The flake finder: TEST (a test, a file, anything pytest selects) N times in a row (20), each in
# a fresh pytest, with LOAD beside it (cpu: a busy process per core; suite: a second test suite),
# then every failed run's report and logs (scripts/flake.sh).
#   make flake TEST=tests/workers/test_connections.py N=50 LOAD=cpu
#   make flake TEST=tests/workers/test_controls.py ARGS='-k "gives_up_on and sqlite"' N=50
flake: venv
	bash scripts/flake.sh

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The docs site (docs/, Sphinx + MyST + furo) into docs/_build/html: a warning fails it, nothing
# is fetched. The lifecycle diagram needs Graphviz's dot (scripts/graphviz.sh installs it). -E: a fresh read of every page, so no warning hides in a cached one (~5 s).
docs: $(DOCS_STAMP)
	bash scripts/graphviz.sh
	$(BIN)/sphinx-build -E -W --keep-going -q -b html docs docs/_build/html

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e '.[docs]'
	touch $@

# The tests a change of versions can break (the marker versions, no celery worker:
# scripts/matrix.sh, docs/contributing.md) on the oldest and newest supported versions, each in
# a fresh venv, in parallel (~7 min each).
matrix:
	bash scripts/matrix.sh

demo: venv
	$(BIN)/python -m examples.webhook_sync.demo $(DEMO_ARGS)

bench: venv
	$(BIN)/python -m bench.run_all

# The long form by hand (~15-20 min on 2 cores); the short form runs in `make test`. Its faults:
# every worker fault, freeze_in_transaction, the controls and both service restarts (drop
# --restart-* on a machine whose PostgreSQL and Redis others use), soft time limits landing in
# statements, clients killed between recording and publishing, keyed calls revoked, cancelled
# or expiring while they wait, half the transactional checkpoints at REPEATABLE READ, while
# bursts of triggers of keyed jobs arrive: 6 coalescing accounts, 2 debounced and 2 where the
# newest trigger wins (--debounced-keys, --newest-keys; docs/contributing.md), and 60 of the jobs in
# job groups with limits and rates (--grouped-jobs; docs/contributing.md): a third of them sent by
# name (--grouped-by-name), half of those of rated groups asking for a retry once as after an HTTP
# 429 (--grouped-retries). On SQLite (--database sqlite --broker
# filesystem) add --namespace-reaper: a reaper in another PID namespace (unshare). Failovers:
# --database postgres-failover --failover (a private primary and synchronous standby, promoted
# mid-run; needs PostgreSQL's server binaries; docs/contributing.md).
CHAOS_ARGS ?= --jobs 500 --units 20 --unit-seconds 0.5 --workers 3 --faults 120 \
	--keys 6 --debounced-keys 2 --newest-keys 2 --triggers 240 --key-units 12 --grouped-jobs 60 \
	--grouped-by-name 0.33 --grouped-retries 0.5 --broker redis --database postgres --restart-database --restart-broker
chaos: venv
	$(BIN)/python -m chaos.driver $(CHAOS_ARGS)

# Celery's own integration suite with LeasedTask as the default task class, compared test by
# test with Celery's Task (../shared/celery-suite); ~20-45 min, not in CI.
celery-suite: venv
	bash scripts/celery_suite.sh $(SUITE_ARGS)
