"""Scenarios run inside the example Django project, one process each (Django is set up once
per process): ``python -m tests.django.scenario NAME ARGS_JSON`` prints what the scenario
returns as JSON on its last line. ``tests/django/conftest.py`` (``Shop.run``) runs them.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import django

SCENARIOS: dict[str, Callable[..., Any]] = {}


def scenario(function: Callable[..., Any]) -> Callable[..., Any]:
    SCENARIOS[function.__name__] = function
    return function


def _two_attempts(job_id: str) -> tuple[Any, Any]:
    """A recorded job claimed twice (the first lease released in between): (stale, fresh)."""
    from billing.tasks import invoice_orders

    from celery_leases.lease import Lease
    from tests.support.message import job_message

    store = invoice_orders.lease_store
    sent = job_message(job_id, invoice_orders.name, args=[job_id, 2])
    store.register(sent)
    first = store.claim(sent, owner="w1/1", duration=30.0)
    assert store.release(job_id)
    second = store.claim(sent, owner="w2/2", duration=30.0)
    stale = Lease(job_id, first.token, first.attempt, None, "w1/1", 30.0, 10.0)
    fresh = Lease(job_id, second.token, second.attempt, None, "w2/2", 30.0, 10.0)
    return stale, fresh


@scenario
def where() -> dict[str, Any]:
    """Where the Celery app of the project keeps its leases."""
    from celery import current_app

    from celery_leases.config import settings_for
    from celery_leases.contrib.django import database

    settings = settings_for(current_app)
    return {
        "celery_url": settings.database_url,
        "django_url": database.url_for("default"),
        "alias": database.alias(),
        "alias_url": database.url_for(database.alias()),
        "table": settings.table,
    }


@scenario
def url_error() -> str | None:
    """What building the leases URL from ``DATABASES["default"]`` refuses, or None."""
    from celery_leases.contrib.django import database
    from celery_leases.errors import ConfigurationError

    try:
        database.url_for("default")
    except ConfigurationError as exc:
        return str(exc)
    return None


@scenario
def orm_checkpoint() -> dict[str, Any]:
    """An invoice and the checkpoint after it, in one ``atomic()`` block: a stale attempt's,
    a fresh attempt's that rolls back, and a fresh attempt's that commits."""
    from billing.models import Invoice
    from billing.tasks import invoice_orders
    from django.db import transaction

    from celery_leases import LeaseLost
    from celery_leases.lease import current

    job_id = f"orm-{uuid.uuid4().hex}"
    store = invoice_orders.lease_store
    stale, fresh = _two_attempts(job_id)
    seen: dict[str, Any] = {}

    def invoice(lease: Any, number: int) -> None:
        Invoice.objects.create(
            batch=job_id, number=number, attempt=lease.attempt, token=lease.token
        )
        invoice_orders.checkpoint({"next": number + 1}, progress=(number + 1, 2))

    current.stack.append(stale)
    try:
        with transaction.atomic():
            invoice(stale, 0)
    except LeaseLost as exc:
        seen["stale"] = type(exc).__name__
    finally:
        current.stack.remove(stale)
    seen["invoices after the stale attempt"] = Invoice.objects.filter(batch=job_id).count()

    current.stack.append(fresh)
    try:
        try:
            with transaction.atomic():
                invoice(fresh, 0)
                raise RuntimeError("the block fails after the checkpoint")
        except RuntimeError:
            pass
        job = store.get(job_id)
        seen["checkpoint after a rolled-back block"] = job.checkpoint
        seen["invoices after a rolled-back block"] = Invoice.objects.filter(batch=job_id).count()
        with transaction.atomic():
            invoice(fresh, 0)
            # Another connection (the store's own) does not see it before the commit.
            seen["checkpoint seen before the commit"] = store.get(job_id).checkpoint
        job = store.get(job_id)
        seen["checkpoint after the commit"] = job.checkpoint
        seen["progress after the commit"] = [job.progress_done, job.progress_total]
    finally:
        current.stack.remove(fresh)
    seen["invoices"] = list(
        Invoice.objects.filter(batch=job_id).values_list("number", "token").order_by("id")
    )
    seen["fresh token"] = fresh.token
    return seen


@scenario
def delay_on_commit() -> dict[str, Any]:
    """``delay_on_commit`` of a leased task: recorded and sent only when the block commits."""
    from billing.tasks import invoice_orders
    from django.db import transaction

    store = invoice_orders.lease_store

    def recorded(batch: str) -> list[str]:
        jobs = store.list_jobs(task=invoice_orders.name, limit=1000)
        return [job.state for job in jobs if job.args[:1] == [batch]]

    batch = f"delay-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        invoice_orders.delay_on_commit(batch, 3)
        inside = recorded(batch)
    rolled = f"rolled-{uuid.uuid4().hex[:8]}"
    try:
        with transaction.atomic():
            invoice_orders.delay_on_commit(rolled, 3)
            raise RuntimeError("rolled back")
    except RuntimeError:
        pass
    return {
        "inside the block": inside,
        "after the commit": recorded(batch),
        "after a rollback": recorded(rolled),
    }


@scenario
def admin() -> dict[str, Any]:
    """The admin, through Django's test client: what a staff user sees and what the actions
    do to a queued, a running and a failed job."""
    from billing.tasks import invoice_orders
    from django.contrib.auth.models import User
    from django.test import Client
    from django.test.utils import setup_test_environment

    from tests.support.message import job_message

    store = invoice_orders.lease_store
    tag = uuid.uuid4().hex[:8]
    ids = {state: f"{state}-{tag}" for state in ("queued", "running", "failed", "done")}
    for state, job_id in ids.items():
        sent = job_message(job_id, invoice_orders.name, args=[job_id, 10])
        store.register(sent)
        if state == "queued":
            continue
        claimed = store.claim(sent, owner=f"w@host/{tag}", duration=300.0)
        store.checkpoint(job_id, claimed.token, '{"next": 4}', progress=(4, 10))
        if state == "failed":
            store.fail(job_id, claimed.token, error="ValueError: boom")
        elif state == "done":
            store.finish(job_id, claimed.token, result="10")
    setup_test_environment()  # the client records each response's context
    user = User.objects.create_superuser(f"admin-{tag}", f"{tag}@example.com", "pw")
    client = Client()
    client.force_login(user)
    page = "/admin/celery_leases/job/"
    seen: dict[str, Any] = {}

    def listed(query: str) -> list[str]:
        response = client.get(page + query)
        assert response.status_code == 200, response.status_code
        text = response.content.decode()
        return sorted(state for state, job_id in ids.items() if job_id in text)

    h = store.holders  # no reaper pass recorded: the list warns
    with store.engine.begin() as connection:
        connection.execute(h.delete().where(h.c.id == "reaper"))
    everything = client.get(page).content.decode()
    seen["listed"] = listed("")
    seen["progress shown"] = "40% (4 / 10)" in everything
    seen["filtered by state running"] = listed("?state__exact=running")
    # A job of a group waiting for its admission: the state filter's waiting
    from celery_leases.message import GROUP_HEADER

    waiting_id = f"waiting-{tag}"
    store.register(
        job_message(waiting_id, invoice_orders.name, args=[waiting_id, 1], **{GROUP_HEADER: tag})
    )
    filtered = client.get(page + "?state__exact=waiting").content.decode()
    queued = client.get(page + "?state__exact=queued").content.decode()
    seen["filtered by state waiting"] = [waiting_id in filtered, ids["queued"] in filtered]
    seen["filtered by state queued"] = [waiting_id in queued, ids["queued"] in queued]
    seen["reaper warning"] = "no reaper pass" in everything
    seen["filtered by task"] = listed(f"?task__exact={invoice_orders.name}")
    seen["searched by id prefix"] = listed(f"?q=running-{tag[:4]}")
    t = store.table  # the done job was created two hours ago
    with store.engine.begin() as connection:
        connection.execute(
            t.update().where(t.c.id == ids["done"]).values(created_at=t.c.created_at - 7200)
        )
    seen["created in the past hour"] = listed("?created=hour")
    # The times are datetimes in the ORM, and lookups take datetimes
    from datetime import date, timedelta

    from django.utils import timezone

    from celery_leases.contrib.django import database
    from celery_leases.contrib.django.models import Job

    jobs = Job.objects.using(database.alias()).filter(id__in=list(ids.values()))
    an_hour_ago = timezone.now() - timedelta(hours=1)
    created = jobs.get(id=ids["running"]).created_at
    seen["created_at"] = [type(created).__name__, created.tzinfo is not None]
    seen["created since an hour ago"] = jobs.filter(created_at__gte=an_hour_ago).count()
    seen["created before an hour ago"] = jobs.filter(created_at__lt=an_hour_ago).count()
    # ... or a date, a datetime's text, epoch seconds (each job was created after 2000)
    seen["taken as a date, text and seconds"] = [
        jobs.filter(created_at__gte=since).count()
        for since in (date(2000, 1, 1), "2000-01-01 00:00", 946684800)
    ]
    # Transforms read the time as a datetime in SQL: each job's day there is its day here
    days = {job_id: timezone.localdate(jobs.get(id=job_id).created_at) for job_id in ids.values()}
    seen["__date as in Python"] = [
        jobs.filter(created_at__date=day).filter(id=job_id).exists()
        and jobs.filter(created_at__date=day).count() == list(days.values()).count(day)
        for job_id, day in days.items()
    ]
    local = timezone.localtime(created)
    seen["__year and __hour"] = [
        jobs.filter(created_at__year=local.year, created_at__hour=local.hour)
        .filter(id=ids["running"])
        .exists()
    ]
    seen["datetimes by day"] = [d.date() for d in jobs.datetimes("created_at", "day")] == sorted(
        set(days.values())
    )
    # The date hierarchy: its links, and the jobs of the running job's day through them
    day = days[ids["running"]]
    text = client.get(page).content.decode()
    seen["date hierarchy links"] = bool(re.search(r'href="\?created_at__(day|month|year)=', text))
    by_day = f"?created_at__year={day.year}&created_at__month={day.month}&created_at__day={day.day}"
    seen["listed on the running job's day"] = listed(by_day)
    seen["expected on that day"] = sorted(s for s, i in ids.items() if days[i] == day)
    detail = client.get(f"{page}{ids['running']}/change/")
    seen["detail status"] = detail.status_code
    seen["detail has a save button"] = 'name="_save"' in detail.content.decode()
    seen["detail shows the checkpoint"] = "&quot;next&quot;: 4" in detail.content.decode()
    seen["detail post status"] = client.post(f"{page}{ids['running']}/change/", {}).status_code
    seen["add status"] = client.get(f"{page}add/").status_code

    def act(action: str, *states: str) -> list[str]:
        response = client.post(
            page,
            {"action": action, "_selected_action": [ids[s] for s in states], "index": 0},
            follow=True,
        )
        return [str(m) for m in response.context["messages"]]

    seen["cancel messages"] = act("cancel", "queued", "running", "done")
    seen["retry messages"] = act("retry", "failed")
    seen["release messages"] = act("release", "running")
    # A staff user who may only view the jobs is offered none of the actions (each needs the
    # change permission), and the list still shows them
    from django.contrib.auth.models import Permission

    viewer = User.objects.create_user(f"viewer-{tag}", f"v{tag}@example.com", "pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    viewing = Client()
    viewing.force_login(viewer)
    shown = viewing.get(page)
    form = shown.context["action_form"] if shown.context else None
    seen["viewer sees"] = [
        shown.status_code,
        [] if form is None else [name for name, _ in form.fields["action"].choices if name],
    ]
    jobs = {state: store.get(job_id) for state, job_id in ids.items()}
    seen["after"] = {
        state: [job.state, job.stop_requested, (job.expires_in or 0) <= 0]
        for state, job in jobs.items()
    }
    seen["failed job's checkpoint"] = jobs["failed"].checkpoint
    seen.update(_admin_keys(client, store, tag))
    seen.update(_admin_groups(client, store, tag))
    return seen


def _admin_groups(client: Any, store: Any, tag: str) -> dict[str, Any]:
    """The job groups' admin: each group's limit, rate, tokens, admitted and waiting jobs, a
    link to its jobs; the jobs list filtered by group, a waiting job shown ``waiting``, and
    a job's page showing its group."""
    import html
    import re

    from billing.tasks import invoice_orders

    from celery_leases.message import GROUP_HEADER
    from tests.support.message import job_message

    limited, unlimited = f"tenant:a-{tag}", f"tenant:b-{tag}"
    members = {limited: [f"a{n}-{tag}" for n in range(3)], unlimited: [f"b0-{tag}"]}
    for group, ids in members.items():
        for job_id in ids:
            header = {GROUP_HEADER: group}
            store.register(job_message(job_id, invoice_orders.name, args=[job_id, 1], **header))
    store.admit(limited, limits=(1, 1 / 6), define=True)  # 10/m: one admitted, two wait
    store.admit(
        unlimited, limits=(None, None), define=True, most=0
    )  # its admission not run yet: one waits
    page = "/admin/celery_leases/jobgroup/"

    def cells(text: str, marker: str) -> dict[str, str]:
        """The cells of the list's row holding ``marker``, by field, as text."""
        row = next(r for r in re.findall(r"<tr.*?</tr>", text, re.S) if marker in r)
        found = re.findall(r'class="field-(\w+)[^"]*"[^>]*>(.*?)</t[dh]>', row, re.S)
        return {name: html.unescape(re.sub("<[^>]+>", "", value)).strip() for name, value in found}

    def cells_of_page(text: str) -> dict[str, str]:
        """The read-only fields of a change page, by field, as text."""
        found = re.findall(
            r'<div class="[^"]*field-(\w+)".*?<div class="readonly">(.*?)</div>', text, re.S
        )
        return {name: html.unescape(re.sub("<[^>]+>", "", value)).strip() for name, value in found}

    listing = client.get(f"{page}?q=tenant")
    text = listing.content.decode()
    seen: dict[str, Any] = {"groups status": listing.status_code}
    shown = {group: cells(text, html.escape(group)) for group in members}
    seen["groups listed"] = {
        group: [row["limit"], row["rate_shown"], row["admitted"], row["waiting"]]
        for group, row in shown.items()
    }
    seen["tokens now"] = [row["tokens_now"] for row in shown.values()]
    link = re.search(r'href="([^"]*\?group=[^"]*)"[^>]*>' + re.escape(limited), text)
    seen["group's jobs link"] = None if link is None else html.unescape(link[1])
    seen["group add status"] = client.get(f"{page}add/").status_code
    from django.contrib.admin.utils import quote

    own = client.get(f"{page}{quote(limited)}/change/")
    seen["group's page"] = [own.status_code, 'name="_save"' in own.content.decode()]
    seen["group's page shows"] = cells_of_page(own.content.decode())
    jobs = client.get(seen["group's jobs link"] or "/").content.decode()
    everyone = [job_id for ids in members.values() for job_id in ids]
    seen["jobs of the group"] = sorted(j for j in everyone if j in jobs)
    seen["states shown"] = sorted(cells(jobs, j)["shown_state"] for j in members[limited])
    seen["group offered in the filter"] = f"?group={limited.replace(':', '%3A')}" in jobs
    detail = client.get(f"/admin/celery_leases/job/{members[limited][2]}/change/")
    admitted = client.get(f"/admin/celery_leases/job/{members[limited][0]}/change/")
    seen["waiting job's page"] = [
        html.escape(limited) in detail.content.decode(),
        "waiting for its admission" in detail.content.decode(),
    ]
    seen["admitted job's page"] = f"{html.escape(limited)}</a>, admitted " in (
        admitted.content.decode()
    )
    return seen


def _admin_keys(client: Any, store: Any, tag: str) -> dict[str, Any]:
    """The lease keys' admin: a key's cursor set, refused, cleared from its page; a keyed
    job's page shows its key, arguments and waiting follow-up."""
    from billing.tasks import invoice_orders

    from celery_leases.message import KEY_HEADER
    from tests.support.message import job_message

    seen: dict[str, Any] = {}
    free, held = f"free-{tag}", f"held-{tag}"
    for key in (free, held):
        store.set_cursor(key, '{"page": 1}')
    keyed = f"keyed-{tag}"
    store.register(job_message(keyed, invoice_orders.name, args=[keyed, 3], **{KEY_HEADER: held}))
    store.register(
        job_message(f"trigger-{tag}", invoice_orders.name, args=[keyed, 4], **{KEY_HEADER: held})
    )
    page = "/admin/celery_leases/leasekey/"
    seen["keys listed"] = [
        key for key in (free, held) if key in client.get(f"{page}?q={key}").content.decode()
    ]

    def save(key: str, cursor: str) -> tuple[int, list[str], Any]:
        response = client.post(f"{page}{key}/change/", {"cursor": cursor}, follow=True)
        said = [str(m) for m in response.context["messages"]] if response.context else []
        if response.context and "adminform" in response.context:
            said += [str(e) for e in response.context["adminform"].form.errors.get("cursor", [])]
        return response.status_code, said, store.cursor(key)

    seen["set"] = save(free, '{"page": 7}')
    seen["not json"] = save(free, "{page: 8}")
    seen["held"] = save(held, '{"page": 9}')
    seen["cleared"] = save(free, "")
    detail = client.get(f"/admin/celery_leases/job/{keyed}/change/").content.decode()
    seen["keyed job's page"] = [
        held in detail,
        "&quot;args&quot;" in detail and keyed in detail,
        f"trigger-{tag}" in detail,
    ]
    return seen


@scenario
def idle_in_atomic() -> dict[str, Any]:
    """PostgreSQL and MariaDB: a block that sits idle past the lease after its checkpoint is
    ended by the database (the checkpoint's idle-in-transaction bound), and the attempt sees
    it as such."""
    import time

    from billing.models import Invoice
    from billing.tasks import invoice_orders
    from django.db import connections, transaction

    from celery_leases.db.errors import ended_idle_transaction
    from celery_leases.lease import Lease, current
    from tests.support.message import job_message

    job_id = f"idle-{uuid.uuid4().hex}"
    store = invoice_orders.lease_store
    sent = job_message(job_id, invoice_orders.name, args=[job_id, 2])
    store.register(sent)
    claimed = store.claim(sent, owner="w1/1", duration=30.0)
    lease = Lease(job_id, claimed.token, claimed.attempt, None, "w1/1", 1.0, 0.3)
    seen: dict[str, Any] = {}
    current.stack.append(lease)
    try:
        with transaction.atomic():
            Invoice.objects.create(batch=job_id, number=0, attempt=1, token=lease.token)
            invoice_orders.checkpoint({"next": 1})
            time.sleep(2.0)  # idle inside the transaction, past the 1 s lease
    except Exception as exc:
        seen["error"] = type(exc).__name__
        seen["ended idle"] = ended_idle_transaction(exc)
    finally:
        current.stack.remove(lease)
        connections["default"].close()
    seen["idle bounded"] = lease.idle_bounded
    seen["invoices"] = Invoice.objects.filter(batch=job_id).count()
    seen["checkpoint"] = store.get(job_id).checkpoint
    return seen


def _keyed_invoices() -> Any:
    """A keyed task (one job per batch at a time): each of ``numbers`` is an invoice and the
    key's cursor after it (and, with ``checkpoint``, the job's checkpoint before the cursor) in
    one ``atomic()`` block; the block of ``fail_at`` raises after its writes."""
    from billing.models import Invoice
    from django.db import transaction
    from shop import celery_app

    from celery_leases.contrib.django import DjangoLeasedTask

    if "scenario.keyed_invoices" in celery_app.tasks:
        return celery_app.tasks["scenario.keyed_invoices"]

    @celery_app.task(
        base=DjangoLeasedTask, bind=True, name="scenario.keyed_invoices", lease_key="invoices:{0}"
    )
    def keyed_invoices(
        self: Any,
        batch: str,
        numbers: list[int],
        checkpoint: bool = False,
        fail_at: int | None = None,
    ) -> int:
        for number in numbers:
            with transaction.atomic():
                Invoice.objects.create(
                    batch=batch, number=number, attempt=self.lease.attempt, token=self.lease.token
                )
                if checkpoint:
                    self.checkpoint({"next": number + 1})
                self.save_cursor({"after": number})
                if number == fail_at:
                    raise RuntimeError(f"the block of invoice {number} fails after its writes")
        return len(numbers)

    return keyed_invoices


def _numbers(batch: str) -> list[int]:
    from billing.models import Invoice

    return list(Invoice.objects.filter(batch=batch).order_by("id").values_list("number", flat=True))


@scenario
def cursor_in_failed_block() -> dict[str, Any]:
    """A keyed job saves its cursor in an ``atomic()`` block that then fails: one run whose
    block commits, then one whose block raises after its invoice and its cursor."""
    task = _keyed_invoices()
    store = task.lease_store
    batch = f"cursor-{uuid.uuid4().hex[:8]}"
    first = task.apply(args=[batch, [0]])
    seen: dict[str, Any] = {
        "first run": first.state,
        "cursor after the first run": store.cursor(f"invoices:{batch}"),
    }
    failed = task.apply(args=[batch, [1]], kwargs={"fail_at": 1})
    job = store.get(failed.id)
    seen["failed run"] = [failed.state, repr(failed.result)]
    seen["failed job"] = None if job is None else job.state
    seen["cursor after the failed run"] = store.cursor(f"invoices:{batch}")
    seen["invoices"] = _numbers(batch)
    return seen


@scenario
def checkpoint_and_cursor_in_one_block() -> dict[str, Any]:
    """A keyed job saves its checkpoint, then its key's cursor, in each ``atomic()`` block."""
    task = _keyed_invoices()
    store = task.lease_store
    batch = f"both-{uuid.uuid4().hex[:8]}"
    done = task.apply(args=[batch, [0, 1]], kwargs={"checkpoint": True})
    job = store.get(done.id)
    return {
        "run": [done.state, repr(done.result)],
        "job": None if job is None else [job.state, job.checkpoint, job.attempts],
        "cursor": store.cursor(f"invoices:{batch}"),
        "invoices": _numbers(batch),
    }


@scenario
def in_test_case(through: str) -> dict[str, Any]:
    """invoice_orders run inside a test of Django's ``TestCase`` (each test in a transaction
    it rolls back), by ``task.apply()`` (``through="apply"``) or by a POST to the invoicing
    view (``through="view"``: eager tasks, ``ATOMIC_REQUESTS``), through Django's test
    machinery: what the test saw inside its transaction, and what is left after it."""
    import unittest

    from billing.tasks import invoice_orders
    from django.test import TestCase

    from celery_leases.contrib.django.models import Job

    batch = f"testcase-{uuid.uuid4().hex[:8]}"
    seen: dict[str, Any] = {}

    class Invoicing(TestCase):
        def test_invoicing(self) -> None:
            if through == "apply":
                result = invoice_orders.apply(args=[batch, 3])
                seen["outcome"] = [result.state, repr(result.result)]
                job_id = result.id
            else:
                response = self.client.post(f"/billing/{batch}/invoice/", {"count": 3})
                seen["outcome"] = [response.status_code, response.content.decode()]
                job_id = response.json()["job"]
            seen["job id"] = job_id
            seen["invoices inside"] = _numbers(batch)
            job = Job.objects.filter(id=job_id).values_list("state", "attempts", "result")
            seen["job inside"] = list(job.first() or ())

    outcome = unittest.TestResult()
    unittest.TestSuite([Invoicing("test_invoicing")]).run(outcome)
    seen["test errors"] = [text for _, text in outcome.errors + outcome.failures]
    seen["invoices after"] = _numbers(batch)
    job_id = seen.get("job id")
    after = None if job_id is None else invoice_orders.lease_store.get(job_id)
    seen["job after"] = None if after is None else after.state
    return seen


@scenario
def eager_in_atomic_request() -> dict[str, Any]:
    """A POST to the invoicing view with ``ATOMIC_REQUESTS`` and eager tasks: the task runs in
    the request's transaction, which commits with the response."""
    from billing.tasks import invoice_orders
    from django.test import Client

    batch = f"request-{uuid.uuid4().hex[:8]}"
    seen: dict[str, Any] = {}
    try:
        response = Client().post(f"/billing/{batch}/invoice/", {"count": 3})
    except Exception as exc:  # the request failed: say how
        seen["error"] = f"{type(exc).__name__}: {exc}"
        return seen
    seen["status"] = response.status_code
    job = invoice_orders.lease_store.get(response.json()["job"])
    seen["job"] = None if job is None else [job.state, job.attempts, job.result]
    seen["invoices"] = _numbers(batch)
    return seen


@scenario
def reaper_under_database_scheduler() -> dict[str, Any]:
    """django-celery-beat's DatabaseScheduler, as ``celery beat -S ...DatabaseScheduler``
    runs it: the reaper's entry it loaded (``schedule_reaper``'s, stored in its table), and
    the message of the pass it sends when that entry is due."""
    from datetime import datetime, timezone

    from celery.signals import before_task_publish
    from django_celery_beat.models import PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler
    from shop import celery_app

    from celery_leases.reaper import REAP_TASK

    published: list[dict[str, Any]] = []

    def record(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == REAP_TASK:
            published.append({"expires": headers.get("expires"), "at": datetime.now(timezone.utc)})

    before_task_publish.connect(record, weak=False)
    scheduler = DatabaseScheduler(app=celery_app)
    entry = scheduler.schedule[REAP_TASK]
    scheduler.apply_entry(entry, producer=scheduler.producer)
    stored = PeriodicTask.objects.get(name=REAP_TASK)
    seen: dict[str, Any] = {
        "entry": [entry.task, sorted(entry.options)],
        "stored every": [stored.interval.every, stored.interval.period],
        "published": len(published),
    }
    if published and published[0]["expires"] is not None:
        expires = datetime.fromisoformat(published[0]["expires"])
        seen["expires in"] = (expires - published[0]["at"]).total_seconds()
    else:
        seen["expires in"] = None
    return seen


@scenario
def checkpoint_in_atomic_of_a_routed_job() -> dict[str, Any]:
    """A task whose jobs live in the routed leases database (its queue's route) checkpoints
    inside ``atomic()`` on the project's database: refused, naming the job's database."""
    from django.db import transaction
    from shop import celery_app

    from celery_leases import LeasedTask

    @celery_app.task(base=LeasedTask, bind=True, queue="routed", shared=False)
    def routed_atomic(self: Any) -> str | None:
        with transaction.atomic():
            try:
                self.checkpoint({"n": 1})
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
        return None

    return {"home": routed_atomic.lease_home(), "error": routed_atomic.apply().get()}


def main() -> None:
    name, args = sys.argv[1], json.loads(sys.argv[2])
    django.setup()
    result = SCENARIOS[name](**args)
    print(json.dumps(result, default=str))


@scenario
def adelay_on_commit_in_async_code() -> dict[str, Any]:
    """A coroutine (an ASGI view) calls invoice_orders: ``delay_on_commit()`` there raises
    Django's SynchronousOnlyOperation; ``await adelay_on_commit()`` sends it (no transaction
    is open in async code); ``await adelay()`` returns the job's id."""
    import asyncio

    from billing.tasks import invoice_orders

    seen: dict[str, Any] = {}

    async def view() -> None:
        try:
            invoice_orders.delay_on_commit(f"sync-{uuid.uuid4().hex[:8]}", 1)
            seen["delay_on_commit"] = "sent"
        except Exception as exc:
            seen["delay_on_commit"] = type(exc).__name__
        batch = f"async-{uuid.uuid4().hex[:8]}"
        seen["adelay_on_commit"] = await invoice_orders.adelay_on_commit(batch, 1)
        seen["adelay_on_commit batch"] = batch
        result = await invoice_orders.adelay(f"async-{uuid.uuid4().hex[:8]}", 1)
        seen["adelay job"] = result.id

    asyncio.run(view())
    store = invoice_orders.lease_store
    job = store.get(seen["adelay job"])
    seen["adelay state"] = None if job is None else job.state
    batches = [j.message.args[0] for j in store.list_jobs(task="billing.invoice_orders")]
    seen["adelay_on_commit recorded"] = seen["adelay_on_commit batch"] in batches
    return seen


@scenario
def admin_across_databases() -> dict[str, Any]:
    """The admin of a project with a second leases database (``CELERY_LEASES_DATABASES``):
    each list shows one database, chosen with its filter, and says where each row lives; a
    job's page finds the job wherever it lives; the actions and a group's facts use the
    store of the job's database."""
    import html

    from billing.tasks import invoice_orders
    from django.contrib.auth.models import User
    from django.test import Client
    from django.test.utils import setup_test_environment

    from celery_leases.contrib.django import routed
    from celery_leases.message import GROUP_HEADER
    from tests.support.message import job_message

    tag = uuid.uuid4().hex[:8]
    stores = {name: routed.store_of(name) for name in ("default", "routed")}
    ids = {"default": f"home-{tag}", "routed": f"away-{tag}"}
    group = f"tenant-{tag}"
    for name, job_id in ids.items():
        sent = job_message(job_id, invoice_orders.name, args=[job_id, 10])
        stores[name].register(sent)
        claimed = stores[name].claim(sent, owner=f"w@host/{tag}", duration=300.0)
        stores[name].checkpoint(job_id, claimed.token, f'{{"at": "{name}"}}', progress=(4, 10))
    grouped = f"grouped-{tag}"
    stores["routed"].register(
        job_message(grouped, invoice_orders.name, args=[grouped, 1], **{GROUP_HEADER: group})
    )
    stores["routed"].admit(group, limits=(1, None), define=True)
    setup_test_environment()
    user = User.objects.create_superuser(f"admin-{tag}", f"{tag}@example.com", "pw")
    client = Client()
    client.force_login(user)
    page = "/admin/celery_leases/job/"

    def text(url: str) -> str:
        response = client.get(url)
        assert response.status_code == 200, (url, response.status_code)
        return response.content.decode()

    def rows(body: str) -> dict[str, str]:
        """Each listed job of this scenario, and its database column."""
        found = {}
        for row in re.findall(r"<tr.*?</tr>", body, re.S):
            cell = re.search(r'class="field-leases_database[^"]*"[^>]*>(.*?)</t[dh]>', row, re.S)
            for job_id in (*ids.values(), grouped):
                if job_id in row:
                    found[job_id] = "" if cell is None else cell[1].strip()
        return found

    listed = text(page)
    seen: dict[str, Any] = {
        "tag": tag,
        "default list": rows(listed),
        "routed list": rows(text(f"{page}?database=routed")),
        "filter offers": _filter_links(listed, "database"),
        "unknown database": client.get(f"{page}?database=nowhere").status_code,
    }
    away = text(f"{page}{ids['routed']}/change/")
    seen["routed job's page"] = ['"at": "routed"' in html.unescape(away), ">routed<" in away]
    cancelled = client.post(
        f"{page}?database=routed",
        {"action": "cancel", "_selected_action": [ids["routed"]], "index": 0},
        follow=True,
    )
    seen["cancel messages"] = [str(m) for m in cancelled.context["messages"]]
    seen["after"] = {name: stores[name].get(job_id).stop_requested for name, job_id in ids.items()}
    groups = text("/admin/celery_leases/jobgroup/?database=routed")
    link = re.search(r'href="([^"]*\?[^"]*group=[^"]*)"', groups)
    seen["group's jobs link"] = None if link is None else html.unescape(link[1])
    seen["group's jobs"] = rows(text(seen["group's jobs link"] or page))
    seen["groups of default"] = group in text("/admin/celery_leases/jobgroup/")
    # A key of the same name in both databases: the one opened from the routed list is set
    # there, and the page after the save shows it, not the default database's
    key = f"cursor-{tag}"
    stores["default"].set_cursor(key, '"home"')
    stores["routed"].set_cursor(key, '"away"')
    keys = text("/admin/celery_leases/leasekey/?database=routed")
    opened = html.unescape(re.search(rf'href="([^"]*{key}[^"]*)"', keys)[1])
    saved = client.post(opened, {"cursor": '"edited"'})
    after = html.unescape(text(saved["Location"]))
    seen["cursors after the save"] = [stores[n].cursor(key) for n in ("default", "routed")]
    seen["page after the save"] = sorted(set(re.findall(r'"(home|away|edited)"', after)))
    # The key's page by a link that names no database (a bookmark, "Recent actions"): it
    # shows the default database's key and links to the routed one's, which shows that one
    bookmark = client.get(opened.split("?")[0])
    seen["bookmark"] = _shown_and_said(bookmark)
    seen["bookmark's link, as the page has it"] = re.findall(
        r'<a href="[^"<>]*">routed</a>', bookmark.content.decode()
    )
    said = " ".join(seen["bookmark"][1])
    there = re.findall(r'<a href="([^"]*)">routed</a>', html.unescape(said))
    seen["its link"] = there
    seen["the linked page"] = _shown_and_said(client.get(there[0]))[0] if there else None
    # The same key opened from the default list (whose query names no database): no warning
    default_keys = text("/admin/celery_leases/leasekey/")
    from_list = html.unescape(re.search(rf'href="([^"]*{key}[^"]*)"', default_keys)[1])
    seen["the default list's row link"] = from_list
    seen["opened from the default list"] = _shown_and_said(client.get(from_list))
    seen["a job in one database, by a bare link"] = _shown_and_said(
        client.get(f"{page}{ids['routed']}/change/")
    )[1]
    # The routed database down (its file gone: the empty one SQLite opens instead has no
    # tables): the default job's page still opens, and a page of an id neither database
    # holds says the routed one could not be searched
    seen.update(_with_routed_down(client, page, ids["default"], f"nowhere-{tag}"))
    return seen


def _shown_and_said(response: Any) -> tuple[list[str], list[str]]:
    """The cursors a key's page shows ("home", "away", "edited"), and its messages."""
    import html

    assert response.status_code == 200, response.status_code
    body = html.unescape(response.content.decode())
    said = [str(m) for m in response.context["messages"]]
    return sorted(set(re.findall(r'"(home|away|edited)"', body))), said


def _with_routed_down(client: Any, page: str, there: str, nowhere: str) -> dict[str, Any]:
    from django.db import connections

    connections["routed"].close()
    path = Path(connections["routed"].settings_dict["NAME"])
    away = path.with_name(f"{path.name}.away")
    path.rename(away)
    try:
        missing = client.get(f"{page}{nowhere}/change/", follow=True)
        # A staff user who may see no job is refused the page, and told nothing of the
        # databases it looked in: not then, nor on the next page
        from django.contrib.auth.models import User
        from django.test import Client

        tag = uuid.uuid4().hex[:8]
        stranger = Client()
        stranger.force_login(
            User.objects.create_user(f"s-{tag}", f"s{tag}@example.com", "pw", is_staff=True)
        )
        refused = stranger.get(f"{page}{nowhere}/change/")
        next_page = stranger.get("/admin/")
        return {
            "a job's page, routed down": client.get(f"{page}{there}/change/").status_code,
            "a missing job's page, routed down": missing.status_code,
            "its messages": [str(m) for m in missing.context["messages"]],
            "refused, then the next page's messages": [
                refused.status_code,
                next_page.status_code,
                [str(m) for m in next_page.context["messages"]],
            ],
        }
    finally:
        connections["routed"].close()
        away.replace(path)


def _filter_links(page: str, title: str) -> list[str]:
    """The links of the admin list's filter ``title``, each with its text and whether it is
    the selected one."""
    import html

    section = re.search(rf"By {title}.*?<ul>(.*?)</ul>", page, re.S)
    if section is None:
        return []
    links = re.findall(r'<li( class="selected")?>\s*<a href="([^"]*)"[^>]*>(.*?)</a>', section[1])
    return [f"{'*' if chosen else ''}{html.unescape(text)}: {href}" for chosen, href, text in links]


@scenario
def admin_of_a_database_not_in_databases() -> dict[str, Any]:
    """A routed leases database that ``DATABASES`` does not name: offered by the admin's
    filter, whose list says how to read it."""
    import html

    from django.contrib.auth.models import User
    from django.test import Client

    tag = uuid.uuid4().hex[:8]
    client = Client()
    client.force_login(User.objects.create_superuser(f"a-{tag}", f"{tag}@example.com", "pw"))
    listed = client.get("/admin/celery_leases/job/?database=routed")
    body = listed.content.decode()
    return {
        "status": listed.status_code,
        "offered": "routed (not in DATABASES)" in body,
        "says": [html.unescape(m) for m in re.findall(r"leases: leases database[^<]*", body)],
    }


if __name__ == "__main__":
    main()
