"""The edges of the Django integration, in the example project (SQLite, PostgreSQL, MariaDB): a
key's cursor saved inside ``transaction.atomic()``, a leased task run inside a transaction it
did not open (Django's ``TestCase``, ``ATOMIC_REQUESTS`` with eager tasks), and the reaper's
expiry under django-celery-beat's DatabaseScheduler.

Leases last a few seconds here, and each scenario has a short time limit: an attempt that
waits on a lock of its own transaction fails the test in seconds instead of hanging."""

from __future__ import annotations

import pytest

from tests.django.conftest import Shop

#: A short lease, so that a database ends a transaction stuck behind its own lock quickly.
SHORT_LEASE = {"SHOP_LEASE_SECONDS": "3"}
#: The invoicing view runs its task in the request, inside the request's transaction.
EAGER_REQUESTS = SHORT_LEASE | {"SHOP_EAGER": "1", "SHOP_ATOMIC_REQUESTS": "1"}
#: Seconds a scenario may take (Django's start included).
QUICK = 30


def test_a_key_cursor_saved_in_an_atomic_block_that_fails_rolls_back_with_its_orm_writes(
    shop: Shop,
) -> None:
    # Given a keyed job whose block committed an invoice with the cursor {"after": 0}
    # When the key's next job writes an invoice and the cursor {"after": 1} in an atomic()
    # block that then raises
    seen = shop.run("cursor_in_failed_block", env=SHORT_LEASE, timeout=QUICK)

    # Then the job failed, and neither its invoice nor its cursor is stored
    assert seen["first run"] == "SUCCESS"
    assert seen["cursor after the first run"] == {"after": 0}
    assert seen["failed run"][0] == "FAILURE" and "fails after its writes" in seen["failed run"][1]
    assert seen["failed job"] == "failed"
    assert seen["invoices"] == [0]
    assert seen["cursor after the failed run"] == {"after": 0}


def test_a_checkpoint_then_the_key_cursor_in_one_atomic_block_commit_together_at_once(
    shop: Shop,
) -> None:
    # When a keyed job saves, in each of its atomic() blocks, an invoice, its checkpoint, then
    # its key's cursor (the cursor once waited behind the checkpoint's lock: a lease, then
    # the block was ended)
    seen = shop.run("checkpoint_and_cursor_in_one_block", env=SHORT_LEASE, timeout=QUICK)

    # Then the job ends done at its first attempt, with every write of both blocks stored
    assert seen["run"] == ["SUCCESS", "2"]
    assert seen["job"] == ["done", {"next": 2}, 1]
    assert seen["cursor"] == {"after": 1}
    assert seen["invoices"] == [0, 1]


@pytest.mark.parametrize("through", ["apply", "view"])
def test_a_leased_task_run_inside_a_django_test_case_is_done_there_and_rolled_back_with_it(
    shop: Shop, through: str
) -> None:
    # Given a test of Django's TestCase (its transaction rolled back after it)
    # When it runs invoice_orders by task.apply(), or by a POST to the invoicing view with
    # eager tasks and ATOMIC_REQUESTS
    seen = shop.run("in_test_case", through=through, env=EAGER_REQUESTS, timeout=QUICK)

    # Then the test passed, and saw the job done, its invoices written, inside its transaction
    assert seen["test errors"] == []
    if through == "apply":
        assert seen["outcome"] == ["SUCCESS", "3"]
    else:
        assert seen["outcome"][0] == 202, seen["outcome"]
    assert seen["invoices inside"] == [0, 1, 2]
    assert seen["job inside"] == ["done", 1, "3"]
    # And nothing of the job is left once that transaction is rolled back
    assert seen["invoices after"] == []
    assert seen["job after"] is None


def test_an_eager_leased_task_in_an_atomic_request_commits_with_the_response(
    shop: Shop,
) -> None:
    # When a POST to the invoicing view runs invoice_orders eagerly, inside the request's
    # transaction (ATOMIC_REQUESTS)
    seen = shop.run("eager_in_atomic_request", env=EAGER_REQUESTS, timeout=QUICK)

    # Then the request succeeded, and the job is done with its invoices, committed with it
    assert seen.get("error") is None, seen["error"]
    assert seen["status"] == 202
    assert seen["job"] == ["done", 1, 3]
    assert seen["invoices"] == [0, 1, 2]


@pytest.mark.parametrize("shop", ["sqlite"], indirect=True)
def test_a_reaper_pass_sent_by_django_celery_beat_database_scheduler_carries_its_expiry(
    shop: Shop,
) -> None:
    # Given the reaper's entry (schedule_reaper, every 10 s) as django-celery-beat's
    # DatabaseScheduler stored and loaded it (it keeps no "expires" of an entry's options)
    # When the scheduler sends a pass of it, as beat does when the entry is due
    seen = shop.run("reaper_under_database_scheduler", timeout=QUICK)

    # Then the pass's message expires as schedule_reaper set: max(2 * every, 10) seconds
    assert seen["entry"][0] == "celery_leases.reap"
    assert seen["stored every"] == [10, "seconds"]
    assert seen["published"] == 1
    assert seen["expires in"] is not None, "the reaper pass was sent without an expiry"
    assert 0 < seen["expires in"] <= 20


def test_async_code_sends_a_leased_task_with_adelay_and_adelay_on_commit(shop: Shop) -> None:
    # When a coroutine (an ASGI view) sends invoice_orders (no broker worker: recorded and
    # published to the in-memory broker)
    seen = shop.run("adelay_on_commit_in_async_code", timeout=QUICK)

    # Then Django refuses the synchronous delay_on_commit() there, and the async forms work:
    # adelay_on_commit() returns None, as delay_on_commit() does, and records the job;
    # adelay() returns the job's id
    assert seen["delay_on_commit"] == "SynchronousOnlyOperation", seen
    assert seen["adelay_on_commit"] is None and seen["adelay_on_commit recorded"], seen
    assert seen["adelay state"] == "queued", seen
