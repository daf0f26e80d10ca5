"""The demo: signed webhooks for one account coalesce into one sync and one follow-up, and the
sync survives kill -9 of the worker holding its lease.

    python -m examples.webhook_sync.demo [--broker URL] [--database URL] [--events N]

Starts the upstream events API, the webhook receiver, two workers and beat (the reaper) as
subprocesses. Delivers a signed webhook, which starts a sync of a few thousand events; at 20 %
new events arrive upstream with a burst of webhooks, which the receiver answers with the one
follow-up run they share; at 40 % SIGKILLs the worker holding the sync's lease and shows the
other worker resume from the checkpoint; then the follow-up runs from the cursor the sync left
and fetches the new events only; last, a provider's retry of a delivery (answered 200, starts
nothing) and a delivery signed with another secret (401). It ends with a verdict computed from
the data. Exit status: 0 when the verdict holds, 1 when it does not, 2 when the demo could not
run, 130 on Ctrl-C. Everything it starts is stopped on the way out, and everything it writes
goes under the data folder (``.demo``, wiped at start).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

from .console import WIDTH, Console
from .processes import Child, ChildFailed, Children
from .provider import deliver, new_delivery_id
from .verdict import Delivered, Seen, judge, short

ACCOUNT = "acct_demo"
#: Share of the sync's events stored when new events and the burst of webhooks arrive, and
#: when the worker holding the lease is killed.
BURST_AT, KILL_AT = 0.2, 0.4
#: Webhooks in the burst, after the one that starts the sync.
BURST = 5
ROOT = Path(__file__).resolve().parents[3]
SECRET_VARIABLE = "WEBHOOK_SYNC_SECRET"


class DemoError(Exception):
    """The demo could not run (a service down, a process that did not start)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.webhook_sync.demo",
        description="Webhooks coalesce into one sync and one follow-up; kill -9 the sync's "
        "worker and watch another one resume it.",
    )
    parser.add_argument("--broker", help="broker URL (default: atomicfs://, files, no server)")
    parser.add_argument("--database", help="SQLAlchemy URL (default: SQLite in the data folder)")
    parser.add_argument("--data", default=".demo", help="data folder, wiped at start (.demo)")
    parser.add_argument("--events", type=int, default=3000, help="events to sync (3000)")
    parser.add_argument(
        "--new-events", type=int, default=300, help="events arriving during the sync (300)"
    )
    parser.add_argument("--page-size", type=int, default=100, help="events per page (100)")
    parser.add_argument(
        "--page-latency", type=float, default=0.1, help="seconds per upstream page (0.1)"
    )
    parser.add_argument(
        "--error-rate", type=float, default=0.1, help="share of 429/500 answers (0.1)"
    )
    parser.add_argument("--seed", default="webhook", help="seed of the upstream events")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before giving up (120)"
    )
    parser.add_argument("--quiet", action="store_true", help="print the verdict only")
    args = parser.parse_args(argv)
    if args.page_size < 1 or args.events < 5 * args.page_size:
        parser.error("--events must be at least 5 pages (--page-size), so there is a 40 % mark")
    if args.new_events < 1:
        parser.error("--new-events must be at least 1, so the follow-up has work")
    return args


def prepare_data_folder(path: Path) -> None:
    """Wipe the data folder and make it again; refuse a folder that is not the example's."""
    from ..app import DATA_MARKER, make_data_folder

    if path.exists():
        if any(path.iterdir()) and not (path / DATA_MARKER).exists():
            raise DemoError(f"{path} is not empty and is not this example's: pass --data")
        shutil.rmtree(path)
    make_data_folder()


def child_environment(args: argparse.Namespace, data: Path) -> dict[str, str]:
    """The WEBHOOK_SYNC_* settings of this run (set in this process too), and the environment
    of the children. The webhook secret is a new one unless ``WEBHOOK_SYNC_SECRET`` is set."""
    settings = {
        "WEBHOOK_SYNC_DATA": str(data),
        "WEBHOOK_SYNC_PAGE_SIZE": str(args.page_size),
        SECRET_VARIABLE: os.environ.get(SECRET_VARIABLE) or secrets.token_hex(16),
    }
    if args.broker:
        settings["WEBHOOK_SYNC_BROKER"] = args.broker
    if args.database:
        settings["WEBHOOK_SYNC_DATABASE"] = args.database
    os.environ.update(settings)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def worker_name(owner: str | None) -> str:
    """``w1`` from a lease owner ``w1@host/1234``."""
    return (owner or "").partition("@")[0]


def http(method: str, url: str) -> tuple[int, Any]:
    request = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.status, json.load(answer)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(quiet=args.quiet)
    data = Path(args.data).resolve()
    environment = child_environment(args, data)
    try:
        prepare_data_folder(data)
    except DemoError as exc:
        console.always(f"error: {exc}")
        return 2
    children = Children(data / "logs", environment)

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    # Even when started with SIGINT ignored (a background job of a script): Ctrl-C stops it all.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return Demo(args, data, console, children).run()
    except KeyboardInterrupt:
        console.always("\ninterrupted: stopping everything the demo started")
        return 130
    except (DemoError, ChildFailed) as exc:
        console.always(f"error: {exc}")
        return 2
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children.stop_all()


class Demo:
    def __init__(
        self, args: argparse.Namespace, data: Path, console: Console, children: Children
    ) -> None:
        self.args = args
        self.data = data
        self.console = console
        self.children = children
        self.workers: dict[str, Child] = {}
        self.seen = Seen()
        self.secret = os.environ[SECRET_VARIABLE]
        self.upstream_url = self.receiver_url = ""
        self.deadline = 0.0

        # Imported only now: the app reads the WEBHOOK_SYNC_* variables set in main().
        from .. import app as example

        self.example = example

    # -- set-up ----------------------------------------------------------------------------

    def run(self) -> int:
        console = self.console
        console.say(
            f"webhook-sync demo: {BURST + 1} webhooks, one sync and one follow-up; kill -9 "
            "during the sync"
        )
        console.detail(self.describe_broker(), "broker    ")
        console.detail(self.describe_database(), "database  ")
        console.detail(f"{shown_path(self.data / 'logs')}/", "logs      ")
        self.reset_database()
        self.purge_queue()
        self.start_processes()
        self.deadline = time.monotonic() + self.args.timeout
        self.sync()
        self.followup()
        self.deliver_again()
        return self.verdict()

    def describe_broker(self) -> str:
        from kombu.utils.url import maybe_sanitize_url

        url = self.example.BROKER
        shown = maybe_sanitize_url(url) if "@" in url else url
        if url.startswith(("atomicfs:", "filesystem:")):
            return f"{shown} (message files in {shown_path(self.data / 'broker')}, no server)"
        return shown

    def describe_database(self) -> str:
        import sqlalchemy as sa

        example = self.example
        url = sa.engine.make_url(example.DATABASE)
        if url.get_backend_name() == "sqlite" and url.database:
            url = url.set(database=shown_path(Path(url.database)))
        shown = url.render_as_string(hide_password=True)
        tables = [example.LEASES_TABLE, example.EVENTS.name, example.DELIVERIES.name]
        return f"{shown} (tables {', '.join(tables)})"

    def reset_database(self) -> None:
        import sqlalchemy as sa

        import celery_leases
        from celery_leases.config import settings_for
        from celery_leases.db import migrations
        from celery_leases.db.store import store_for

        from .. import sink

        example = self.example
        leases = example.LEASES_TABLE
        try:
            engine = sink.engine(example.DATABASE)
            # The leases table of an earlier run goes with its migrations (on PostgreSQL its
            # view too), then the migrations make it anew: what `leases init-db` runs.
            migrations.downgrade(store_for(settings_for(example.app)))
            leases_version = migrations.version_table_name(leases)
            sink.reset(
                engine, example.EVENTS, example.DELIVERIES, leases, f"{leases}_keys", leases_version
            )
            celery_leases.migrate(example.app)
            sink.create(engine, example.EVENTS)
        except (sa.exc.SQLAlchemyError, celery_leases.LeaseError) as exc:
            raise DemoError(f"cannot prepare the database: {exc}".splitlines()[0]) from exc

    def purge_queue(self) -> None:
        app = self.example.app
        try:
            with app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=2, interval_start=0.5)
                purged = app.control.purge(connection=connection)
        except Exception as exc:
            raise DemoError(f"broker unreachable: {exc}") from exc
        if purged:
            self.console.detail(f"purged {purged} message(s) left in queue {self.example.NAME}")

    def start_processes(self) -> None:
        args, console, children = self.args, self.console, self.children
        python = sys.executable
        upstream = children.start(
            "upstream",
            [
                *(python, "-m", "examples.webhook_sync.demo.upstream", "--seed", args.seed),
                *("--events", str(args.events), "--latency", str(args.page_latency)),
                *("--error-rate", str(args.error_rate)),
            ],
        )
        self.upstream_url = upstream.wait_for(r"listening on (http://\S+)", timeout=30)[1]
        children.env["WEBHOOK_SYNC_UPSTREAM"] = self.upstream_url
        receiver = children.start("receiver", [python, "-m", "examples.webhook_sync.receiver"])
        celery = [python, "-m", "celery", "-A", "examples.webhook_sync.app"]
        for name in ("w1", "w2"):
            self.workers[name] = children.start(
                name,
                [
                    *(*celery, "worker", "-n", f"{name}@%h", "-P", "prefork", "-c", "1"),
                    *("-l", "info", "--without-mingle", "--without-gossip", "--without-heartbeat"),
                ],
            )
        beat = children.start(
            "beat", [*celery, "beat", "-l", "info", "-s", str(self.data / "beat-schedule")]
        )
        self.receiver_url = receiver.wait_for(r"listening on (http://\S+)", timeout=30)[1]
        console.say(f"upstream  {self.upstream_url}/events (pid {upstream.pid})")
        console.detail(
            f"{args.events:,} events for {ACCOUNT}, {args.page_size} a page, "
            f"{args.page_latency:g} s a page, {args.error_rate:.0%} answered 429 or 500"
        )
        console.say(f"webhook   {self.receiver_url} (pid {receiver.pid})")
        console.detail(
            f"HMAC-SHA256 signatures ({SECRET_VARIABLE}), 5 min tolerance, deduplicated by "
            "Webhook-Id; one sync per account at a time (lease_key account:{account})"
        )
        for worker in self.workers.values():
            worker.wait_for(r"\S+@\S+ ready\.", timeout=60)
        beat.wait_for(r"beat: Starting\.\.\.", timeout=60)
        pids = ", ".join(f"{name} (pid {w.pid})" for name, w in self.workers.items())
        console.say(f"workers   {pids}: prefork, one pool process each")
        console.say(
            f"beat      pid {beat.pid}: reaper every {self.example.REAP_EVERY_SECONDS:g} s; "
            f"a lease lasts {self.example.LEASE_SECONDS:g} s without renewal"
        )

    # -- the webhooks ----------------------------------------------------------------------

    def db_now(self) -> float:
        """The database clock (epoch seconds), read through the sync's job row."""
        from celery_leases import get_job

        job = get_job(self.example.app, self.seen.sync_id)
        assert job is not None
        return job.created_at + job.age

    def deliver(self, *, delivery_id: str | None = None, secret: str | None = None) -> Delivered:
        delivery_id = delivery_id or new_delivery_id()
        status, answer = deliver(
            self.receiver_url, ACCOUNT, secret=secret or self.secret, delivery_id=delivery_id
        )
        if status >= 500 or (status >= 400 and secret is None):
            raise DemoError(f"the receiver answered {status} {answer} to {delivery_id}")
        return Delivered(delivery_id, status, answer, 0.0)

    def answered(self, delivered: Delivered, what: str) -> None:
        self.console.say(f"webhook   {self.answer_text(delivered)} ({what})")

    @staticmethod
    def answer_text(delivered: Delivered) -> str:
        """The receiver's answer to ``delivered``: status, job (short unless new), error."""
        answer = delivered.answer if isinstance(delivered.answer, dict) else {}
        text = f"{delivered.delivery_id} -> {delivered.status}"
        if delivered.job:
            text += f", job {delivered.job if delivered.status == 202 else short(delivered.job)}"
        if "error" in answer:
            text += f": {answer['error']}"
        return text

    def next_batch(self) -> None:
        """New events arrive upstream, in ``BURST`` batches, one a call (so the watch goes on
        between them); the provider sends a webhook after each."""
        seen, added = self.seen, self.args.new_events
        n = len(seen.burst) - 1
        if n == 0:
            self.console.say(
                f"upstream  +{added:,} events for {ACCOUNT} during the sync, {added // BURST:,} "
                "at a time; a webhook after each:"
            )
        batch = added // BURST + (n < added % BURST)
        http("POST", f"{self.upstream_url}/events/grow?account={ACCOUNT}&n={batch}")
        delivered = self.deliver()
        delivered.at_db = self.db_now()
        seen.burst.append(delivered)
        seen.followup_id = seen.followup_id or delivered.job or ""
        self.answered(delivered, f"+{batch} events")
        if n + 1 < BURST:
            return
        jobs = {d.job for d in seen.burst[1:]}
        if jobs == {seen.followup_id}:
            text = (
                f"all {BURST} answered with one job, {short(seen.followup_id)}: the follow-up run"
            )
        else:
            text = f"the {BURST} were answered with {len(jobs)} jobs: {', '.join(map(short, jobs))}"
        self.console.detail(
            f"{text}, which starts when the sync {short(seen.sync_id)} ends, from the cursor it "
            "leaves"
        )

    def deliver_again(self) -> None:
        """The provider retries a delivery it saw no answer to; a forger signs with a guess."""
        seen = self.seen
        if len(seen.burst) < 2:
            return
        again = seen.burst[2 if len(seen.burst) > 2 else 1].delivery_id
        seen.retried = self.deliver(delivery_id=again)
        self.answered(seen.retried, "a provider's retry: starts nothing")
        seen.forged = self.deliver(secret="not-the-secret")
        self.answered(seen.forged, "signed with another secret")

    # -- the runs --------------------------------------------------------------------------

    def sync(self) -> None:
        seen = self.seen
        first = self.deliver()
        seen.sync_id = first.job or ""
        first.at_db = self.db_now()
        seen.burst.append(first)
        seen.started_sync = self.console.elapsed()
        self.answered(first, "a new sync")
        self.watch(seen.sync_id, "the sync")

    def followup(self) -> None:
        while len(self.seen.burst) <= BURST:  # the sync ended first (a slow machine)
            self.next_batch()
        if not self.seen.followup_id:
            raise DemoError("the burst of webhooks gave no follow-up job")
        self.watch(self.seen.followup_id, "the follow-up")

    def watch(self, job_id: str, role: str) -> None:
        from celery_leases import get_job

        app, console, seen = self.example.app, self.console, self.seen
        seen_attempts = 0
        start = 0
        while True:
            job = get_job(app, job_id)
            if job is not None:
                if job.attempts > seen_attempts and job.owner:
                    seen_attempts = job.attempts
                    if seen.killed_at_wall is None or job_id != seen.sync_id:
                        self.report_claim(job, role)
                    else:
                        self.report_resume(job)
                checkpoint = job.checkpoint or {}
                total = job.progress_total or self.args.events
                done = job.progress_done or 0
                if checkpoint:
                    start = done - (checkpoint.get("events") or 0)
                where = f"page {checkpoint.get('pages', 0)}  "
                if job.state not in ("running", "queued"):
                    where += job.state
                elif (
                    job_id == seen.sync_id
                    and seen.killed_at_wall is not None
                    and job.attempts == seen.attempts_at_kill
                ):
                    if job.state == "running":
                        left = max(job.expires_in or 0.0, 0.0)
                        where += f"{seen.victim} killed, its lease ends in {left:.1f} s"
                    else:
                        where += "re-published by the reaper"
                else:
                    where += f"{worker_name(job.owner) or 'queued'}, attempt {job.attempts}"
                if job.progress_total:
                    console.progress(ACCOUNT, done, total, where, run=job_id, start=start)
                if job_id == seen.sync_id and job.state in ("running", "queued"):
                    if len(seen.burst) <= BURST and done >= BURST_AT * total:
                        self.next_batch()
                    if (
                        seen.killed_at_wall is None
                        and job.state == "running"
                        and done >= KILL_AT * total
                    ):
                        self.kill_lease_holder(job)
                if job.state in ("done", "failed", "cancelled"):
                    seen.final[job_id] = job
                    self.report_end(job, role)
                    return
            if time.monotonic() > self.deadline:
                raise DemoError(
                    f"{role} did not finish within {self.args.timeout:g} s; "
                    f"see the logs in {self.data / 'logs'}"
                )
            time.sleep(0.05)

    def report_claim(self, job: Any, role: str) -> None:
        name, seen = worker_name(job.owner), self.seen
        text = f"{name} claimed {role} {short(job.id)}: attempt {job.attempts}, token {job.token}"
        sync = seen.final.get(seen.sync_id)
        if job.id == seen.followup_id and sync is not None and sync.finished_at:
            text += f", {(job.claimed_at or 0.0) - sync.finished_at:.2f} s after the sync ended"
        self.console.say(text)
        worker = self.workers.get(name)
        if worker is not None:
            line = self.find_log_line(worker, rf"{job.id}\]: sync {ACCOUNT}: attempt \d+ starts")
            if line:
                self.console.detail(line, f"{name} log: ")

    def report_end(self, job: Any, role: str) -> None:
        result = job.result if isinstance(job.result, dict) else {}
        attempts = f"{job.attempts} attempt{'s' if job.attempts != 1 else ''}"
        text = f"{role} {short(job.id)} {job.state} after {attempts}"
        if result:
            text += (
                f": {result.get('events', 0):,} events in {result.get('pages', 0)} page(s), "
                f"the account's cursor now {result.get('ended_after')}"
            )
        self.console.say(text)
        if job.id == self.seen.sync_id:
            # The worker that ended the sync settles the triggers that waited on its key.
            pattern = rf"lease key {re.escape(job.lease_key or '')}: the triggers that waited on it"
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                for name, worker in self.workers.items():
                    line = self.find_log_line(worker, pattern, 0.0)
                    if line:
                        self.console.detail(line, f"{name} log: ")
                        return
                time.sleep(0.05)

    def kill_lease_holder(self, job: Any) -> None:
        from celery_leases import get_job

        console, seen = self.console, self.seen
        name = worker_name(job.owner)
        worker = self.workers[name]
        worker.kill_group()
        seen.killed_at_wall = time.time()
        worker.process.wait(10)
        after = get_job(self.example.app, seen.sync_id)
        assert after is not None
        seen.victim = name
        seen.killed_at_db = after.created_at + after.age  # the DB clock, read just now
        seen.checkpoint_at_kill = after.checkpoint or {}
        seen.attempts_at_kill = after.attempts
        console.say(
            f"SIGKILL {name}: pid {worker.pid} and its pool process, holding the sync's lease at "
            f"{after.progress_done or 0:,}/{after.progress_total or 0:,} events"
        )
        left = max(after.expires_in or 0.0, 0.0)
        console.detail(
            f"last checkpoint: page {seen.checkpoint_at_kill.get('pages')}; the lease would "
            f"expire in {left:.1f} s, but the holder's process is gone: the next reaper pass "
            "publishes the job again"
        )

    def report_resume(self, job: Any) -> None:
        console, seen = self.console, self.seen
        name = worker_name(job.owner)
        seen.resumed_by = name
        seen.resumed_at_db = job.claimed_at
        delay = (job.claimed_at or 0.0) - (seen.killed_at_db or 0.0)
        console.say(
            f"{name} resumed the sync {short(job.id)}: attempt {job.attempts}, after page "
            f"{seen.checkpoint_at_kill.get('pages')}, {delay:.2f} s after the kill"
        )
        survivor = self.workers.get(name)
        if survivor is None:
            return
        for pattern in (rf"{job.id}.*re-published", r"resumes after page"):
            line = self.find_log_line(survivor, pattern)
            if line:
                console.detail(line, f"{name} log: ")

    @staticmethod
    def find_log_line(child: Child, pattern: str, timeout: float = 2.0) -> str | None:
        """The message of the last log line matching ``pattern`` (waiting up to ``timeout`` s)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            lines = [line for line in child.log_text().splitlines() if regex.search(line)]
            if lines:
                # Without Celery's prefix ("[time: LEVEL/process] "), and a task logger's
                # "task.name[job id]: " after it.
                message = re.sub(r"^\[[^\]]*\] ", "", lines[-1])
                return re.sub(r"^\S+\[[0-9a-f-]+\]: ", "", message)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    # -- the verdict -----------------------------------------------------------------------

    def verdict(self) -> int:
        args, console, seen = self.args, self.console, self.seen
        _, stats = http("GET", f"{self.upstream_url}/stats")
        checks = judge(
            self.example,
            seen,
            stats,
            account=ACCOUNT,
            seed=args.seed,
            events=args.events,
            added=args.new_events,
        )
        errors = {k: v for k, v in stats["statuses"].items() if k != "200"}
        error_text = ", ".join(f"{k} x{v}" for k, v in errors.items()) or "none"
        if not args.quiet:
            console.always()
        console.always("Verdict")
        for ok, text in checks:
            lead = "  ok    " if ok else "  FAIL  "
            console.always(
                textwrap.fill(text, WIDTH - 1, initial_indent=lead, subsequent_indent=" " * 8)
            )
        total = console.elapsed()
        console.always(
            f"  info  total {total:.1f} s (webhooks and runs {total - seen.started_sync:.1f} s); "
            f"upstream errors retried: {error_text}"
        )
        failed = sum(1 for ok, _ in checks if not ok)
        if failed:
            logs = shown_path(self.data / "logs")
            console.always(f"FAIL: {failed} of {len(checks)} checks failed; logs in {logs}")
            return 1
        console.always(
            f"PASS: {len(seen.burst)} webhooks, one sync and one follow-up; the sync survived "
            "kill -9 of its worker"
        )
        return 0
