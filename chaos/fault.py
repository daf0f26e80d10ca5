"""The faults of a chaos run: a seeded plan, and how each kind is done to real processes.

Kinds: ``kill_child`` (SIGKILL one prefork pool process), ``kill_worker`` (SIGKILL a whole
worker, then start a replacement), ``freeze`` (SIGSTOP a whole worker for longer than the
lease, then SIGCONT), ``sigterm`` (warm shutdown, then start a replacement),
``restart_database`` (``pg_ctlcluster ... restart`` of the local PostgreSQL) and
``restart_broker`` (``redis-cli shutdown nosave`` and a fresh ``redis-server``: the queue is
lost; the result backend's database is kept, as a persistent result store would be).

``failover`` (``--database postgres-failover --failover``): the run's leases database is a
private PostgreSQL primary and synchronous standby of its own (``tests/support/replica.py``, on
``/dev/shm``; the shared server is not touched), every process of the run connecting through
libpq's multi-host URL of both (``target_session_attrs=read-write``), so it follows a promotion
by itself. The fault crashes the primary (immediate shutdown: every connection cut, nothing
flushed), promotes the standby, then builds a new standby from the promoted server
(pg_basebackup) on the old primary's port and directory and waits until it streams
synchronously again, so the next ``failover`` can happen. Replication is synchronous: a commit
returns once the standby flushed it, so a failover loses no committed transaction, and every
invariant must hold across it. The unit log, the callbacks', triggers', checkpoint, state and
cursor logs live in the leases database and fail over with it. A service kind: weighted and
capped as the restarts, landing mid-run.

``freeze_in_transaction`` is a freeze from inside a transactional checkpoint: the driver leaves
a request in the run's hold directory, and the next ``chaos.exactly_once`` checkpoint that finds
it SIGSTOPs its own worker after its checkpoint statement, before the commit (the job's row
stays locked), or the next ``chaos.keyed`` unit after its cursor write, before its checkpoint
(the key's cursor row and the job's row locked; in a run with keyed jobs every other request
waits for a keyed unit, so both kinds of transaction freeze); the driver thaws it like a
``freeze``. Only
where the database bounds an idle transaction (PostgreSQL, MariaDB): on SQLite it would hold
the whole file's write lock.

Control kinds act on a job, not on a process: ``revoke`` (``app.control.revoke(id,
terminate=True)`` of a job running under a live lease on a live worker) and ``cancel``
(``celery leases cancel`` through the store: ``Store.cancel_queued`` of a queued job,
``Store.request_stop(..., "cancel")`` of a running one). Their keyed kinds act on a keyed job
while it waits: ``revoke_keyed`` (``revoke(id)`` of a queued keyed job, or of the id triggers
wait under on a busy key, before their run exists) and ``cancel_keyed`` (``Store.cancel_queued``
of either: nothing to cancel for the id of waiting triggers).

``kill_client`` starts a client (``chaos/client.py``) that calls chaos jobs and keyed triggers
over a slow broker, and SIGKILLs it a seeded moment after it is ready: often between recording
a job and publishing it.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

WORKER_KINDS = ("kill_child", "kill_worker", "freeze", "sigterm")
TRANSACTION_KINDS = ("freeze_in_transaction",)
SERVICE_KINDS = ("restart_database", "restart_broker", "failover")
CONTROL_KINDS = ("revoke", "cancel")
KEYED_CONTROL_KINDS = ("revoke_keyed", "cancel_keyed")
CLIENT_KINDS = ("kill_client",)
KINDS = (
    WORKER_KINDS
    + TRANSACTION_KINDS
    + SERVICE_KINDS
    + CONTROL_KINDS
    + KEYED_CONTROL_KINDS
    + CLIENT_KINDS
)
FREEZE_KINDS = ("freeze", "freeze_in_transaction")

#: Relative frequency of each kind in a plan.
WEIGHTS = {
    "kill_child": 4.0,
    "kill_worker": 2.0,
    "freeze": 2.0,
    "freeze_in_transaction": 2.0,
    "sigterm": 2.0,
    "restart_database": 1.0,
    "restart_broker": 1.0,
    "failover": 1.0,
    "revoke": 1.5,
    "cancel": 1.5,
    "revoke_keyed": 1.0,
    "cancel_keyed": 1.0,
    "kill_client": 1.5,
}

#: A service restart disturbs every client of the server: at most one per this many faults
#: (of each service kind: a run of 50 faults has at most 2 failovers).
FAULTS_PER_SERVICE_RESTART = 25

#: ``--database`` of a run whose leases database is a private primary and synchronous
#: standby (``tests/support/replica.py``): the one ``failover`` faults need.
FAILOVER_DATABASE = "postgres-failover"
#: Connections the pair accepts (each worker, its pool processes, beat and the driver keep
#: a few: more than the harness's default).
FAILOVER_CONNECTIONS = 300

REDIS_START = [
    "redis-server",
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
]
#: Keys of other test runs kept across a Redis restart
#: (``tests.support.service.private_redis_url``).
REDIS_KEEP_PATTERN = "celery-leases-tests:*"


@dataclass(frozen=True)
class Fault:
    """One planned fault: done when the run's progress (fraction of units) reaches ``at``.

    ``pick`` (0..1) chooses the target among the candidates at that moment; ``seconds`` is
    how long a freeze lasts.
    """

    number: int
    kind: str
    at: float
    pick: float
    seconds: float

    def describe(self) -> str:
        extra = f" {self.seconds:.1f}s" if self.kind in FREEZE_KINDS else ""
        return f"#{self.number} {self.kind}{extra} @{self.at:.0%}"


def plan(
    rng: random.Random, *, count: int, kinds: tuple[str, ...], lease_seconds: float
) -> list[Fault]:
    """``count`` faults of ``kinds``, each kind at least once when ``count`` allows, service
    restarts capped; positions spread over 3-92% of the run's progress (15-75% for service
    restarts)."""
    services = [k for k in kinds if k in SERVICE_KINDS]
    others = [k for k in kinds if k not in SERVICE_KINDS]
    cap = max(1, count // FAULTS_PER_SERVICE_RESTART)
    chosen: list[str] = [k for k in (*others, *services)][:count]
    while len(chosen) < count:
        pool = [k for k in kinds if k not in SERVICE_KINDS or chosen.count(k) < cap]
        chosen.append(rng.choices(pool, weights=[WEIGHTS[k] for k in pool])[0])
    rng.shuffle(chosen)
    # Service restarts land mid-run, while many jobs are in flight.
    placed = sorted(
        (rng.uniform(0.15, 0.75) if kind in SERVICE_KINDS else rng.uniform(0.03, 0.92), kind)
        for kind in chosen
    )
    return [
        Fault(
            number=number,
            kind=kind,
            at=at,
            pick=rng.random(),
            seconds=lease_seconds * rng.uniform(1.5, 3.0),
        )
        for number, (at, kind) in enumerate(placed, start=1)
    ]


def try_again(faults: list[Fault], fault: Fault, progress: float) -> None:
    """Put ``fault``, due but without a target now, back into the rest of the plan
    (``faults``, in plan order) behind the faults already due at ``progress``: it must not hold
    them up, or near a run's end they wait until the jobs end and are never done (a keyed
    control tries ``KEYED_TARGET_TRIES`` times, one try a second: seed 1621539983)."""
    due = next((i for i, later in enumerate(faults) if later.at > progress), len(faults))
    faults.insert(due, fault)


# -- processes -----------------------------------------------------------------------------------

#: The environment variable naming a run's hold directory (``freeze_in_transaction``).
HOLD_DIR_ENV = "CHAOS_HOLD_DIR"


def ask_for_hold(hold_dir: Path, number: int, seconds: float, *, keyed: bool = False) -> None:
    """Ask the next transactional checkpoint (``keyed``: of a keyed job) to freeze its worker
    for ``seconds``."""
    written = hold_dir / f"tmp.{number}"  # not a request until renamed: complete when seen
    written.write_text(f"{seconds}")
    written.rename(hold_dir / f"request.{number}{'.keyed' if keyed else ''}")


def hold_if_asked(hold_dir: str, job_id: str, *, keyed: bool = False) -> None:
    """In a task, after its checkpoint statement, before the commit: take one pending request
    (an atomic rename: one taker; a request for a keyed job only if ``keyed``) and SIGSTOP
    this worker's whole process group."""
    for name in sorted(os.listdir(hold_dir)):
        if not name.startswith("request.") or (name.endswith(".keyed") and not keyed):
            continue
        group = os.getpgrp()
        try:
            os.rename(
                os.path.join(hold_dir, name), os.path.join(hold_dir, f"held.{group}.{job_id}")
            )
        except OSError:
            continue  # another checkpoint took it
        os.killpg(group, signal.SIGSTOP)
        return


def taken_holds(hold_dir: Path) -> list[tuple[int, str, float, float]]:
    """The requests taken since the last call, as (worker pid, job id, seconds, when it was
    taken: the rename's ctime, epoch seconds, just before the worker stopped); removed."""
    taken = []
    for path in sorted(hold_dir.glob("held.*")):
        _, group, job_id = path.name.split(".", 2)
        taken.append((int(group), job_id, float(path.read_text()), path.stat().st_ctime))
        path.unlink()
    return taken


def drop_holds(hold_dir: Path) -> int:
    """Remove the requests nobody took; how many there were."""
    pending = list(hold_dir.glob("request.*"))
    for path in pending:
        path.unlink(missing_ok=True)
    return len(pending)


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group of ``pid`` (a worker and its pool: its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def kill_process(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


#: A PID namespace of its own (and a user namespace, so no privilege is needed where they are
#: allowed), with its own /proc: the command after it sees none of the machine's other pids.
UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]


def unshare_error() -> str | None:
    """Why ``UNSHARE`` cannot run a command here (its own error output), or None if it can."""
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux) on this machine"
    try:
        done = subprocess.run(
            [*UNSHARE, "sh", "-c", "test $$ -eq 1"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return repr(exc)
    if done.returncode != 0:
        return (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
    return None


# -- services ------------------------------------------------------------------------------------


def local_postgres(url: str) -> bool:
    """True when ``url`` is PostgreSQL on this machine's default port (we can restart it)."""
    parts = urlsplit(url)
    return (
        parts.scheme.startswith("postgresql")
        and parts.hostname in ("127.0.0.1", "localhost")
        and (parts.port in (None, 5432))
    )


def local_redis(url: str) -> bool:
    parts = urlsplit(url)
    return (
        parts.scheme == "redis"
        and parts.hostname in ("127.0.0.1", "localhost")
        and (parts.port in (None, 6379))
    )


def can_restart_postgres(url: str) -> bool:
    """True when ``url`` is the local PostgreSQL and ``pg_ctlcluster`` can restart it."""
    return (
        local_postgres(url)
        and shutil.which("pg_ctlcluster") is not None
        and (Path("/etc/postgresql").is_dir())
    )


def can_restart_redis(url: str) -> bool:
    """True when ``url`` is the local Redis and ``redis-server`` can start it again."""
    return local_redis(url) and shutil.which("redis-server") is not None


def restart_postgres(timeout: float = 60) -> float:
    """Restart the local PostgreSQL cluster (fast shutdown); returns the seconds it took."""
    version = sorted(p.name for p in Path("/etc/postgresql").iterdir())[-1]
    started = time.monotonic()
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    return time.monotonic() - started


def restart_redis(
    url: str,
    *,
    keep_dbs: tuple[int, ...] = (),
    down_seconds: float = 0.5,
    timeout: float = 30,
) -> float:
    """Shut the local Redis down without saving (every queue is lost), start a fresh one, and
    put back the other test runs' database claims and every key of the databases ``keep_dbs``
    (a result backend standing for a persistent store). Returns the seconds it was down.

    The kept databases are copied while writes are paused (``CLIENT PAUSE WRITE``): the
    shutdown is queued behind the pause, so a write either made it into the copy or is
    answered with a connection error, which its client retries on the new server.
    """
    import redis

    base = urlsplit(url)._replace(path="/0").geturl()
    client = redis.Redis.from_url(base, socket_timeout=5)
    try:
        kept = {
            key: (client.dump(key), max(client.pttl(key), 0))
            for key in client.scan_iter(REDIS_KEEP_PATTERN)
        }
    finally:
        client.close()
    saved = {db: _copy_database(base, db) for db in keep_dbs} if keep_dbs else {}
    started = time.monotonic()
    subprocess.run(["redis-cli", "-u", base, "shutdown", "nosave"], capture_output=True, timeout=10)
    _wait(lambda: not _redis_answers(base), timeout, "Redis to stop")
    time.sleep(down_seconds)
    subprocess.run(REDIS_START, check=True, capture_output=True, timeout=10)
    _wait(lambda: _redis_answers(base), timeout, "Redis to answer again")
    down = time.monotonic() - started
    client = redis.Redis.from_url(base, socket_timeout=5)
    try:
        for key, (value, ttl) in kept.items():
            if value is not None:
                client.restore(key, ttl, value, replace=True)
    finally:
        client.close()
    for db, keys in saved.items():
        _restore_database(base, db, keys)
    return down


#: Milliseconds writes stay paused while the kept databases are copied before a restart.
PAUSE_MS = 1000


def _copy_database(base: str, db: int) -> dict[bytes, tuple[bytes, int]]:
    """Pause writes on the whole server (until the shutdown that follows ends the pause),
    then read every key of database ``db`` as DUMP values with their TTL (milliseconds)."""
    import redis

    client = redis.Redis.from_url(_with_db(base, db), socket_timeout=5)
    try:
        client.client_pause(PAUSE_MS, all=False)
        keys = list(client.scan_iter(count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.dump(key)
            pipe.pttl(key)
        values = pipe.execute()
    finally:
        client.close()
    return {
        key: (value, max(int(ttl), 0))
        for key, value, ttl in zip(keys, values[::2], values[1::2], strict=True)
        if value is not None
    }


def _restore_database(base: str, db: int, keys: dict[bytes, tuple[bytes, int]]) -> None:
    """Put ``keys`` (from :func:`_copy_database`) back in database ``db``; a key written
    since the restart (a retried write, newer) is left as it is."""
    import redis

    client = redis.Redis.from_url(_with_db(base, db), socket_timeout=5)
    try:
        pipe = client.pipeline(transaction=False)
        for key, (value, ttl) in keys.items():
            pipe.restore(key, ttl, value, replace=False)
        for outcome in pipe.execute(raise_on_error=False):
            if isinstance(outcome, Exception) and "BUSYKEY" not in str(outcome):
                raise outcome
    finally:
        client.close()


def _with_db(url: str, db: int) -> str:
    """``url`` on database ``db`` (the path of a Redis URL wins over a ``db=`` argument)."""
    return urlsplit(url)._replace(path=f"/{db}").geturl()


def _redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _wait(probe: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
