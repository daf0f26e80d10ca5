"""The operators' reads (``leases list``, ``watch``, an id prefix) on a table of many jobs: the
right jobs and counts, each read through an index (the plans EXPLAIN shows), never a scan of
every finished job."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_leases.db.store import Store
from celery_leases.settings import DEFAULTS, validate
from tests.support.message import job_message

#: The table's jobs by state and task: mostly finished ones, as after months of use.
SHAPE = {
    ("done", "tests.a"): 1500,
    ("done", "tests.b"): 400,
    ("done", "tests.c"): 10,
    ("failed", "tests.a"): 40,
    ("queued", "tests.a"): 30,
    ("running", "tests.b"): 20,
}
TOTAL = sum(SHAPE.values())


@pytest.fixture
def store(database_url: str, table_name: str) -> Iterator[Store]:
    store = Store(validate(DEFAULTS | {"database_url": database_url, "table": table_name}))
    yield store
    store.engine.dispose()


@pytest.fixture
def filled(store: Store) -> list[dict[str, Any]]:
    """The store's table holding ``SHAPE``'s jobs, created one second apart in a shuffled
    order of states; their rows (id, task, state, created_at)."""
    store.register(job_message("template"))
    t = store.table
    with store.engine.begin() as c:
        message = c.execute(sa.select(t.c.message).where(t.c.id == "template")).scalar_one()
        c.execute(sa.delete(t))
    kinds = [kind for kind, n in SHAPE.items() for _ in range(n)]
    kinds = [kinds[(i * 7919) % len(kinds)] for i in range(len(kinds))]  # 7919: a prime
    made = [
        {"id": str(uuid.uuid4()), "task": task, "state": state, "created_at": 1e9 + i}
        for i, (state, task) in enumerate(kinds)
    ]
    ended = 1e9 + TOTAL
    with store.engine.begin() as c:
        values = [
            row | {"message": message, "finished_at": ended if row["state"] != "queued" else None}
            for row in made
        ]
        c.execute(sa.insert(t), values)
        analyze(c, t.name)
    return made


def analyze(c: sa.Connection, table: str) -> None:
    """Statistics, as a database that has run for a while has them."""
    if c.dialect.name == "sqlite":
        return
    c.execute(
        sa.text(f"ANALYZE TABLE {table}" if c.dialect.name != "postgresql" else f"ANALYZE {table}")
    )


def plan(store: Store, statement: Any, params: dict[str, Any], *, bitmaps: bool = True) -> str:
    """The database's plan of ``statement`` with ``params`` as one text. PostgreSQL is told
    to avoid scans of the whole table, which it would pick for a table this small anyway:
    a plan naming an index there means the index serves the query."""
    compiled = statement.params(**params).compile(
        dialect=store.engine.dialect, compile_kwargs={"literal_binds": True}
    )
    name = store.engine.dialect.name
    explain = "EXPLAIN QUERY PLAN " if name == "sqlite" else "EXPLAIN "
    with store.engine.begin() as c:
        if name == "postgresql":
            c.execute(sa.text("SET LOCAL enable_seqscan = off"))
            if not bitmaps:
                c.execute(sa.text("SET LOCAL enable_bitmapscan = off"))
        found = c.execute(sa.text(explain + str(compiled))).all()
    return "\n".join(" ".join(str(value) for value in row) for row in found)


def newest(made: list[dict[str, Any]], limit: int, **where: Any) -> list[str]:
    kept = [r for r in made if all(r[k] in v for k, v in where.items())]
    return [r["id"] for r in sorted(kept, key=lambda r: -r["created_at"])[:limit]]


def test_list_shows_the_newest_jobs_of_the_states_and_task_asked(
    store: Store, filled: list[dict[str, Any]]
) -> None:
    # When jobs are listed as `leases list` lists them, with and without filters
    every = store.list_jobs(limit=50)
    live = store.list_jobs(states=["running", "queued"], limit=25)
    running_b = store.list_jobs(states=["running"], task="tests.b", limit=5)
    of_a = store.list_jobs(task="tests.a", limit=60)

    # Then each is the newest of the jobs that match, newest first
    assert [j.id for j in every] == newest(filled, 50)
    assert [j.id for j in live] == newest(filled, 25, state={"running", "queued"})
    assert [j.id for j in running_b] == newest(filled, 5, state={"running"}, task={"tests.b"})
    assert [j.id for j in of_a] == newest(filled, 60, task={"tests.a"})
    assert store.list_jobs(states=["cancelled"]) == []


def test_each_state_is_counted_exactly_or_up_to_the_cap_it_says_it_passed(
    store: Store, filled: list[dict[str, Any]]
) -> None:
    # When the states are counted with a cap under the done jobs' number, and at the failed
    capped = store.count_states(cap=40)
    exact = store.count_states(cap=TOTAL)

    # Then the live states are exact, a finished one past the cap is counted as it and says so
    assert capped.counts == {"done": 40, "failed": 40, "queued": 30, "running": 20}
    assert capped.capped == {"done"}
    assert exact.counts == {"done": 1910, "failed": 40, "queued": 30, "running": 20}
    assert exact.capped == frozenset()
    assert exact.counts == store.count_by_state()


#: Ids whose prefixes LIKE or GLOB would read as patterns, or match in another case (not
#: differing in case only: MariaDB's collation would take them for one id).
AWKWARD = ["ab*c", "abXc", "AB*d", "ab%x", "ab_x", "abzx", "a[b]", "a\\b", "Ab?e", "ab?d"]


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("ab*", ["ab*c"]),
        ("AB", ["AB*d"]),
        ("ab%", ["ab%x"]),
        ("ab_", ["ab_x"]),
        ("a[", ["a[b]"]),
        ("a\\", ["a\\b"]),
        ("ab?", ["ab?d"]),
        ("ab", ["ab%x", "ab*c", "ab?d", "abXc", "ab_x", "abzx"]),
        ("zz", []),
    ],
)
def test_an_id_prefix_finds_exactly_the_ids_starting_with_it_in_its_case(
    store: Store, prefix: str, expected: list[str]
) -> None:
    for job_id in AWKWARD:
        store.register(job_message(job_id))

    found = store.ids_starting_with(prefix, limit=10)

    assert sorted(found) == sorted(expected)


def index(store: Store, what: str) -> str:
    return f"ix_{store.table.name}_{what}"


def test_list_reads_each_state_through_the_state_index_newest_first(
    store: Store, filled: list[dict[str, Any]]
) -> None:
    reads = store.sql.reads
    params = {"b_state": "done", "b_task": "tests.c", "b_limit": 50}

    by_state = plan(store, reads.newest, params)
    by_task = plan(store, reads.newest_of_task, params)

    assert index(store, "state_created") in by_state, by_state
    assert index(store, "task_created") in by_task, by_task
    for text in (by_state, by_task):  # the index gives the order: nothing sorts the rows
        assert "TEMP B-TREE" not in text and "Sort" not in text and "filesort" not in text, text


def test_the_states_are_counted_in_an_index_led_by_the_state(
    store: Store, filled: list[dict[str, Any]]
) -> None:
    reads = store.sql.reads

    live = plan(store, reads.count_live, {})
    done = plan(store, reads.count_up_to, {"b_state": "done", "b_cap": 10})

    # (the expiry's index, state and expires_at, serves as well as the newest's)
    for text in (live, done):
        assert any(index(store, i) in text for i in ("state_created", "expiry")), text


def test_an_id_prefix_is_looked_up_in_an_index_of_the_ids(
    store: Store, filled: list[dict[str, Any]]
) -> None:
    params = {"b_prefix": store.dialect.prefix_pattern("ab"), "b_limit": 5}

    text = plan(store, store.sql.reads.ids_starting_with, params)

    name = store.engine.dialect.name
    if name == "sqlite":  # a search of the primary key's index by a range of ids
        assert "SEARCH" in text and "sqlite_autoindex" in text and "id>?" in text, text
    elif name == "postgresql":  # a range of the pattern index, not a filter over the key's
        assert index(store, "id_prefix") in text and "Index Cond" in text, text
    else:
        assert " range " in f" {text} " and "PRIMARY" in text, text


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_the_reapers_search_for_expired_leases_reads_the_live_jobs_by_expiry_in_order(
    store: Store, filled: list[dict[str, Any]]
) -> None:
    # (SQLite and MariaDB search their expiry index, state and expires_at, a range per state)
    # PostgreSQL told to avoid bitmaps, which this small a table favours: at 100,000 live jobs
    # it read them all through one and sorted them (54 ms a pass)
    statement = store.sql.reaper.expired_candidates.limit(10)
    text = plan(store, statement, {}, bitmaps=False)

    # The partial index of live jobs by expiry, read in order: nothing sorts the rows, and
    # the search stops at its batch
    assert index(store, "live_expiry") in text, text
    assert "Sort" not in text, text
