#!/usr/bin/env bash
# The supported-versions matrix: in a fresh virtualenv per combination (celery-leases and its test
# extra installed with pip), the tests that drive a dependency whose version the combination
# changes and start no `celery worker`: the marker `versions` (tests/conftest.py sets it on every
# test that uses a database, a broker or the Django project, or imports celery-leases, Celery,
# SQLAlchemy, a driver, click, Django, ...; docs/contributing.md) without `e2e`. The tests left
# out check the suite's own tools (the chaos checker's self-tests); the real-worker tests run in
# `make test` on the project's .venv. In parallel, as `make test` (MATRIX_WORKERS, default 4).
#
#   oldest  Python 3.10 with the dependency floors of pyproject.toml (scripts/matrix/oldest.txt)
#   newest  Python 3.13 with the newest release of everything
#
# Usage: scripts/matrix.sh [oldest|newest ...]   (default: both). Needs the services up
# (scripts/services.sh). MATRIX_PYTHON_<NAME> overrides an interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

pyenv_versions=${PYENV_ROOT:-/root/.pyenv}/versions
declare -A python=(
    [oldest]=${MATRIX_PYTHON_OLDEST:-$pyenv_versions/3.10.13/bin/python3.10}
    [newest]=${MATRIX_PYTHON_NEWEST:-$pyenv_versions/3.13.0/bin/python3.13}
)
declare -A constraints=([oldest]=scripts/matrix/oldest.txt [newest]=)
tests=(-m "versions and not e2e" -n "${MATRIX_WORKERS:-4}" --dist loadgroup --durations=15)

work=$(mktemp -d "${TMPDIR:-/tmp}/celery-leases-matrix.XXXXXX")
trap 'rm -rf "$work"' EXIT

combos=("$@")
[ ${#combos[@]} -gt 0 ] || combos=(oldest newest)
status=0
for name in "${combos[@]}"; do
    interpreter=${python[$name]:?unknown combination $name (oldest, newest)}
    venv=$work/$name
    started=$SECONDS
    echo "== matrix $name: $("$interpreter" --version 2>&1)"
    "$interpreter" -m venv "$venv"
    pin=()
    [ -z "${constraints[$name]}" ] || pin=(-c "${constraints[$name]}")
    # (pip's notes about this machine's local package folders are left out of the log)
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pin[@]}" -e '.[test]' 2>&1 |
        { grep -v '^WARNING: Location .* is ignored' || true; }
    "$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
        grep -iE '^(celery|kombu|sqlalchemy|alembic|click|psycopg|pymysql|prometheus.client|django) ' |
        tr -s ' ' | paste -sd, - | sed "s/^/== matrix $name: /"
    if "$venv/bin/python" -m pytest "${tests[@]}" -q -p no:cacheprovider; then
        echo "== matrix $name: passed in $((SECONDS - started)) s"
    else
        echo "== matrix $name: FAILED after $((SECONDS - started)) s" >&2
        status=1
    fi
done
exit "$status"
