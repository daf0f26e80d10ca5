#!/usr/bin/env bash
# Celery's own integration tests (t/integration: test_tasks, test_canvas, test_inspect) with
# LeasedTask as the default task class of the apps they build, compared test by test with a
# run on Celery's own Task. `make celery-suite`; ~20-45 min; not part of CI.
#
# Needs the runner of ../shared/celery-suite (SUITE_DIR) and a Celery test tree (CELERY_SRC):
# when CELERY_SRC has none, the tree of the installed Celery release is taken from its sdist
# on PyPI. Results (junit.xml, pytest.log, summary.txt) go to RESULTS_DIR.
#   SUITE=quick|full (default full)  BASELINE=<junit.xml or .json to compare with>
#   extra arguments go to pytest (node ids, -x, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SUITE_DIR=$(cd "${SUITE_DIR:-../shared/celery-suite}" && pwd)
CELERY_SRC=${CELERY_SRC:-/tmp/celery-src}
VENV=${VENV:-/tmp/celery-suite-venv}
export RESULTS_DIR=${RESULTS_DIR:-/tmp/celery-suite-results/leases-$(date +%Y%m%d-%H%M%S)}
BASELINE=${BASELINE:-$SUITE_DIR/baseline-redis-full.json}

version=$(.venv/bin/python -c 'import celery; print(celery.__version__)')
if [ ! -f "$CELERY_SRC/t/integration/conftest.py" ]; then
    sdist=$(mktemp -d)
    .venv/bin/pip download -q --no-binary :all: --no-deps -d "$sdist" "celery==$version"
    mkdir -p "$CELERY_SRC"
    tar -xzf "$sdist"/celery-*.tar.gz -C "$CELERY_SRC" --strip-components=1 \
        "celery-$version/t" "celery-$version/pyproject.toml"
fi

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "celery[redis]==$version" "redis==7.4.1" "pytest==9.0.3" \
        "pytest-rerunfailures>=15" "pytest-timeout==2.4.0" pydantic
fi
"$VENV/bin/pip" install -q "$ROOT[postgres]"
"$VENV/bin/pip" install -q --force-reinstall --no-deps "$ROOT"   # this checkout, not a cache

psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'celery_suite'" \
    | grep -q 1 || psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE celery_suite"
# A fresh leases table for the run, made by the migrations (nothing creates it at first use).
PYTHONPATH="$ROOT/scripts" "$VENV/bin/python" - <<'PY'
from celery import Celery

from celery_leases.db import migrations
from celery_leases.config import settings_for
from celery_leases.db import store_for
from celery_suite_conf import CONFIG

app = Celery("celery-suite-setup", set_as_current=False)
app.conf.update(CONFIG)
store = store_for(settings_for(app))
migrations.downgrade(store)
print("celery-suite:", migrations.upgrade(store).describe())
PY

status=0
VENV=$VENV TASK_CLS=celery_leases:LeasedTask EXTRA_CONFIG=celery_suite_conf \
    PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}" SUITE=${SUITE:-full} \
    "$SUITE_DIR/run.sh" --timeout=120 -p no:rerunfailures "$@" || status=$?
if [ -f "$BASELINE" ]; then
    python3 "$SUITE_DIR/compare.py" "$BASELINE" "$RESULTS_DIR/junit.xml" || status=1
fi
exit "$status"
