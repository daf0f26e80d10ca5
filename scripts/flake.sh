#!/usr/bin/env bash
# The flake finder: run one test (or a file, or anything pytest selects) N times in a row, each
# in a fresh pytest process, optionally with the machine loaded beside it, and print every failed
# run's report (the failure, and the end of each worker's log the test's fixtures attached).
#
#   make flake TEST=tests/workers/test_connections.py N=50 LOAD=cpu
#   make flake TEST=tests/workers/test_controls.py ARGS='-k "reaper_gives_up_on and sqlite"' N=50
#   scripts/flake.sh tests/databases/test_groups.py -k five_calls      (N, LOAD from the env)
#
# N       runs (default 20); STOP=1 stops at the first failure.
# LOAD    what runs beside the test: empty or 0 for nothing; 1 or cpu for one busy process per
#         core (`nproc`); suite for tests/databases and tests/inprocess in a loop (real
#         databases, a second pytest; its own output goes to load.log).
# ARGS    more pytest arguments (or give them after TEST on the command line).
# OUT     where the runs' logs and temporary folders go (default: a new folder under TMPDIR);
#         a passing run's folder is removed, a failing run's kept, with run-<i>.log beside it.
#
# Each run is `python -m pytest TEST ARGS -p no:xdist --basetemp OUT/run-<i>`
# (tests run one at a time, as a loaded CI machine would run them in one worker). Exit status:
# 0 when every run passed, 1 otherwise. A flaky test is a bug to find: read the failed runs'
# logs, never retry it into passing.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
test_arg=${1:-${TEST:-}}
[ -n "$test_arg" ] || {
    echo "usage: TEST=tests/x.py::test_y [N=20] [LOAD=cpu|suite] [ARGS=...] make flake" >&2
    exit 2
}
[ $# -gt 0 ] && shift
runs=${N:-20}
load=${LOAD:-}
out=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/celery-leases-flake.XXXXXX")}
mkdir -p "$out"
# ARGS is split as the shell would ('-k "a and b"' stays one -k argument).
eval "extra=(${ARGS:-})"
extra+=("$@")

loaders=()
stop_load() {
    for pid in "${loaders[@]}"; do
        # Each loader is the leader of a process group of its own (setsid): end the whole group.
        kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null
    done
    for pid in "${loaders[@]}"; do wait "$pid" 2>/dev/null; done
    loaders=()
}
trap stop_load EXIT
trap 'exit 130' INT TERM

case "$load" in
"" | 0) ;;
1 | cpu)
    for _ in $(seq "$(nproc)"); do
        setsid "$PYTHON" -c 'while True: pass' &
        loaders+=($!)
    done
    echo "flake: load: $(nproc) busy processes"
    ;;
suite)
    setsid bash -c "while true; do '$PYTHON' -m pytest tests/databases tests/inprocess -q \
        -p no:xdist --basetemp '$out/load' -x; done" >"$out/load.log" 2>&1 &
    loaders+=($!)
    echo "flake: load: tests/databases and tests/inprocess in a loop ($out/load.log)"
    ;;
*)
    echo "flake: LOAD=$load: expected 0, 1, cpu or suite" >&2
    exit 2
    ;;
esac

echo "flake: $runs runs of: pytest $test_arg ${extra[*]}  (logs in $out)"
failed=()
started=$SECONDS
for i in $(seq "$runs"); do
    log=$out/run-$i.log
    t0=$SECONDS
    "$PYTHON" -m pytest "$test_arg" "${extra[@]}" -p no:xdist -q -rfE \
        --basetemp "$out/run-$i" >"$log" 2>&1
    status=$?
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|^=+ .*(passed|failed|error)' "$log" |
        tail -1 | tr -d '=' | sed 's/^ *//')
    if [ "$status" -eq 0 ]; then
        rm -rf "$out/run-$i"
        echo "run $i/$runs: ok in $((SECONDS - t0)) s ($summary)"
    else
        failed+=("$i")
        echo "run $i/$runs: FAILED (exit $status) in $((SECONDS - t0)) s ($summary): $log"
        [ "${STOP:-0}" = 1 ] && break
    fi
done
stop_load

echo
echo "flake: ${#failed[@]} of $i runs failed, $((SECONDS - started)) s in all; load: ${load:-none}"
for i in "${failed[@]}"; do
    echo
    echo "=================================== run $i: $out/run-$i.log"
    # From pytest's FAILURES/ERRORS section to the end: tracebacks, captured output and the
    # worker logs the fixtures attach to a failed test's report.
    sed -n '/^=\+ \(FAILURES\|ERRORS\) =\+$/,$p' "$out/run-$i.log"
    echo "--- files kept for run $i: $out/run-$i"
done
[ ${#failed[@]} -eq 0 ]
