"""Worker memory: RSS of a prefork pool process after N LeasedTask or plain no-op tasks.

One ``celery worker -P prefork -c 1`` per variant (Redis, PostgreSQL); VmRSS and private
memory (``smaps_rollup``) read from /proc before the first task and after each batch, MiB.

    python -m bench.memory [--quick]
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from bench.common import parser, report, row, scratch
from bench.worker_app import make_app, publish, start_worker, wait_done
from tests.support.scenario import close_app
from tests.support.service import POSTGRES_URL, private_redis_url
from tests.support.worker import Spawner

COLUMNS = "task tasks_run parent_rss_mib pool_rss_mib pool_private_mib"


def mib(pid: int, *keys: str) -> float:
    """The sum of the /proc ``keys`` (status or smaps_rollup, in kB) of ``pid``, in MiB."""
    files = (Path(f"/proc/{pid}/{name}").read_text() for name in ("status", "smaps_rollup"))
    lines = [line for text in files for line in text.splitlines()]
    return sum(int(line.split()[1]) for line in lines if line.split(":")[0] in keys) / 1024


def main(argv: Sequence[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    marks = [0, 200, 1000, 2000] if args.quick else [0, 1000, 5000, 10000]
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-memory-") as logs,
        scratch(POSTGRES_URL, "memory") as table,
        private_redis_url() as redis_url,
    ):
        spawner = Spawner(logs)
        config = dict(broker_url=redis_url, leases_database_url=POSTGRES_URL, leases_table=table)
        app = make_app(config, name="bench-client")
        try:
            for variant in ("plain", "leased"):
                run = f"bench:{uuid.uuid4().hex[:8]}"
                worker = start_worker(spawner, config, counter_url=redis_url, run=run)
                for sent, mark in zip([0, *marks], marks, strict=False):
                    publish(app, f"bench.{variant}_noop", mark - sent)
                    wait_done(redis_url, run, mark, worker=worker, timeout=60 + mark / 20)
                    pool = worker.children()[0]
                    rss = mib(worker.pid, "VmRSS"), mib(pool, "VmRSS")
                    private = mib(pool, "Private_Clean", "Private_Dirty")
                    rows.append(row(COLUMNS, variant, mark, *rss, private))
                    print(f"{variant} {mark}: pool process {rss[1]:.1f} MiB", flush=True)
                worker.stop(timeout=15)
        finally:
            close_app(app)
            spawner.stop_all()
    title = "Worker memory after N no-op tasks (MiB; prefork, 1 pool process)"
    report("memory", rows, quick=args.quick, title=title)


if __name__ == "__main__":
    main()
