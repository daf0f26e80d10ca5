"""Run every benchmark in order, each in its own process: ``python -m bench.run_all [--quick]``.

dispatch, throughput, operations, recovery (when ``bench/recovery.py`` exists), scale, memory.
Each prints its tables and writes ``bench/results/<name>.json``; a failing one is reported and
the others still run. ``--quick`` is passed on (a short run, under ~5 minutes in all).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from bench.common import BENCH_DIR, arguments, machine, print_table, run_module

ORDER = ("dispatch", "throughput", "operations", "recovery", "scale", "memory")


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments(__doc__.splitlines()[0], argv)
    print("machine:", json.dumps(machine(), default=str), flush=True)
    rows = []
    failed = 0
    for name in ORDER:
        if not (BENCH_DIR / f"{name}.py").exists():
            rows.append([name, "absent", float("nan")])
            continue
        print(f"\n{'=' * 30} bench.{name}{' --quick' if args.quick else ''} {'=' * 30}",
              flush=True)
        started = time.monotonic()
        status = run_module(name, quick=args.quick)
        seconds = time.monotonic() - started
        failed += status != 0
        rows.append([name, "ok" if status == 0 else f"failed ({status})", seconds])
    print_table("bench.run_all", ["benchmark", "status", "seconds"], rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
