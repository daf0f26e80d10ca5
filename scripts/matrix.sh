#!/usr/bin/env bash
# The supported-versions matrix: the tests that start no `celery worker` (the marker e2e) in a
# fresh virtualenv per combination, each installing celery-leases and its test extra with pip:
# tests/inprocess, tests/databases (real databases), and from tests/workers the unmarked ones (the
# `celery leases` command, the pytest plugin in a fresh pytest: click's and pytest's floors).
# The full suite (`make test`) runs on the project's .venv.
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
tests=(tests/inprocess tests/databases tests/workers -m "not e2e")

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
        grep -iE '^(celery|kombu|sqlalchemy|click|psycopg|pymysql|prometheus.client) ' |
        tr -s ' ' | paste -sd, - | sed "s/^/== matrix $name: /"
    if "$venv/bin/python" -m pytest "${tests[@]}" -q -p no:cacheprovider; then
        echo "== matrix $name: passed in $((SECONDS - started)) s"
    else
        echo "== matrix $name: FAILED after $((SECONDS - started)) s" >&2
        status=1
    fi
done
exit "$status"
