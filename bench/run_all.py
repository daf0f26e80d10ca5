"""Run every benchmark in order, each in its own process: ``python -m bench.run_all [--quick]``.

A failing one is run once more (the services are shared), then reported; ``--skip NAME``
leaves one out.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import parser, report, row

ORDER = (
    "operations", "dispatch", "throughput", "recovery", "scale", "memory", "column_types", "keys",
    "newest",
    "ceiling", "peers", "large", "joined", "debounce", "groups", "checkpoint", "checkpoint_sql",
    "pause", "timeline",
)  # fmt: skip


def run(name: str, *, quick: bool) -> int:
    """``python -m bench.<name> [--quick]`` in a process of its own; its exit status."""
    command = [sys.executable, "-m", f"bench.{name}", *(["--quick"] if quick else [])]
    print(f"\n===== {' '.join(command[1:])} =====", flush=True)
    return subprocess.run(command, cwd=Path(__file__).resolve().parent.parent).returncode


def main(argv: Sequence[str] | None = None) -> int:
    options = parser(__doc__)
    options.add_argument("--skip", action="append", default=[], choices=ORDER, help="leave out")
    args = options.parse_args(argv)
    rows = []
    for name in ORDER:
        if name in args.skip:
            rows.append({"benchmark": name, "status": "skipped"})
            continue
        started = time.monotonic()
        tries, status = 1, run(name, quick=args.quick)
        if status != 0:
            tries, status = 2, run(name, quick=args.quick)
        outcome = "ok" if status == 0 else f"failed ({status})"
        rows.append(
            row("benchmark status tries seconds", name, outcome, tries, time.monotonic() - started)
        )
    report("run_all", rows, quick=args.quick, title="bench.run_all")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
