"""Renewal statements per second of one process holding 1 and 50 leases (PostgreSQL).

A real keeper thread renews real leases for a few seconds with a 1 s lease renewed every
0.25 s; every statement the store sends is counted. The keeper renews all leases of the
process in one statement per tick, so the rate should not grow with the number of leases.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from bench.common import POSTGRES_URL, arguments, print_table, scratch_table, settings, write_result
from celery_leases.keeper import Keeper
from celery_leases.lease import Lease
from celery_leases.store import Claimed, Store

RENEW = 0.25


def measure(url: str, held: int, seconds: float) -> dict[str, Any]:
    with scratch_table(url, "renewals") as table:
        store = Store(settings(url, table, duration=1.0, renew_interval=RENEW))
        store.ensure_schema()
        leases = []
        for n in range(held):
            job = f"job-{n}"
            store.register(job, task="t", args="[]", kwargs="{}", options="{}")
            claim = store.claim(
                job, owner="bench/1", duration=1.0, task="t", args="[]", kwargs="{}"
            )
            assert isinstance(claim, Claimed)
            leases.append(Lease(job, claim.token, 1, None, "bench/1", 1.0, RENEW))
        statements: list[str] = []
        sa.event.listen(
            store.engine, "before_cursor_execute", lambda *a, **k: statements.append(a[2])
        )
        keeper = Keeper(store)
        for lease in leases:
            keeper.add(lease)
        keeper.start()
        time.sleep(seconds)
        keeper.stop()
        keeper.join(timeout=5)
        lost = sum(lease.lost for lease in leases)
        updates = [s for s in statements if s.lstrip().upper().startswith("UPDATE")]
        expired = sum(1 for j in store.list_jobs(limit=held + 1) if (j.expires_in or 0) <= 0)
        store.engine.dispose()
    return {
        "leases": held,
        "seconds": seconds,
        "statements": len(statements),
        "updates": len(updates),
        "statements_per_second": len(statements) / seconds,
        "lost": lost,
        "expired_at_end": expired,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = arguments(__doc__.splitlines()[0], argv)
    seconds = 3.0 if args.quick else 10.0
    rows = [measure(POSTGRES_URL, held, seconds) for held in (1, 50)]
    print_table(
        f"renewals: lease 1 s, renew every {RENEW} s, {seconds:g} s each (PostgreSQL)",
        ["leases held", "statements", "statements/s", "leases lost", "expired at end"],
        [
            [
                r["leases"],
                r["statements"],
                r["statements_per_second"],
                r["lost"],
                r["expired_at_end"],
            ]
            for r in rows
        ],
    )
    write_result("renewals", {"renew_interval": RENEW, "runs": rows}, quick=args.quick)


if __name__ == "__main__":
    main()
