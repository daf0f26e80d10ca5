"""The receiver's record of the deliveries it acted on: the ``deliveries`` table, and its SQL.

One row per provider delivery id: the account and the job that serves it. A provider retries a
delivery whenever it did not see a 2xx in time (a timeout, a crash of ours, a lost answer), for
days; the receiver answers such a retry 2xx from this table and starts nothing. The row is
written after the sync was triggered, never before: a crash in between leaves the delivery
unrecorded, so the provider's retry triggers again, which is harmless (the triggers of one
account coalesce into one run). The other order would lose the delivery. Rows older than
``RETENTION_SECONDS`` are deleted as new ones are written.
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

#: Seconds a delivery id is remembered: longer than providers retry one (Stripe: 3 days).
RETENTION_SECONDS = 7 * 24 * 3600.0


def deliveries_table(name: str = "deliveries") -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("account", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(155), nullable=False),
        # Epoch seconds, the receiver's clock: only compared with the retention, in days.
        sa.Column("received_at", sa.Double, nullable=False, index=True),
    )


def served_by(engine: Engine, table: sa.Table, delivery_id: str) -> str | None:
    """The job recorded for ``delivery_id``, or None when it was not seen yet."""
    with engine.connect() as connection:
        found = connection.scalar(sa.select(table.c.job_id).where(table.c.id == delivery_id))
    return None if found is None else str(found)


def record(engine: Engine, table: sa.Table, delivery_id: str, account: str, job_id: str) -> bool:
    """Record that ``job_id`` serves ``delivery_id`` (and forget expired deliveries): False
    when the id was recorded already (the same delivery, received twice at once)."""
    now = time.time()
    try:
        with engine.begin() as connection:
            connection.execute(table.delete().where(table.c.received_at < now - RETENTION_SECONDS))
            connection.execute(
                table.insert().values(
                    id=delivery_id, account=account, job_id=job_id, received_at=now
                )
            )
    except sa.exc.IntegrityError:
        return False
    return True


def count(engine: Engine, table: sa.Table, delivery_id: str | None = None) -> int:
    """Deliveries recorded (of ``delivery_id`` only, when given)."""
    query = sa.select(sa.func.count()).select_from(table)
    if delivery_id is not None:
        query = query.where(table.c.id == delivery_id)
    with engine.connect() as connection:
        return int(connection.scalar(query) or 0)
