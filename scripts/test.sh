#!/usr/bin/env bash
# `make test`: the whole suite in two runs of pytest.
#
#   1. In parallel: every test not marked `exclusive`, on TEST_WORKERS pytest-xdist workers
#      (default 4 on 2 cores: most tests wait on real worker processes and servers, not on the
#      CPU; docs/contributing.md has the measurements). `--dist loadgroup`: the tests that share
#      a bed of workers or the Django project keep to one worker (tests/conftest.py).
#   2. Alone: the tests marked `exclusive` (the chaos run that restarts PostgreSQL and Redis,
#      which would break the tests running beside it).
#
# Arguments go to both runs (`make test PYTEST_ARGS="tests/databases -x"`). TEST_WORKERS=0 runs
# phase 1 in this process, without xdist. Exit status: non-zero if either run failed, or if
# neither collected a test (pytest's 5, "no tests collected", in one run alone is fine).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
workers=${TEST_WORKERS:-4}
parallel=()
if [ "$workers" != 0 ]; then
    parallel+=(-n "$workers" --dist loadgroup)
fi
started=$SECONDS
"$PYTHON" -m pytest "${parallel[@]}" -m "not exclusive" --durations=20 "$@"
first=$?
echo "make test: the parallel run took $((SECONDS - started)) s (exit $first)"
started=$SECONDS
"$PYTHON" -m pytest -m exclusive "$@"
second=$?
echo "make test: the exclusive run took $((SECONDS - started)) s (exit $second)"
if [ "$first" -eq 5 ] && [ "$second" -eq 5 ]; then
    exit 5
fi
for status in "$first" "$second"; do
    if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
        exit "$status"
    fi
done
exit 0
