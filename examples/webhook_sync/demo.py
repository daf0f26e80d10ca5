"""The demo: kill -9 the worker holding a sync's lease, and watch the other worker resume it.

    python -m examples.webhook_sync.demo [--broker URL] [--database URL] [--events N]

Starts the upstream events API, the webhook receiver, two workers and beat (the reaper) as
subprocesses; POSTs the webhook, which enqueues a sync of a few thousand events; SIGKILLs the
worker holding the sync's lease at 40 %; shows the other worker resume from the checkpoint; and
ends with a verdict computed from the data. Exit status: 0 when the verdict holds, 1 when it
does not, 2 when the demo could not run, 130 on Ctrl-C. Everything it starts is stopped on the
way out, and everything it writes goes under the data folder (``.demo``, wiped at start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import textwrap
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .processes import Child, ChildFailed, Children

ACCOUNT = "acct_demo"
#: Share of the events stored when the worker holding the lease is killed.
KILL_AT = 0.4
WIDTH = 100
ROOT = Path(__file__).resolve().parents[2]


class DemoError(Exception):
    """The demo could not run (a service down, a process that did not start)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.webhook_sync.demo",
        description="Kill -9 the worker holding a sync's lease and watch another one resume it.",
    )
    parser.add_argument("--broker", help="broker URL (default: atomicfs://, files, no server)")
    parser.add_argument("--database", help="SQLAlchemy URL (default: SQLite in the data folder)")
    parser.add_argument("--data", default=".demo", help="data folder, wiped at start (.demo)")
    parser.add_argument("--events", type=int, default=3000, help="events to sync (3000)")
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
    return args


class Console:
    """Lines stamped with the seconds since the start; one progress line per sync, redrawn in
    place on a terminal, printed at every tenth elsewhere (CI logs)."""

    def __init__(self, *, quiet: bool, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self._drawn = False
        self._tenth = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _write(self, text: str) -> None:
        if self._drawn:
            self.stream.write("\r" + " " * (WIDTH - 1) + "\r")
            self._drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def say(self, text: str) -> None:
        if not self.quiet:
            self._write(f"[{self.elapsed():5.1f}s] {text}")

    def detail(self, text: str, label: str = "") -> None:
        if not self.quiet:
            lead = " " * 9 + label
            self._write(
                textwrap.fill(
                    text, WIDTH - 1, initial_indent=lead, subsequent_indent=" " * len(lead)
                )
            )

    def always(self, text: str = "") -> None:
        self._write(text)

    def progress(self, done: int, total: int, where: str) -> None:
        if self.quiet or total <= 0:
            return
        share = min(done / total, 1.0)
        counts = f"{share:4.0%}  {done:,}/{total:,} events  {where}"
        if self.tty:
            bar = "#" * round(share * 24)
            line = f"[{self.elapsed():5.1f}s] {ACCOUNT} [{bar:<24}] {counts}"
            self.stream.write("\r" + line[: WIDTH - 1].ljust(WIDTH - 1))
            self.stream.flush()
            self._drawn = True
        elif int(share * 10) > self._tenth:
            self._tenth = int(share * 10)
            self._write(f"[{self.elapsed():5.1f}s] {ACCOUNT} {counts}")


@dataclass
class Run:
    """What the demo saw happen, for the verdict."""

    job_id: str = ""
    started_sync: float = 0.0
    victim: str = ""
    killed_at_wall: float | None = None
    killed_at_db: float | None = None
    checkpoint_at_kill: dict[str, Any] = field(default_factory=dict)
    attempts_at_kill: int = 0
    resumed_by: str = ""
    resumed_at_db: float | None = None
    final: Any = None


def prepare_data_folder(path: Path) -> None:
    """Wipe the data folder and make it again; refuse a folder that is not the example's."""
    from .app import DATA_MARKER, make_data_folder

    if path.exists():
        if any(path.iterdir()) and not (path / DATA_MARKER).exists():
            raise DemoError(f"{path} is not empty and is not this example's: pass --data")
        shutil.rmtree(path)
    make_data_folder()


def child_environment(args: argparse.Namespace, data: Path) -> dict[str, str]:
    """The WEBHOOK_SYNC_* settings of this run (set in this process too), and the environment
    of the children."""
    settings = {
        "WEBHOOK_SYNC_DATA": str(data),
        "WEBHOOK_SYNC_PAGE_SIZE": str(args.page_size),
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
        self.run_state = Run()

        # Imported only now: the app reads the WEBHOOK_SYNC_* variables set in main().
        from . import app as example

        self.example = example

    # -- set-up ----------------------------------------------------------------------------

    def run(self) -> int:
        console = self.console
        console.say("webhook-sync demo: kill -9 the worker holding a sync's lease")
        console.detail(self.describe_broker(), "broker    ")
        console.detail(self.describe_database(), "database  ")
        console.detail(f"{shown_path(self.data / 'logs')}/", "logs      ")
        self.reset_database()
        self.purge_queue()
        upstream_url, receiver_url = self.start_processes()
        return self.sync_and_judge(upstream_url, receiver_url)

    def describe_broker(self) -> str:
        from kombu.utils.url import maybe_sanitize_url

        url = self.example.BROKER
        shown = maybe_sanitize_url(url) if "@" in url else url
        if url.startswith(("atomicfs:", "filesystem:")):
            return f"{shown} (message files in {shown_path(self.data / 'broker')}, no server)"
        return shown

    def describe_database(self) -> str:
        import sqlalchemy as sa

        url = sa.engine.make_url(self.example.DATABASE)
        if url.get_backend_name() == "sqlite" and url.database:
            url = url.set(database=shown_path(Path(url.database)))
        shown = url.render_as_string(hide_password=True)
        return f"{shown} (tables {self.example.LEASES_TABLE}, {self.example.EVENTS.name})"

    def reset_database(self) -> None:
        import sqlalchemy as sa

        from . import sink

        example = self.example
        try:
            engine = sink.engine(example.DATABASE)
            sink.reset(engine, example.EVENTS, example.LEASES_TABLE, f"{example.LEASES_TABLE}_keys")
            sink.create(engine, example.EVENTS)
        except sa.exc.SQLAlchemyError as exc:
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

    def start_processes(self) -> tuple[str, str]:
        args, console, children = self.args, self.console, self.children
        python = sys.executable
        upstream = children.start(
            "upstream",
            [
                *(python, "-m", "examples.webhook_sync.upstream", "--seed", args.seed),
                *("--events", str(args.events), "--latency", str(args.page_latency)),
                *("--error-rate", str(args.error_rate)),
            ],
        )
        upstream_url = upstream.wait_for(r"listening on (http://\S+)", timeout=30)[1]
        children.env["WEBHOOK_SYNC_UPSTREAM"] = upstream_url
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
        receiver_url = receiver.wait_for(r"listening on (http://\S+)", timeout=30)[1]
        console.say(f"upstream  {upstream_url}/events (pid {upstream.pid})")
        console.detail(
            f"{args.events:,} events for {ACCOUNT}, {args.page_size} a page, "
            f"{args.page_latency:g} s a page, {args.error_rate:.0%} answered 429 or 500"
        )
        console.say(f"webhook   {receiver_url}/webhooks/<account> (pid {receiver.pid})")
        for worker in self.workers.values():
            worker.wait_for(r"\S+@\S+ ready\.", timeout=60)
        beat.wait_for(r"beat: Starting\.\.\.", timeout=60)
        pids = ", ".join(f"{name} (pid {w.pid})" for name, w in self.workers.items())
        console.say(f"workers   {pids}: prefork, one pool process each")
        console.say(
            f"beat      pid {beat.pid}: reaper every {self.example.REAP_EVERY_SECONDS:g} s; "
            f"a lease lasts {self.example.LEASE_SECONDS:g} s without renewal"
        )
        return upstream_url, receiver_url

    # -- the sync --------------------------------------------------------------------------

    def sync_and_judge(self, upstream_url: str, receiver_url: str) -> int:
        status, answer = http("POST", f"{receiver_url}/webhooks/{ACCOUNT}")
        state = self.run_state
        state.job_id = answer["job"]
        state.started_sync = self.console.elapsed()
        self.console.say(f"POST /webhooks/{ACCOUNT} -> {status}, job {state.job_id}")
        self.watch()
        self.console.progress(0, 0, "")
        return self.verdict(upstream_url)

    def watch(self) -> None:
        from celery_leases import get_job

        app, console, state = self.example.app, self.console, self.run_state
        deadline = time.monotonic() + self.args.timeout
        seen_attempts = 0
        while True:
            job = get_job(app, state.job_id)
            if job is not None:
                if job.attempts > seen_attempts and job.owner:
                    seen_attempts = job.attempts
                    if state.killed_at_wall is None:
                        console.say(
                            f"{worker_name(job.owner)} claimed the job: attempt {job.attempts}, "
                            f"token {job.token}"
                        )
                    else:
                        self.report_resume(job)
                total = job.progress_total or self.args.events
                where = f"page {(job.checkpoint or {}).get('pages', 0)}  "
                if job.state != "running" and job.state != "queued":
                    where += job.state
                elif state.killed_at_wall is not None and job.attempts == state.attempts_at_kill:
                    if job.state == "running":
                        left = max(job.expires_in or 0.0, 0.0)
                        where += f"{state.victim} killed, its lease ends in {left:.1f} s"
                    else:
                        where += "re-published by the reaper"
                else:
                    where += f"{worker_name(job.owner) or 'queued'}, attempt {job.attempts}"
                console.progress(job.progress_done or 0, total, where)
                if (
                    state.killed_at_wall is None
                    and job.state == "running"
                    and (job.progress_done or 0) >= KILL_AT * total
                ):
                    self.kill_lease_holder(job)
                if job.state in ("done", "failed", "cancelled"):
                    state.final = job
                    console.say(f"job {job.state} after {job.attempts} attempt(s)")
                    return
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the sync did not finish within {self.args.timeout:g} s; "
                    f"see the logs in {self.data / 'logs'}"
                )
            time.sleep(0.05)

    def kill_lease_holder(self, job: Any) -> None:
        from celery_leases import get_job

        console, state = self.console, self.run_state
        name = worker_name(job.owner)
        worker = self.workers[name]
        worker.kill_group()
        state.killed_at_wall = time.time()
        worker.process.wait(10)
        after = get_job(self.example.app, state.job_id)
        assert after is not None
        state.victim = name
        state.killed_at_db = after.created_at + after.age  # the DB clock, read just now
        state.checkpoint_at_kill = after.checkpoint or {}
        state.attempts_at_kill = after.attempts
        console.say(
            f"SIGKILL {name}: pid {worker.pid} and its pool process, holding the lease at "
            f"{after.progress_done or 0:,}/{after.progress_total or 0:,} events"
        )
        checkpoint = state.checkpoint_at_kill
        left = max(after.expires_in or 0.0, 0.0)
        console.detail(
            f"last checkpoint: page {checkpoint.get('pages')}; "
            f"the lease would expire in {left:.1f} s, but the holder's process is gone: the "
            "next reaper pass publishes the job again"
        )

    def report_resume(self, job: Any) -> None:
        console, state = self.console, self.run_state
        name = worker_name(job.owner)
        state.resumed_by = name
        state.resumed_at_db = job.claimed_at
        checkpoint = state.checkpoint_at_kill
        delay = (job.claimed_at or 0.0) - (state.killed_at_db or 0.0)
        console.say(
            f"{name} resumed the job: attempt {job.attempts}, after page "
            f"{checkpoint.get('pages')}, {delay:.2f} s after the kill"
        )
        survivor = self.workers.get(name)
        if survivor is None:
            return
        for pattern in (rf"{state.job_id}.*re-published", r"resumes after page"):
            line = self.find_log_line(survivor, pattern)
            if line:
                console.detail(line, f"{name} log: ")

    @staticmethod
    def find_log_line(child: Child, pattern: str, timeout: float = 2.0) -> str | None:
        """The message of the last log line matching ``pattern`` (waiting up to ``timeout`` s)."""
        import re

        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            lines = [line for line in child.log_text().splitlines() if regex.search(line)]
            if lines:
                return lines[-1].split("]: ", 1)[-1]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    # -- the verdict -----------------------------------------------------------------------

    def verdict(self, upstream_url: str) -> int:
        from . import sink
        from .upstream import generate_events

        args, console, example, state = self.args, self.console, self.example, self.run_state
        _, stats = http("GET", f"{upstream_url}/stats")
        ids = sink.stored_ids(sink.engine(example.DATABASE), example.EVENTS, ACCOUNT)
        expected = {e["id"] for e in generate_events(args.seed, ACCOUNT, args.events)}
        stored = set(ids)
        missing, unknown = len(expected - stored), len(stored - expected)
        checks: list[tuple[bool, str]] = []

        checks.append(
            (
                len(ids) == len(stored) == len(expected) and not missing and not unknown,
                f"every event stored exactly once: {len(ids):,} rows, {len(stored):,} distinct "
                f"ids, {len(expected):,} upstream, {missing} missing",
            )
        )

        again = stats["pages_served_more_than_once"]
        extra = sum(page["served"] - 1 for page in again)
        which = ", ".join(f"page {page['page']} x{page['served']}" for page in again)
        checks.append(
            (
                extra <= 1,
                f"pages fetched again after the kill: {extra}"
                + (f" ({which})" if which else "")
                + ", at most 1 expected",
            )
        )

        served_after = [
            t
            for page in stats["pages"]
            for t in page["fetched_at"]
            if state.killed_at_wall is not None and t > state.killed_at_wall
        ]
        if state.resumed_by and state.resumed_at_db and state.killed_at_db:
            claim = state.resumed_at_db - state.killed_at_db
            first_page = min(served_after) - (state.killed_at_wall or 0.0) if served_after else None
            text = f"resumed on {state.resumed_by} after the kill of {state.victim}: claimed "
            text += f"{claim:.2f} s later (DB clock)"
            if first_page is not None:
                text += f", next page {first_page:.2f} s later"
            checks.append((state.resumed_by != state.victim, text))
        elif state.killed_at_wall is None:
            checks.append((False, "resumed after the kill: the sync ended before the kill"))
        else:
            checks.append((False, f"resumed after the kill of {state.victim}: never"))

        job = state.final
        result = job.result if job is not None else None
        if job is not None and job.state == "done":
            ok = isinstance(result, dict) and result.get("events") == args.events
            attempts = f"{job.attempts} attempt{'s' if job.attempts != 1 else ''}"
            text = f"job done: {attempts}, result {json.dumps(result)}"
        else:
            ok = False
            text = f"job done: no, {getattr(job, 'state', 'unknown')} ({getattr(job, 'error', '')})"
        checks.append((ok, text))

        errors = {k: v for k, v in stats["statuses"].items() if k != "200"}
        error_text = ", ".join(f"{k} x{v}" for k, v in errors.items()) or "none"
        if not self.args.quiet:
            console.always()
        console.always("Verdict")
        for ok, text in checks:
            lead = "  ok    " if ok else "  FAIL  "
            console.always(
                textwrap.fill(text, WIDTH - 1, initial_indent=lead, subsequent_indent=" " * 8)
            )
        total = console.elapsed()
        console.always(
            f"  info  total {total:.1f} s (sync {total - state.started_sync:.1f} s); "
            f"upstream errors retried: {error_text}"
        )
        failed = sum(1 for ok, _ in checks if not ok)
        if failed:
            logs = shown_path(self.data / "logs")
            console.always(f"FAIL: {failed} of {len(checks)} checks failed; logs in {logs}")
            return 1
        console.always("PASS: the sync survived kill -9 of the worker holding its lease")
        return 0


if __name__ == "__main__":
    sys.exit(main())
