"""Per-operation cost of the store against a raw baseline on the same DBAPI connection.

Claim, the renew tick, checkpoint (100 B, 10 KB, 1 MB) and finish, timed as a worker's
attempt and keeper call them, alternate in blocks with the same work sent by hand through the
same DBAPI connection, as many statements and round trips as the library sends (counted at the
driver). Claims bind their lease to the keeper's holder (``<table>_holders``), as a worker's do.

- claim, checkpoint, finish run on the store's direct connection (``celery_leases/db/dbapi.py``);
  their baseline is ONE single-row autocommit UPDATE on PostgreSQL and SQLite; on MariaDB, for
  the claim (no RETURNING there: it reads its row back), BEGIN, UPDATE, SELECT by primary key,
  COMMIT.
- the renew tick is ONE upsert of the keeper's holder row, whatever the number of leases it
  holds (``Store.renew_holder``): ``renew tick`` as the keeper sends it by default, bound to
  its session (``leases_bind_session``), on that session's connection; ``renew tick,
  unbound`` as it sends it behind a pooler or with the setting off, on the direct connection.
  Its baseline is one hand-written single-row upsert (``INSERT ... ON CONFLICT (id) DO UPDATE
  SET renewed_at, expires_at``; MariaDB: ``ON DUPLICATE KEY UPDATE``) on a table of the
  holders' shape, on the same connection, in the same transaction shape as the library's (on
  MariaDB a session runs its statement between BEGIN and COMMIT).

Medians and p90 in ms.

A third variant, ``same``, sends the library's own statements (their text and parameters, read
at the driver during one library call, for rows of its own) by hand on the same connection:
``library/same`` is the library's Python around its statements, ``same/raw`` what the
statement itself costs the database more than the baseline (the floor).
This module is the one place in bench/ that calls the Store ("store calls" below).

    python -m bench.operations [--quick] [--database postgresql mariadb sqlite]
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from bench.common import (
    available,
    interleaved,
    median_ms,
    p90_ms,
    parser,
    report,
    row,
    scratch,
    steady,
)
from celery_leases.db import migrations
from celery_leases.db.schema import holders_table
from celery_leases.db.session import Session
from celery_leases.db.store import Store
from celery_leases.settings import DEFAULTS, validate
from tests.support.driver import direct_connection, executed, is_control
from tests.support.message import job_message

Call = Callable[[int], Any]
Statements = Callable[[int], list[tuple[str, tuple[Any, ...]]]]

# -- store calls: the only place in bench/ that calls the Store ----------------------------

OWNER, TASK = "bench@host/1", "bench.noop"


def open_store(url: str, table: str, **settings: Any) -> Store:
    """A Store of its own for ``table`` in ``url``, schema created; ``settings`` override."""
    store = Store(validate(DEFAULTS | {"database_url": url, "table": table} | settings))
    migrations.upgrade(store)
    return store


def engine(store: Store) -> sa.engine.Engine:
    return store.engine


_messages: dict[str, Any] = {}


def register(store: Store, job_id: str) -> None:
    """Record a job the way a client publishing it would (a protocol-2 message)."""
    _messages[job_id] = job_message(job_id, TASK)
    store.register(_messages[job_id])


def keeper_session(store: Store) -> Session:
    """A keeper's session of the store's own (the connection its holder is bound to)."""
    return store.db.session()


def session_connection(session: Session) -> Any:
    """The DBAPI connection of ``session`` (it must have run a statement)."""
    direct = session._direct
    if direct is None:
        raise RuntimeError("the session has no connection yet")
    return direct.connection


def renew_holder(store: Store, holder: str, session: Session | None) -> None:
    """One renew tick of a keeper: the upsert of its holder row, bound to ``session`` (None:
    unbound, through the direct connection), its leases lasting the store's lease duration
    past it. Whatever the number of leases bound to the holder, one statement."""
    duration = store.settings.duration
    store.renew_holder(holder, owner=OWNER, shortest=duration, session=session)


def ticker(store: Store, holder: str, session: Session | None) -> Callable[[int], None]:
    """:func:`renew_holder` of ``holder`` as a timed call (its index unused)."""
    return lambda i: renew_holder(store, holder, session)


def claim(store: Store, job_id: str, holder: str | None = None) -> int:
    """Claim a registered job, delivered as recorded, for the store's lease duration; the
    fencing token. With ``holder`` (a keeper's holder row, made by :func:`renew_holder`),
    bound to it as a worker's claim is: refused if it is not bound."""
    outcome = store.claim(
        _messages[job_id], owner=OWNER, duration=store.settings.duration, holder=holder
    )
    token = getattr(outcome, "token", None)
    if token is None:
        raise RuntimeError(f"claim of {job_id} refused: {outcome}")
    if holder is not None and not outcome.bound:  # type: ignore[union-attr]
        raise RuntimeError(f"claim of {job_id} not bound to its holder {holder}")
    return int(token)


def checkpoint(store: Store, job_id: str, token: int, state: str) -> None:
    if not store.checkpoint(job_id, token, state)[0]:
        raise RuntimeError(f"checkpoint of {job_id} refused")


def finish(store: Store, job_id: str, token: int) -> None:
    if not store.finish(job_id, token, result="null"):
        raise RuntimeError(f"finish of {job_id} refused")


def trigger(store: Store, job_id: str, key: str) -> str:
    """Record a trigger of lease key ``key`` as a client publishing it would; the outcome
    (``coalesced`` when a live job holds the key)."""
    _messages[job_id] = job_message(job_id, TASK, leases_key=key)
    return store.register(_messages[job_id]).outcome


def list_jobs(store: Store, states: Sequence[str] = (), task: str | None = None) -> int:
    """``leases list``'s read of the newest 50 jobs; how many it found."""
    return len(store.list_jobs(states=states, task=task, limit=50))


def count_states(store: Store, cap: int | None) -> dict[str, int]:
    """``leases list``'s counts (``cap``) or the whole table's (None: the metrics')."""
    return store.count_by_state() if cap is None else store.count_states(cap=cap).counts


def ids_starting_with(store: Store, prefix: str) -> list[str]:
    return store.ids_starting_with(prefix, limit=5)


def reaper_steps(app: Any) -> dict[str, Callable[[], Any]]:
    """The store calls of one reaper pass (``celery_leases.reaper.reap``), one by one, as the
    pass makes them (the settling of waiting triggers: ``lifecycle.settle`` of each key
    ``pending_keys`` names); the publishes a pass would make are left out."""
    from celery_leases import lifecycle
    from celery_leases.config import settings_for
    from celery_leases.db import store_for

    settings = settings_for(app)
    store, batch = store_for(settings), settings.reap_batch
    return {
        "expire_orphaned": lambda: store.expire_orphaned(batch=batch),
        "release_stale": store.release_stale,
        "collect_expired": lambda: store.collect_expired(
            batch=batch,
            grace=settings.reap_grace,
            max_stalled=settings.max_attempts_without_progress,
            max_attempts=settings.max_attempts,
        ),
        "pending_keys + settle each": lambda: [
            lifecycle.settle(app, store, key) for key in store.pending_keys(batch=batch)
        ],
        "followups_pending": lambda: store.followups_pending(batch=batch),
        "take_notices": lambda: store.take_notices(batch=batch),
        "purge_all (none past retention)": lambda: store.purge_all(
            older_than=settings.retention, batch=batch
        ),
        "prune_holders": lambda: store.prune_holders(idle=3600.0),
    }


def purge(store: Store, older_than: float, batch: int) -> int:
    """One batch of the reaper's retention purge (one transaction); the jobs deleted."""
    return store.purge(older_than=older_than, batch=batch)


# -- the measurement ----------------------------------------------------------------------

#: The baseline's rows: one for checkpoints (its text grows as the library's does), one for
#: the rest (SQLite rewrites a whole record, so a 1 MB checkpoint would weigh on later UPDATEs).
RAW_ROWS = ("raw-row", "raw-checkpoint")
SIZES = {"100 B": 100, "10 KB": 10 * 1024, "1 MB": 1024 * 1024 - 64}
COLUMNS = "database operation calls library_ms raw_ms library/raw library_p90_ms raw_p90_ms"
COLUMNS += " same_ms library/same same/raw round_trips_library round_trips_raw"


def state_text(size: int) -> str:
    """A JSON checkpoint of ``size`` bytes (random hex: little for compression to gain)."""
    return '{"cursor":"' + os.urandom(size // 2).hex()[: size - 13] + '"}'


@contextlib.contextmanager
def raw(conn: Any, sent: Statements, transaction: bool) -> Iterator[Call]:
    """A call that sends ``sent(i)`` through ``conn``'s cursor (in autocommit, as the store's
    direct connection is), between BEGIN and COMMIT if the store's operation is a
    transaction."""

    def call(i: int) -> None:
        cursor = conn.cursor()
        if transaction:
            cursor.execute("BEGIN")
        for sql, params in sent(i):
            cursor.execute(sql, params)
            if cursor.description is not None:
                cursor.fetchall()
        if transaction:
            cursor.execute("COMMIT")
        cursor.close()

    yield call


def same_statements(
    store: Store, once: Callable[[], Any], calls: int, rows: Callable[[int], dict[str, Any]]
) -> Callable[[int], list[tuple[str, Any]]]:
    """What one library call (``once``) sent, made ready by hand for ``calls`` calls, the
    i-th with the parameters ``rows(i)`` changes (its own row): each call's SQL and driver
    parameters, built before the timing."""
    with executed() as seen:
        once()
    ready = [
        [compiled.parameters({**params, **rows(i)}) for _, compiled, params in seen]
        for i in range(calls)
    ]
    return lambda i: ready[i]


def own_row(params: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
    """The parameters of the ``same`` variant's own row, the same at every call."""
    return lambda i: params


def same_rows(store: Store, table: str, column: str) -> dict[str, Any]:
    """``column`` of each row of the ``same`` variant, by id."""
    with store.engine.connect() as connection:
        query = f"SELECT id, {column} FROM {table} WHERE id LIKE 'same-%'"
        return dict(connection.execute(sa.text(query)).all())  # type: ignore[arg-type]


@contextlib.contextmanager
def watched(db: str, conn: Any) -> Iterator[list[tuple[str, str]]]:
    """What ``conn`` sends during the block, seen at the driver, as (kind, text): on
    PostgreSQL each line of libpq's protocol trace (``ReadyForQuery`` ends a round trip; a
    simple-protocol query has its text, each execution of the extended protocol is
    ``EXECUTE``), on SQLite each statement its trace callback sees, on MariaDB each command
    PyMySQL sends."""
    seen: list[tuple[str, str]] = []
    if db == "postgresql":
        with tempfile.TemporaryFile("w+") as trace:
            conn.pgconn.trace(os.dup(trace.fileno()))  # libpq keeps a FILE on the descriptor
            try:
                yield seen
            finally:
                conn.pgconn.untrace()
                trace.seek(0)
                for line in trace:
                    if "ReadyForQuery" in line:
                        seen.append(("trip", ""))
                    elif "\tF\t" in line and "\tQuery\t" in line:
                        seen.append(("statement", line.split("\tQuery\t", 1)[1].split('"')[1]))
                    elif "\tF\t" in line and "\tExecute\t" in line:
                        seen.append(("statement", "EXECUTE"))
        return
    with contextlib.ExitStack() as undo:
        if db == "sqlite":
            conn.set_trace_callback(lambda sql: seen.append(("statement", sql)))
            undo.callback(conn.set_trace_callback, None)
        else:
            cls = type(conn)
            original = cls._execute_command

            def spy(self: Any, command: int, sql: Any) -> Any:
                if self is conn:
                    text = sql.decode() if isinstance(sql, bytes) else str(sql)
                    seen.append(("statement", text))
                return original(self, command, sql)

            cls._execute_command = spy
            undo.callback(setattr, cls, "_execute_command", original)
        yield seen


def shape(db: str, conn: Any, call: Callable[[], Any]) -> tuple[int, bool]:
    """How many statements ``call`` sends on ``conn``, and whether in a transaction (seen at
    the driver)."""
    with watched(db, conn) as seen:
        call()
    sent = [text for kind, text in seen if kind == "statement"]
    statements = [text for text in sent if not is_control(text)]
    return len(statements), len(statements) < len(sent)


def round_trips(db: str, conn: Any, call: Callable[[], Any]) -> int:
    """Round trips ``call`` makes on ``conn``, counted at the driver: ReadyForQuery messages
    in libpq's trace, PyMySQL's commands, statements SQLite's trace callback sees."""
    with watched(db, conn) as seen:
        call()
    counted = "trip" if db == "postgresql" else "statement"
    return sum(kind == counted for kind, _ in seen)


def raw_upsert(db: str, table: str) -> str:
    """The renew tick's baseline: a hand-written single-row upsert of a holder row's two
    lease columns (``table`` has the holders' shape)."""
    p = "?" if db == "sqlite" else "%s"
    insert = (
        f"INSERT INTO {table} (id, owner, renewed_at, expires_at, created_at) "
        f"VALUES ({p}, {p}, {p}, {p}, {p}) "
    )
    if db == "mariadb":
        return insert + (
            "ON DUPLICATE KEY UPDATE renewed_at = VALUES(renewed_at), "
            "expires_at = VALUES(expires_at)"
        )
    return insert + (
        "ON CONFLICT (id) DO UPDATE SET renewed_at = excluded.renewed_at, "
        "expires_at = excluded.expires_at"
    )


#: Holder rows (``<table>_holders``): the keeper's (bound to its session, and unbound), the
#: ``same`` variant's own, and the baseline's (in a table of the same shape).
HOLDER, UNBOUND = "bench-keeper", "bench-keeper-unbound"
SAME_HOLDER = {HOLDER: "same-keeper", UNBOUND: "same-keeper-unbound"}
RAW_HOLDER = "raw-keeper"


def measure(db: str, url: str, *, calls: int, block: int, big_calls: int) -> list[dict[str, Any]]:
    """One row per operation on the database at ``url`` (``db``: its name)."""
    rows = []
    with scratch(url, "ops") as table:
        store = open_store(url, table)
        # The keeper's holder, bound to its session, made before the first claim as a
        # worker's keeper makes it (``Keeper.holder_for``); every claim here binds to it.
        session = keeper_session(store)
        renew_holder(store, HOLDER, session)
        ids = [f"job-{i}" for i in range(calls + 2)]  # the last two: shape and round trips
        for job_id in [*ids, "held", *RAW_ROWS]:
            register(store, job_id)
        held = ("held", claim(store, "held", HOLDER))
        for job_id in RAW_ROWS:
            claim(store, job_id, HOLDER)
        conn = direct_connection(store)
        on_session = session_connection(session)
        p = "?" if db == "sqlite" else "%s"
        # The renew tick's baseline table: the holders' shape, its one row made beforehand.
        raw_holders = holders_table(sa.MetaData(), f"{table}_raw")
        raw_holders.create(engine(store))
        upsert = raw_upsert(db, raw_holders.name)
        duration = store.settings.duration

        def upserted(i: int) -> list[tuple[str, tuple[Any, ...]]]:
            now = float(i)
            return [(upsert, (RAW_HOLDER, OWNER, now, now + duration, now))]

        with raw(conn, upserted, False) as first:
            first(0)

        def updated(state: str | None, statements: int) -> Statements:
            """The one-column UPDATE baseline of a claim, checkpoint or finish (a checkpoint
            also sets its text, on a row of its own), and its read back."""
            raw_row = RAW_ROWS[state is not None]
            sets = f"renewed_at = {p}" + ("" if state is None else f", checkpoint = {p}")
            update = f"UPDATE {table} SET {sets} WHERE id = {p}"
            select = (f"SELECT token FROM {table} WHERE id = {p}", (raw_row,))

            def sent(i: int) -> list[tuple[str, tuple[Any, ...]]]:
                values = (float(i),) if state is None else (float(i), state)
                return [(update, (*values, raw_row)), *[select] * (statements - 1)]

            return sent

        def compare(
            name: str,
            library: Call,
            state: str | None = None,
            *,
            same: Statements,
            on: Any = conn,
            baseline: Statements | None = None,
        ) -> None:
            """Time ``library`` against its baseline (the one-column UPDATE, or
            ``baseline``) and ``same``, all on the connection ``on``."""
            statements, transaction = shape(db, on, lambda: library(calls))
            sent = baseline or updated(state, statements)
            if baseline is not None and statements != 1:
                raise RuntimeError(f"{name}: {statements} statements, the baseline sends one")

            def base() -> contextlib.AbstractContextManager[Call]:
                return raw(on, sent, transaction)

            n = big_calls if state and len(state) > 100_000 else calls
            variants = {
                "library": steady(library),
                "raw": base,
                "same": lambda: raw(on, same, transaction),
            }
            times = interleaved(variants, calls=n, block=min(block, n // 4))
            # Counted after the timing: a statement psycopg prepares (at its sixth run on a
            # connection) takes one more round trip that once.
            library_trips = round_trips(db, on, lambda: library(calls + 1))
            with base() as call:
                raw_trips = round_trips(db, on, lambda: call(calls + 1))
            lib, floor, again = (median_ms(times[v]) for v in ("library", "raw", "same"))
            print(f"  {db} {name}: {lib:.3f} vs {floor:.3f} ms (same: {again:.3f})", flush=True)
            p90 = p90_ms(times["library"]), p90_ms(times["raw"])
            values = (
                db, name, n, lib, floor, lib / floor, *p90, again, lib / again, again / floor,
                library_trips, raw_trips,
            )  # fmt: skip
            rows.append(row(COLUMNS, *values))

        # The rows the ``same`` variant claims and finishes (one each per call), and the
        # probes whose library calls give it the statements.
        fresh = [f"same-{i}" for i in range(calls + 1)]
        for job_id in [*fresh, "probe-claim", "probe-finish"]:
            register(store, job_id)
        versions = same_rows(store, table, "version")
        claim_rows = same_statements(
            store,
            lambda: claim(store, "probe-claim", HOLDER),
            calls,
            lambda i: {"b_id": fresh[i], "b_version": versions[fresh[i]]},
        )
        # The renew ticks: the keeper's holder bound to its session, and one unbound; the
        # ``same`` variant renews a holder row of its own (made here: an update, as the
        # library's).
        ticks: dict[str, tuple[Call, Statements, Any]] = {}
        for holder, bound, on in ((HOLDER, session, on_session), (UNBOUND, None, conn)):
            renew_holder(store, SAME_HOLDER[holder], bound)
            tick = ticker(store, holder, bound)
            own: dict[str, Any] = {"b_holder": SAME_HOLDER[holder]}
            same = same_statements(store, functools.partial(tick, 0), calls, own_row(own))
            ticks[holder] = (tick, same, on)

        tokens: dict[int, int] = {}
        compare(
            "claim", lambda i: tokens.__setitem__(i, claim(store, ids[i], HOLDER)), same=claim_rows
        )
        for name, holder in (("renew tick", HOLDER), ("renew tick, unbound", UNBOUND)):
            renew, renewed, on = ticks[holder]
            compare(name, renew, same=renewed, on=on, baseline=upserted)
        for label, size in SIZES.items():
            text = state_text(size)

            def write(i: int, text: str = text) -> None:
                checkpoint(store, *held, text)

            n = big_calls if size > 100_000 else calls
            same = same_statements(store, lambda: write(0), n, lambda i: {})
            compare(f"checkpoint {label}", write, text, same=same)
        # The same variant's rows, claimed by its claims above (each once: a token above 0,
        # from the database clock since failover-safe tokens).
        fresh_tokens = same_rows(store, table, "token")
        claimed = sorted(token > 0 for token in fresh_tokens.values())
        if claimed != [False] + [True] * calls:  # same-<calls> is never claimed
            raise RuntimeError("the same variant's claims did not all claim their row")
        probe = claim(store, "probe-finish", HOLDER)
        finish_rows = same_statements(
            store,
            lambda: finish(store, "probe-finish", probe),
            calls,
            lambda i: {"b_id": fresh[i], "b_token": fresh_tokens[fresh[i]]},
        )
        compare("finish", lambda i: finish(store, ids[i], tokens[i]), same=finish_rows)
        if list(same_rows(store, table, "state").values()).count("done") != calls:
            raise RuntimeError("the same variant's finishes did not all finish their row")
        session.close()
        engine(store).dispose()
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    command = parser(__doc__)
    command.add_argument(
        "--database",
        nargs="+",
        choices=("postgresql", "mariadb", "sqlite"),
        default=("postgresql", "mariadb", "sqlite"),
    )
    args = command.parse_args(argv)
    calls, block, big = (200, 25, 20) if args.quick else (1000, 50, 100)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-operations-") as folder:
        sqlite = f"sqlite:///{folder}/leases.sqlite3"
        urls = {"postgresql": available("postgres"), "mariadb": available("mariadb")}
        for db, url in (urls | {"sqlite": sqlite}).items():
            if url and db in args.database:
                print(f"{db}: {calls} calls per operation and side (1 MB: {big})...", flush=True)
                rows += measure(db, url, calls=calls, block=block, big_calls=big)
    title = "Store operations vs the raw baseline on the same connection (median ms)"
    report("operations", rows, quick=args.quick, title=title, block=block)


if __name__ == "__main__":
    main()
