"""Run every benchmark in order, each in its own process: ``python -m bench.run_all [--quick]``.

dispatch, throughput, operations, renewals, recovery (when ``bench/recovery.py`` exists),
scale, memory.
Each prints its tables and writes ``bench/results/<name>.json``; a failing one is run once
more (the services are shared), then reported, and the others still run. ``--quick`` is
passed on (a short run, under ~5 minutes in all); ``--skip NAME`` leaves one out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from bench.common import BENCH_DIR, machine, print_table, run_module

ORDER = ("dispatch", "throughput", "operations", "renewals", "recovery", "scale", "memory")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run of each benchmark")
    parser.add_argument(
        "--skip", action="append", default=[], choices=ORDER, help="leave one out (repeatable)"
    )
    args = parser.parse_args(argv)
    print("machine:", json.dumps(machine(), default=str), flush=True)
    rows = []
    failed = 0
    for name in ORDER:
        if name in args.skip or not (BENCH_DIR / f"{name}.py").exists():
            rows.append([name, "skipped" if name in args.skip else "absent", float("nan")])
            continue
        print(f"\n{'=' * 30} bench.{name}{' --quick' if args.quick else ''} {'=' * 30}", flush=True)
        started = time.monotonic()
        status = run_module(name, quick=args.quick)
        note = "ok"
        if status != 0:
            # The services are shared (a chaos run may be restarting them): one more try.
            print(f"bench.{name} failed ({status}); running it once more", flush=True)
            status = run_module(name, quick=args.quick)
            note = "ok (2nd try)"
        seconds = time.monotonic() - started
        failed += status != 0
        rows.append([name, note if status == 0 else f"failed ({status})", seconds])
    print_table("bench.run_all", ["benchmark", "status", "seconds"], rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
